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
from dataclasses import dataclass, field

from kfac_hpc.comm.assignment import KAISAAssignment, lpt_schedule
from kfac_hpc.contracts import PHASES
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import ComputeCosts
from kfac_hpc.plan.layers import ModelShape
from kfac_hpc.plan.overhead import JobOverhead
from kfac_hpc.plan.profiles import NetworkProfile

__all__ = [
    "ALL_METHODS",
    "METHODS",
    "CostModel",
    "Host",
    "PlanConfig",
    "Prediction",
    "collective_s",
]

METHODS = ("sgd", "kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt")
ALL_METHODS = (*METHODS, "fosi")  # FOSI / DHO2 on request (--methods): not in the default
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
    fosi_k: int = 10
    fosi_l: int = 0
    ese_every: int = 100
    lanczos_iters: int | None = None

    @property
    def kfac(self) -> bool:
        return self.method.startswith("kfac-")

    @property
    def strategy(self) -> str | None:
        return self.method[len("kfac-") :] if self.kfac else None

    @property
    def local_batch(self) -> int:
        return self.batch_size if self.scaling == "weak" else max(1, self.batch_size // self.ranks)


@dataclass(frozen=True)
class Prediction:
    """Seconds per phase (amortized per step), seconds per step outside every phase
    (``other_s``: the job's and the preconditioner's bookkeeping) and bytes per rank."""

    config: PlanConfig
    phases_s: dict[str, float]
    memory_bytes: float
    other_s: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.phases_s.values()) + self.other_s


@dataclass(frozen=True)
class Host:
    """What a node gives its ranks: ``cores_per_node`` (0: enough for every rank) shared by
    ranks of ``threads_per_rank`` threads; the job's per-step costs outside the model; the
    synchronization waits measured at each rank count (the largest measured count <= P is
    used; none measured: no wait)."""

    cores_per_node: int = 0
    threads_per_rank: int = 1
    job: JobOverhead = field(default_factory=JobOverhead)
    # (ranks, a, b): a collective after T s of compute waits max(0, a + b·T) beyond the
    # compute's contended time and its own α-β time
    sync: tuple[tuple[int, float, float], ...] = ()


def _on_link(link: AlphaBeta, kind: str, nbytes: float, ranks: int) -> float:
    """One collective on one kind of link; an allreduce takes the faster of a ring and a tree
    (reduce then broadcast), as NCCL chooses between its ring and tree algorithms."""
    if kind != "allreduce":
        return link.time_s(kind, nbytes, ranks)
    tree = link.time_s("reduce", nbytes, ranks) + link.time_s("broadcast", nbytes, ranks)
    return min(link.time_s("allreduce", nbytes, ranks), tree)


def _inside(net: NetworkProfile, kind: str, nbytes: float, ranks: int) -> float:
    """One collective inside a node: the fit measured for it at ``ranks`` if there is one."""
    measured = net.measured_link(ranks, kind)
    if measured is not None:
        return measured.time_s(kind, nbytes, ranks)
    return _on_link(net.intra, kind, nbytes, ranks)


