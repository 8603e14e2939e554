"""The cost model: predicted seconds per phase and bytes per rank of one training step.

Phases are those of the timing contract (``kfac_hpc.contracts.phases``); K-FAC work done every
``factor_update_steps`` / ``inv_update_steps`` steps is amortized over its interval. The
K-FAC layout follows KAISA: factors are allreduced over all ranks; each layer's
eigendecomposition is computed by one rank (LPT-balanced) and broadcast to the layer's
``W = grad_worker_fraction · P`` grad workers; when ``W < P`` the preconditioned gradient is
broadcast from its grad worker to the ``P / W`` ranks of its row. See docs/plan.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kfac_hpc.comm.assignment import lpt_schedule, parse_grad_worker_fraction
from kfac_hpc.contracts import PHASES
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute import ComputeCosts
from kfac_hpc.plan.layers import ModelShape
from kfac_hpc.plan.profiles import NetworkProfile

__all__ = ["METHODS", "CostModel", "PlanConfig", "Prediction", "collective_s"]

METHODS = ("sgd", "kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt")
_FLOAT_BYTES = 4


@dataclass(frozen=True)
class PlanConfig:
    """One configuration: ``method`` of METHODS at ``ranks`` ranks; ``batch_size`` is the
    global batch split over the ranks (``strong``) or the batch of each rank (``weak``), as in
    ``kfac-hpc train``."""

    method: str
    ranks: int
    batch_size: int
    scaling: str = "strong"
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    bucket_mb: float = 25.0

    @property
    def kfac(self) -> bool:
        return self.method != "sgd"

    @property
    def strategy(self) -> str | None:
        return self.method[len("kfac-") :] if self.kfac else None

    @property
    def local_batch(self) -> int:
        return self.batch_size if self.scaling == "weak" else max(1, self.batch_size // self.ranks)


@dataclass(frozen=True)
class Prediction:
    """Seconds per phase (amortized per step) and bytes of memory per rank."""

    config: PlanConfig
    phases_s: dict[str, float]
    memory_bytes: float

    @property
    def step_s(self) -> float:
        return sum(self.phases_s.values())


def _on_link(link: AlphaBeta, kind: str, nbytes: float, ranks: int) -> float:
    """One collective on one kind of link; an allreduce takes the faster of a ring and a tree
    (reduce then broadcast), as NCCL chooses between its ring and tree algorithms."""
    if kind != "allreduce":
        return link.time_s(kind, nbytes, ranks)
    tree = link.time_s("reduce", nbytes, ranks) + link.time_s("broadcast", nbytes, ranks)
    return min(link.time_s("allreduce", nbytes, ranks), tree)


def collective_s(net: NetworkProfile, kind: str, nbytes: float, ranks: int) -> float:
    """One collective over ``ranks`` ranks packed ``net.ranks_per_node`` to a node:
    allreduce = inside the node + across nodes on 1/L of the data per rank's NIC
    (hierarchical, rail-aligned); broadcast/reduce = tree across nodes, then inside."""
    if ranks <= 1:
        return 0.0
    local = min(ranks, net.ranks_per_node)
    nodes = math.ceil(ranks / local)
    if nodes == 1:
        return _on_link(net.intra, kind, nbytes, ranks)
    if kind == "allreduce":
        inside = _on_link(net.intra, kind, nbytes, local)
        return inside + _on_link(net.inter, kind, nbytes / local, nodes)
    return _on_link(net.inter, kind, nbytes, nodes) + _on_link(net.intra, kind, nbytes, local)


def bucketed_allreduce_s(net: NetworkProfile, nbytes: float, ranks: int, bucket_mb: float) -> float:
    """Allreduce of ``nbytes`` in buckets of at most ``bucket_mb`` MiB (one collective each)."""
    cap = bucket_mb * 2**20
    full, rest = divmod(nbytes, cap)
    out = full * collective_s(net, "allreduce", cap, ranks)
    return out + (collective_s(net, "allreduce", rest, ranks) if rest else 0.0)


class CostModel:
    """Predictions for one model shape on one machine (compute) and network."""

    def __init__(
        self,
        shape: ModelShape,
        compute: ComputeCosts,
        network: NetworkProfile,
        cores_per_node: int | None = None,
    ) -> None:
        """``cores_per_node``: when ranks share CPU cores (the local machine), compute
        slows down by ranks-on-a-node / cores once there are more ranks than cores."""
        self.shape, self.compute, self.network = shape, compute, network
        self.cores_per_node = cores_per_node

    def _contention(self, ranks: int) -> float:
        if self.cores_per_node is None:
            return 1.0
        on_node = min(ranks, self.network.ranks_per_node)
        return max(1.0, on_node / self.cores_per_node)

    def predict(self, cfg: PlanConfig) -> Prediction:
        phases = dict.fromkeys(PHASES, 0.0)
        slow = self._contention(cfg.ranks)
        forward, backward = self.compute.forward_backward_s(cfg.local_batch)
        if cfg.kfac:
            # the hooks' work (capturing, factor reduction in the hooks) on factor steps only
            hooked = self.compute.forward_backward_s(cfg.local_batch, kfac=True)
            forward += max(0.0, hooked[0] - forward) / cfg.factor_update_steps
            backward += max(0.0, hooked[1] - backward) / cfg.factor_update_steps
        phases["forward"], phases["backward"] = forward * slow, backward * slow
        grad_bytes = self.shape.params * _FLOAT_BYTES
        # + the job's two small allreduces per step (health flags, preemption agreement)
        phases["grad_allreduce"] = bucketed_allreduce_s(
            self.network, grad_bytes, cfg.ranks, cfg.bucket_mb
        ) + 2 * collective_s(self.network, "allreduce", 8, cfg.ranks)
        phases["optimizer"] = self.compute.optimizer_s() * slow
        memory: float = (
            3 * self.shape.params + cfg.local_batch * self.shape.activations_per_sample
        ) * 4
        memory += min(grad_bytes, cfg.bucket_mb * 2**20)
        if cfg.kfac:
            memory += self._kfac(cfg, phases, slow)
        return Prediction(cfg, phases, memory)

    def _kfac(self, cfg: PlanConfig, phases: dict[str, float], slow: float) -> float:
        """Fill the K-FAC phases; return the K-FAC bytes per rank."""
        layers, p = self.shape.layers, cfg.ranks
        assert cfg.strategy is not None
        workers = round(parse_grad_worker_fraction(cfg.strategy, p) * p)
        f, i = cfg.factor_update_steps, cfg.inv_update_steps
        factor_bytes = sum(layer.factor_elements for layer in layers) * _FLOAT_BYTES
        phases["factor_compute"] = (
            slow * sum(self.compute.factor_s(layer, cfg.local_batch) for layer in layers) / f
        )
        phases["factor_comm"] = (
            bucketed_allreduce_s(self.network, factor_bytes, p, cfg.bucket_mb) / f
        )
        eigh = [self.compute.layer_eigh_s(layer) for layer in layers]
        phases["inverse_compute"] = slow * _max_load(eigh, p) / i
        second_order = [
            (layer.n_a**2 + layer.n_g**2 + layer.n_a * layer.n_g) * layer.groups * _FLOAT_BYTES
            for layer in layers
        ]
        if workers > 1:
            phases["inverse_comm"] = (
                (workers / p)
                * sum(collective_s(self.network, "broadcast", b, workers) for b in second_order)
                / i
            )
        precondition = [self.compute.precondition_s(layer) for layer in layers]
        phases["precondition"] = slow * _max_load(precondition, p // workers)
        if workers < p:
            phases["grad_broadcast"] = sum(
                collective_s(
                    self.network, "broadcast", layer.grad_elements * _FLOAT_BYTES, p // workers
                )
                for layer in layers
            )
        return factor_bytes + (workers / p) * sum(second_order)


def _max_load(costs: list[float], bins: int) -> float:
    """The busiest bin's total when ``costs`` are spread over ``bins`` by LPT."""
    loads = [0.0] * max(1, bins)
    lpt_schedule(costs, len(loads), loads)
    return max(loads)