def collective_s(net: NetworkProfile, kind: str, nbytes: float, ranks: int) -> float:
    """One collective over ``ranks`` ranks packed ``net.ranks_per_node`` to a node:
    allreduce = inside the node + across nodes on 1/L of the data per rank's NIC
    (hierarchical, rail-aligned); broadcast/reduce = tree across nodes, then inside."""
    if ranks <= 1:
        return 0.0
    local = min(ranks, net.ranks_per_node)
    nodes = math.ceil(ranks / local)
    if nodes == 1:
        return _inside(net, kind, nbytes, ranks)
    if kind == "allreduce":
        inside = _inside(net, kind, nbytes, local)
        return inside + _on_link(net.inter, kind, nbytes / local, nodes)
    return _on_link(net.inter, kind, nbytes, nodes) + _inside(net, kind, nbytes, local)


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
        host: Host = Host(),
    ) -> None:
        self.shape, self.compute, self.network, self.host = shape, compute, network, host

    def _contention(self, ranks: int) -> float:
        """Compute slows down by the threads a node's ranks run / its cores, when above 1."""
        if not self.host.cores_per_node:
            return 1.0
        on_node = min(ranks, self.network.ranks_per_node)
        return max(1.0, on_node * self.host.threads_per_rank / self.host.cores_per_node)

    def _wait(self, ranks: int, work_s: float) -> float:
        """The wait of a collective over ``ranks`` after ``work_s`` of (uncontended) compute."""
        fits = [fit for fit in self.host.sync if fit[0] <= ranks]
        if ranks <= 1 or not fits:
            return 0.0
        _, a, b = max(fits)
        return max(0.0, a + b * work_s)

    def predict(self, cfg: PlanConfig) -> Prediction:
        phases = dict.fromkeys(PHASES, 0.0)
        slow = self._contention(cfg.ranks)
        forward, backward = self.compute.forward_backward_s(cfg.local_batch)
        if cfg.kfac:
            # the hooks' work (capturing, factor reduction in the hooks) on factor steps only
            hooked = self.compute.forward_backward_s(cfg.local_batch, kfac=True)
            forward += max(0.0, hooked[0] - forward) / cfg.factor_update_steps
            backward += max(0.0, hooked[1] - backward) / cfg.factor_update_steps
        data = self.host.job.data_s_per_sample * cfg.local_batch
        phases["forward"], phases["backward"] = forward * slow, backward * slow
        phases["data"] = data * slow
        grad_bytes = self.shape.params * _FLOAT_BYTES
        # the job's stop and preemption flags ride in the gradients' allreduce (no collective
        # of their own)
        phases["grad_allreduce"] = bucketed_allreduce_s(
            self.network, grad_bytes, cfg.ranks, cfg.bucket_mb
        ) + self._wait(cfg.ranks, data + forward + backward)
        optimizer = self.compute.optimizer_s(cfg.local_batch)
        phases["optimizer"] = optimizer * slow
        memory: float = (
            3 * self.shape.params + cfg.local_batch * self.shape.activations_per_sample
        ) * 4
        memory += min(grad_bytes, cfg.bucket_mb * 2**20)
        if cfg.method == "fosi":
            memory += self._fosi(cfg, phases, slow, backward)
        if cfg.kfac:
            memory += self._kfac(cfg, phases, slow)
        # outside every phase: the job's bookkeeping and the preconditioner's own bookkeeping
        # around its timed phases
        other = self.host.job.step_s * slow
        if cfg.kfac:
            other += self.compute.kfac_overhead_s(cfg.local_batch) * slow
        return Prediction(cfg, phases, memory, other)

    def _kfac(self, cfg: PlanConfig, phases: dict[str, float], slow: float) -> float:
        """Fill the K-FAC phases; return the K-FAC bytes per rank."""
        layers, p = self.shape.layers, cfg.ranks
        assert cfg.strategy is not None
        assignment = KAISAAssignment(
            {f"{n}": (layer.n_a, layer.n_g, layer.groups) for n, layer in enumerate(layers)},
            p,
            cfg.strategy,
        )
        workers = assignment.grad_worker_count
        f, i = cfg.factor_update_steps, cfg.inv_update_steps
        factor_bytes = sum(layer.factor_elements for layer in layers) * _FLOAT_BYTES
        factors = sum(self.compute.factor_s(layer, cfg.local_batch) for layer in layers)
        # + the factors' finiteness agreement across ranks (one allreduce of a flag)
        agreement = collective_s(self.network, "allreduce", 4, p)
        phases["factor_compute"] = (slow * factors + agreement) / f
        phases["factor_comm"] = (
            bucketed_allreduce_s(self.network, factor_bytes, p, cfg.bucket_mb)
            + self._wait(p, factors)
        ) / f
        eigh = _max_load([self.compute.layer_eigh_s(layer) for layer in layers], p)
        phases["inverse_compute"] = slow * eigh / i
        second_order = [
            (layer.n_a**2 + layer.n_g**2 + layer.n_a * layer.n_g) * layer.groups * _FLOAT_BYTES
            for layer in layers
        ]
        if workers > 1:
            broadcasts = sum(
                collective_s(self.network, "broadcast", b, workers) for b in second_order
            )
            phases["inverse_comm"] = ((workers / p) * broadcasts + self._wait(p, eigh)) / i
        precondition = _max_load(
            [self.compute.precondition_s(layer) for layer in layers], p // workers
        )
        phases["precondition"] = slow * precondition
        if workers < p:
            phases["grad_broadcast"] = sum(
                collective_s(
                    self.network, "broadcast", layer.grad_elements * _FLOAT_BYTES, p // workers
                )
                for layer in layers
            ) + self._wait(p, precondition)
        return self._kfac_bytes_per_rank(assignment, second_order)

    def _kfac_bytes_per_rank(self, assignment: KAISAAssignment, second_order: list[int]) -> float:
        """The K-FAC bytes of the fullest rank under the preconditioner's own KAISA
        assignment: the running factors (every factor on every rank under COMM-OPT, where they
        are allreduced; otherwise only the factors a rank decomposes, as they are reduced to
        their owner) plus the second-order data of the layers it preconditions."""
        layers, ranks = self.shape.layers, assignment.world_size
        allreduced = assignment.grad_worker_count == ranks
        every_factor = sum(layer.factor_elements for layer in layers) * _FLOAT_BYTES
        held = [every_factor if allreduced else 0.0] * ranks
        for n, (layer, data) in enumerate(zip(layers, second_order, strict=True)):
            plan = assignment.plan(f"{n}")
            for rank in plan.grad_workers:
                held[rank] += data
            if not allreduced:
                held[plan.a_worker] += layer.n_a**2 * layer.groups * _FLOAT_BYTES
                held[plan.g_worker] += layer.n_g**2 * layer.groups * _FLOAT_BYTES
        return max(held)

    def _fosi(
        self, cfg: PlanConfig, phases: dict[str, float], slow: float, backward: float
    ) -> float:
        """FOSI / DHO2 (docs/fosi.md): fill ``optimizer`` and ``ese``; return the bytes per rank
        beyond SGD's. Vectors and base state are sharded over coordinates (n/P per rank)."""
        p, n = cfg.ranks, self.shape.params
        pairs = cfg.fosi_k + cfg.fosi_l
        iters = cfg.lanczos_iters if cfg.lanczos_iters is not None else 4 * pairs
        vector = n * _FLOAT_BYTES
        # a gather / reduce-scatter of n bytes moves half of what an allreduce of n bytes does
        half_allreduce = 0.5 * collective_s(self.network, "allreduce", vector, p)
        # every step: the base optimizer on the shard, projections on the k + l vectors
        # (2 reads of V's shard), one allreduce of k + l numbers, the update gathered
        rate = self._memory_rate(cfg.local_batch)
        project = 2 * pairs * (vector / p) / rate
        phases["optimizer"] = slow * (self.compute.optimizer_s(cfg.local_batch) / p + project)
        phases["optimizer"] += collective_s(self.network, "allreduce", pairs * 4, p)
        phases["optimizer"] += half_allreduce
        # every ese_every steps: Lanczos, each iteration a Hessian-vector product (≈ 2
        # backward passes) on the local batch, the vector gathered and the product
        # reduce-scattered, and full reorthogonalization against the earlier vectors
        reorth = sum(2 * j * vector / p for j in range(iters)) / rate
        hvp = 2 * backward
        ese = slow * (iters * hvp + reorth) + iters * (
            2 * half_allreduce + collective_s(self.network, "allreduce", 8, p)
        )
        phases["ese"] = ese / cfg.ese_every
        # weights and gradients whole; momentum, velocity and V sharded (SGD: momentum whole)
        return (pairs + 2) * vector / p - vector

    def _memory_rate(self, batch: int) -> float:
        """Bytes per second of elementwise traffic: the optimizer's (5 × 4 bytes per
        parameter for SGD with momentum) over its measured or rated time."""
        seconds = self.compute.optimizer_s(batch)
        return 5 * 4 * self.shape.params / seconds if seconds > 0 else float("inf")


def _max_load(costs: list[float], bins: int) -> float:
    """The busiest bin's total when ``costs`` are spread over ``bins`` by LPT."""
    loads = [0.0] * max(1, bins)
    lpt_schedule(costs, len(loads), loads)
    return max(loads)
