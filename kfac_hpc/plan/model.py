"""The cost model: predicted seconds per phase and bytes per rank of one training step.

Phases are those of the timing contract (``kfac_hpc.contracts.phases``); K-FAC work done every
``factor_update_steps`` / ``inv_update_steps`` steps is amortized over its interval. The
K-FAC layout is the preconditioner's own KAISA assignment (``kfac_hpc.comm.assignment``):
factors are allreduced over all ranks; each layer's A and G are decomposed on its A and G
workers and broadcast to its row of ``W = grad_worker_fraction · P`` grad workers; when
``W < P`` its preconditioned gradient is broadcast from the row down each receiver column of
``P / W`` ranks. Every collective is priced over its real members (placement.py). Memory
per rank is memory.py's (the one memory model). See docs/plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kfac_hpc.comm.assignment import KAISAAssignment
from kfac_hpc.comm.collectives import BROADCAST_BUCKET_MB
from kfac_hpc.contracts import PHASES
from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.optim.fosi.curvature_batch import subset_size
from kfac_hpc.optim.fosi.options import lanczos_steps
from kfac_hpc.plan.compute_costs import ComputeCosts, Tensors
from kfac_hpc.plan.layers import ModelShape
from kfac_hpc.plan.memory import (
    DeviceMemory,
    MemoryConfig,
    MemoryModel,
    basis_element_bytes,
    factor_copies,
    preconditioner_assignment,
)
from kfac_hpc.plan.overhead import JobOverhead
from kfac_hpc.plan.placement import nic_sharing, price_s
from kfac_hpc.plan.profiles import NetworkProfile

__all__ = [
    "ALL_METHODS",
    "BROADCAST_BUCKET_MB",
    "METHODS",
    "CostModel",
    "GroupCollective",
    "Host",
    "PlanConfig",
    "Prediction",
    "bucket_bytes",
    "collective_s",
    "kfac_assignment",
    "lanes_s",
    "shared_finish_s",
]

METHODS = ("sgd", "kfac-comm-opt", "kfac-hybrid-opt", "kfac-mem-opt")
ALL_METHODS = (*METHODS, "fosi")  # FOSI / DHO2 on request (--methods): not in the default
_FLOAT_BYTES = 4
# A Lanczos step's passes over this rank's coordinates in the basis' dtype, either mode
# (lanczos.py): ⟨Hq, q⟩ and ‖Hq‖² (3 reads), the recurrence's two updates of w (3 each), the
# residual's norm (1) and the new basis row (a read and a write).
_STEP_PASSES = 12
# A reorthogonalization pass's own passes over w besides its two reads of the basis: the
# projection's read of w, the correction written, then subtracted (3), the new norm (1).
_REORTH_PASSES = 6


def _fosi_default(name: str) -> Any:
    """The job's default of FOSI option ``name`` (contracts/options.py)."""
    return OPTIONS[name].default


@dataclass(frozen=True)
class PlanConfig:
    """One configuration: ``method`` of METHODS at ``ranks`` ranks; ``batch_size`` is the
    global batch split over the ranks (``strong``) or the batch of each rank (``weak``), as in
    ``kfac-hpc train``; the rest are the job's options of those names, with its defaults (the
    FOSI ones priced as ``CostModel._fosi`` says)."""

    method: str
    ranks: int
    batch_size: int
    scaling: str = "strong"
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    bucket_mb: float = 25.0
    fosi_k: int = _fosi_default("fosi_k")
    fosi_l: int = _fosi_default("fosi_l")
    ese_every: int = _fosi_default("ese_every")
    lanczos_iters: int | None = _fosi_default("lanczos_iters")
    grad_worker_fraction: float | None = None  # None: the strategy's (comm-opt 1, ...)
    fosi_curvature_fraction: float = _fosi_default("fosi_curvature_fraction")
    fosi_lanczos_dtype: str = _fosi_default("fosi_lanczos_dtype")
    fosi_reorthogonalize: str = _fosi_default("fosi_reorthogonalize")
    fosi_keep_basis: bool = _fosi_default("fosi_keep_basis")
    fosi_warmup: int = _fosi_default("fosi_warmup")
    fosi_ese_check: bool = _fosi_default("fosi_ese_check")
    steps: int | None = None  # the run's steps (None: a long run, the ESE's steady state)
    update_factors_in_hook: bool = OPTIONS["update_factors_in_hook"].default

    @property
    def kfac(self) -> bool:
        return self.method.startswith("kfac-")

    @property
    def strategy(self) -> str | None:
        return self.method[len("kfac-") :] if self.kfac else None

    @property
    def local_batch(self) -> int:
        return self.batch_size if self.scaling == "weak" else max(1, self.batch_size // self.ranks)

    @property
    def curvature_share(self) -> float:
        """The share of the local batch an ESE's products differentiate (the job's leading
        ⌈f · B⌉ rows, at least one; f = ``fosi_curvature_fraction``)."""
        return subset_size(self.local_batch, self.fosi_curvature_fraction) / self.local_batch

    @property
    def ese_per_step(self) -> float:
        """ESEs a step, as the job's ``ese`` phase averages them: over a run of ``steps``
        steps, the ESEs it runs (at steps ``fosi_warmup``, ``fosi_warmup`` + ``ese_every``,
        … below ``steps``) per step; without ``steps``, ``1 / ese_every``."""
        if self.steps is None:
            return 1 / self.ese_every
        if self.steps <= self.fosi_warmup:
            return 0.0
        return math.ceil((self.steps - self.fosi_warmup) / self.ese_every) / self.steps

    def memory_config(self) -> MemoryConfig:
        """The memory model's point of this configuration (its FOSI options included)."""
        return MemoryConfig(
            self.method, self.ranks, self.local_batch, fosi_k=self.fosi_k, fosi_l=self.fosi_l,
            lanczos_iters=self.lanczos_iters, grad_worker_fraction=self.grad_worker_fraction,
            fosi_keep_basis=self.fosi_keep_basis, fosi_lanczos_dtype=self.fosi_lanczos_dtype,
            fosi_curvature_fraction=self.fosi_curvature_fraction,
        )  # fmt: skip


@dataclass(frozen=True)
class Prediction:
    """Seconds per phase (amortized per step), seconds per step outside every phase
    (``other_s``: the job's and the preconditioner's bookkeeping) and the fullest rank's peak
    bytes (memory.py)."""

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
    # the straggler model: each rank's compute between two collectives varies with this
    # coefficient of variation (independent, normal); the collective waits for the slowest
    compute_cv: float = 0.0
    # measured (ranks, slowdown) of compute when that many ranks compute at once (the
    # largest count <= P is used); when given it replaces the cores ratio
    slowdown: tuple[tuple[int, float], ...] = ()


def collective_s(net: NetworkProfile, kind: str, nbytes: float, ranks: int) -> float:
    """One collective over ranks 0 … ``ranks``−1, placed ``net.ranks_per_node`` to a node
    (placement.py: the algorithm the backend picks for that size and span)."""
    return price_s(net, kind, nbytes, range(ranks))


@dataclass(frozen=True)
class GroupCollective:
    """One collective of a K-FAC phase over the members the KAISA assignment gives it:
    ``kind`` of ``nbytes`` from ``root`` over ``members``. Collectives of one ``lane`` (one
    grad-worker row or receiver column) run one after another; lanes run at the same time."""

    phase: str
    kind: str
    nbytes: float
    members: tuple[int, ...]
    root: int
    lane: int


def lanes_s(net: NetworkProfile, collectives: list[GroupCollective]) -> float:
    """The slowest lane's total: each collective priced on its members, with the NICs of a
    node shared by the lanes that cross nodes from it."""
    groups = {c.lane: c.members for c in collectives}
    sharing = nic_sharing(net, list(groups.values()))
    totals: dict[int, float] = {}
    for c in collectives:
        totals[c.lane] = totals.get(c.lane, 0.0) + price_s(
            net, c.kind, c.nbytes, c.members, sharing
        )
    return max(totals.values(), default=0.0)


def shared_finish_s(work: list[float], slowdown: Callable[[int], float]) -> list[float]:
    """Each rank's finish time when every rank starts its ``work`` (seconds on a core alone)
    at once and the ranks still computing share the cores: while ``k`` of them compute, each
    advances at ``1 / slowdown(k)`` of its pace alone (a rank done, waiting in the next
    collective, frees its share)."""
    order = sorted(range(len(work)), key=work.__getitem__)
    finish = [0.0] * len(work)
    clock = done = 0.0
    for index, rank in enumerate(order):
        clock += (work[rank] - done) * slowdown(len(work) - index)
        done = work[rank]
        finish[rank] = clock
    return finish


def _spread(finish: list[float]) -> tuple[float, float]:
    """(mean over ranks, slowest − mean) of per-rank times: the job's records report a
    phase's mean over ranks; the ranks done early spend the difference waiting in the
    collective after it."""
    mean = sum(finish) / len(finish)
    return mean, max(finish) - mean


def bucketed_allreduce_s(net: NetworkProfile, nbytes: float, ranks: int, bucket_mb: float) -> float:
    """Allreduce of ``nbytes`` in buckets of at most ``bucket_mb`` MiB (one collective each)."""
    cap = bucket_mb * 2**20
    full, rest = divmod(nbytes, cap)
    out = full * collective_s(net, "allreduce", cap, ranks)
    return out + (collective_s(net, "allreduce", rest, ranks) if rest else 0.0)


def bucket_bytes(sizes: list[int], cap: float) -> list[int]:
    """The bytes of each bucket that tensors of ``sizes`` bytes, queued in order, are sent in
    (``kfac_hpc.comm.collectives``' bucket queue): a tensor that does not fit in the open
    bucket launches it first, a bucket that reaches ``cap`` is launched at once, the rest at
    the end; ``cap`` 0: one bucket a tensor."""
    out: list[int] = []
    open_ = 0
    for size in sizes:
        if open_ and open_ + size > cap:
            out.append(open_)
            open_ = 0
        open_ += size
        if open_ >= cap:
            out.append(open_)
            open_ = 0
    return out + ([open_] if open_ else [])


class CostModel:
    """Predictions for one model shape on one machine (compute), network and device memory
    (``device``: a GPU's code paths, context and workspaces; None: this machine's CPU)."""

    def __init__(
        self,
        shape: ModelShape,
        compute: ComputeCosts,
        network: NetworkProfile,
        host: Host = Host(),
        device: DeviceMemory | None = None,
    ) -> None:
        self.shape, self.compute, self.network, self.host = shape, compute, network, host
        self.device = device
        self.memory = MemoryModel(shape.model, shape.dataset)

    def _contention(self, ranks: int) -> float:
        """Compute slows down by the measured slowdown at the largest rank count <= ``ranks``
        when the host has one, else by the threads a node's ranks run / its cores, when
        above 1."""
        if self.host.slowdown:
            return max((p for p in self.host.slowdown if p[0] <= ranks), default=(1, 1.0))[1]
        if not self.host.cores_per_node:
            return 1.0
        on_node = min(ranks, self.network.ranks_per_node)
        return max(1.0, on_node * self.host.threads_per_rank / self.host.cores_per_node)

    def _wait(self, ranks: int, work_s: float) -> float:
        """The wait of a collective over ``ranks`` after ``work_s`` of (uncontended) compute:
        the measured sync fit, plus the straggler model's wait for the slowest rank, the
        expected maximum of ``ranks`` normal deviates, ``cv · work_s · √(2 ln P)``."""
        if ranks <= 1:
            return 0.0
        slowest = self.host.compute_cv * work_s * math.sqrt(2 * math.log(ranks))
        fits = [fit for fit in self.host.sync if fit[0] <= ranks]
        if not fits:
            return slowest
        _, a, b = max(fits)
        return max(0.0, a + b * work_s) + slowest

    def _lead_wait(self, ranks: int, work: list[float], behind: float) -> float:
        """The wait in the collective after work that differs by rank (``work``: uncontended
        seconds of each rank, or of each row), whose busiest rank finishes ``behind`` after the
        ranks' mean: the ranks done early wait that long for it, and the wait of ranks that
        compute alike (the sync fit, measured after equal work on every rank at once) plays
        out while they do, over the work every rank does (the least). The two overlap: the
        larger is the wait. Equal work: :meth:`_wait` of it."""
        return max(behind, self._wait(ranks, min(work)))

    def predict(self, cfg: PlanConfig) -> Prediction:
        phases = dict.fromkeys(PHASES, 0.0)
        slow = self._contention(cfg.ranks)
        forward, backward = self.compute.forward_backward_s(cfg.local_batch)
        if cfg.kfac:
            # the hooks' work (capturing, factor reduction in the hooks) on factor steps only;
            # without hook updates they keep the output gradients and step() computes the
            # factors (factor_compute)
            hooked = self.compute.forward_backward_s(cfg.local_batch, kfac=True)
            in_hooks = hooked[1] - backward
            if not cfg.update_factors_in_hook:
                in_hooks -= self._factors_s(cfg)
            forward += max(0.0, hooked[0] - forward) / cfg.factor_update_steps
            backward += max(0.0, in_hooks) / cfg.factor_update_steps
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
        if cfg.method == "fosi":
            self._fosi(cfg, phases, slow, forward, backward)
        if cfg.kfac:
            self._kfac(cfg, phases, slow)
        memory = self.memory.predict(cfg.memory_config(), self.device).peak_bytes
        # outside every phase: the job's bookkeeping and the preconditioner's own bookkeeping
        # around its timed phases
        other = self.host.job.step_s * slow
        if cfg.kfac:
            other += self.compute.kfac_overhead_s(cfg.local_batch) * slow
        return Prediction(cfg, phases, memory, other)

    def _kfac(self, cfg: PlanConfig, phases: dict[str, float], slow: float) -> None:
        """Fill the K-FAC phases. Phases whose work differs by rank (eigendecompositions,
        preconditioning) are the mean over ranks, as the job records them; the busiest rank's
        lead is the others' wait in the collective after it (``_spread``)."""
        layers, p = self.shape.layers, cfg.ranks
        assignment = kfac_assignment(self.shape, cfg)
        f, i = cfg.factor_update_steps, cfg.inv_update_steps
        factor_elements = sum(layer.factor_elements for layer in layers)
        factor_bytes = factor_elements * _FLOAT_BYTES
        factors = self._factors_s(cfg)
        # after the reduction (preconditioner._commit_factors): the finiteness check of the
        # factors this rank keeps and of every gradient, the agreement across ranks (one
        # allreduce of a flag), the running averages' update of the factors it keeps; the
        # mean over ranks (the same work on each under COMM-OPT)
        share = factor_copies(assignment) / p
        kept = Tensors(2 * len(layers) * share, factor_elements * share)
        checked = Tensors(kept.number + self.shape.param_tensors, kept.elements + self.shape.params)
        commit = self.compute.factor_commit_s(kept, checked)
        # the agreement waits as the sync fit says after the check before it (priced with the
        # commit: the check and the averages' update are one loop)
        agreement = collective_s(self.network, "allreduce", 4, p) + self._wait(p, commit)
        # the factor GEMMs: in the backward hooks (priced in the backward), else here
        gemms = 0.0 if cfg.update_factors_in_hook else factors
        phases["factor_compute"] = (slow * (gemms + commit) + agreement) / f
        phases["factor_comm"] = (
            bucketed_allreduce_s(self.network, factor_bytes, p, cfg.bucket_mb)
            + self._wait(p, factors)
        ) / f
        # each rank decomposes the factors the assignment gives it, the ranks still at it
        # sharing the cores; the phase is the mean over ranks, the ranks done early wait for
        # the busiest in the broadcasts that follow
        eigh = [0.0] * p
        for n, layer in enumerate(layers):
            plan = assignment.plan(f"{n}")
            both = self.compute.layer_eigh_s(layer)
            a_part = self.compute.eigh_s(layer.n_a)
            a_share = a_part / (a_part + self.compute.eigh_s(layer.n_g))
            eigh[plan.a_worker] += both * a_share
            eigh[plan.g_worker] += both * (1 - a_share)
        mean, behind = _spread(shared_finish_s(eigh, self._contention))
        phases["inverse_compute"] = mean / i
        groups = self.kfac_collectives(cfg, assignment)
        inverse = [c for c in groups if c.phase == "inverse_comm"]
        if inverse:
            wait = self._lead_wait(p, eigh, behind)
            phases["inverse_comm"] = (lanes_s(self.network, inverse) + wait) / i
            behind = 0.0
        # each rank preconditions the layers of its grad-worker row (every row has W ranks)
        rows = [0.0] * len(assignment.rows)
        for n, layer in enumerate(layers):
            rows[assignment.plan(f"{n}").row] += self.compute.precondition_s(layer)
        work = [rows[assignment.row_of(rank)] for rank in range(p)]
        mean, late = _spread(shared_finish_s(work, self._contention))
        phases["precondition"] = mean
        # without inverse broadcasts the ranks wait for the busiest decomposer here instead
        behind = behind / i + late
        grads = [c for c in groups if c.phase == "grad_broadcast"]
        if grads:
            phases["grad_broadcast"] = lanes_s(self.network, grads) + self._lead_wait(
                p, rows, behind
            )
        else:  # one row: the next collective is the next step's gradient allreduce
            phases["grad_allreduce"] += behind

    def _factors_s(self, cfg: PlanConfig) -> float:
        """Every layer's factor update (the factor GEMMs) at the local batch."""
        return sum(self.compute.factor_s(layer, cfg.local_batch) for layer in self.shape.layers)

    def kfac_collectives(
        self, cfg: PlanConfig, assignment: KAISAAssignment | None = None
    ) -> list[GroupCollective]:
        """The broadcasts K-FAC runs over groups smaller than the world, as the assignment
        (the preconditioner's own) places them and as its ``AsyncBroadcaster`` sends them:
        the tensors of one source in one group packed into buckets of at most
        ``BROADCAST_BUCKET_MB`` MiB, one broadcast a bucket. ``inverse_comm``: each layer's
        eigenvectors and eigenvalues of A and of G from their workers to the layer's
        grad-worker row (one lane per row; the eigenvalues' outer product is computed on
        arrival, not sent); ``grad_broadcast``: each layer's preconditioned gradient from the
        row's member in each receiver column down the column (one lane per column)."""
        assignment = assignment or kfac_assignment(self.shape, cfg)
        # (phase, lane, members, root) -> the bytes of its tensors in the order they are queued
        queued: dict[tuple[str, int, tuple[int, ...], int], list[int]] = {}
        for n, layer in enumerate(self.shape.layers):
            plan = assignment.plan(f"{n}")
            if len(plan.grad_workers) > 1:
                for root, size in ((plan.a_worker, layer.n_a), (plan.g_worker, layer.n_g)):
                    key = ("inverse_comm", plan.row, plan.grad_workers, root)
                    eigenvectors, eigenvalues = size * size * layer.groups, size * layer.groups
                    queued.setdefault(key, []).extend(
                        (eigenvectors * _FLOAT_BYTES, eigenvalues * _FLOAT_BYTES)
                    )
        for lane, column in enumerate(assignment.columns):
            if len(column) == 1:
                continue
            for n, layer in enumerate(self.shape.layers):
                key = ("grad_broadcast", lane, column, assignment.grad_source(f"{n}", column[0]))
                queued.setdefault(key, []).append(layer.grad_elements * _FLOAT_BYTES)
        cap = BROADCAST_BUCKET_MB * 2**20
        return [
            GroupCollective(phase, "broadcast", nbytes, members, root, lane)
            for (phase, lane, members, root), sizes in queued.items()
            for nbytes in bucket_bytes(sizes, cap)
        ]

    def _fosi(
        self,
        cfg: PlanConfig,
        phases: dict[str, float],
        slow: float,
        forward: float,
        backward: float,
    ) -> None:
        """FOSI / DHO2 (docs/fosi.md): fill the phases as the job times them. Vectors and base
        state are sharded over coordinates (n/P per rank): every step the gradient is
        reduce-scattered (``grad_allreduce``), the shard updated (``optimizer``: the base
        optimizer on n/P coordinates, the projections on the k + l vectors, one allreduce of
        k + l numbers) and the parameters all-gathered (``param_allgather``).

        One ESE as the job runs it from its options, on the curvature batch (the leading
        ⌈``fosi_curvature_fraction`` · B⌉ rows of the local batch B; its passes priced at B
        times that share: per-kernel costs shrink with it too, so small shares read low): the
        loss and its gradient with graph (a forward and a backward); m = ``lanczos_steps``
        Lanczos steps (capped at n), each a Hessian-vector product (≈ 2 backward passes) of
        the vector gathered, the product reduce-scattered, in the parameters' dtype, and the
        step's passes over the shard in the basis' dtype (``fosi_lanczos_dtype``: 8 or 4 bytes;
        a float64 basis adds the casts to and from the parameters' float32); the Ritz vectors
        (the basis read once, k + l rows written); with ``fosi_ese_check``, the new subspace
        step's loss (a forward) and one allreduce of two numbers.
        ``fosi_reorthogonalize``: ``full`` passes over the basis at every step (step j reads its
        j + 1 rows twice; DGKS's rare second pass not priced); ``partial`` passes only where
        the basis drifts from orthogonal, which follows the wanted pairs' convergence and
        cannot be told beforehand: priced as no pass (the fewest it makes; 0-4 of 40 measured,
        docs/fosi.md). Likewise ``lanczos_tol``'s early stop is not predicted: all m steps are
        priced, and ``fosi_adaptive_ese`` as its shortest interval, ``ese_every``.
        ``fosi_keep_basis`` changes memory only (a fresh basis' first-touch page faults are not
        priced). The phase is one ESE times ``cfg.ese_per_step``: the job's per-step mean over
        the run, its warm-up included."""
        p, n = cfg.ranks, self.shape.params
        pairs = cfg.fosi_k + cfg.fosi_l
        iters = min(lanczos_steps(cfg.fosi_k, cfg.fosi_l, cfg.lanczos_iters), n)
        vector = n * _FLOAT_BYTES
        # a gather / reduce-scatter of n bytes moves half of what an allreduce of n bytes does
        half_allreduce = 0.5 * collective_s(self.network, "allreduce", vector, p)
        data = self.host.job.data_s_per_sample * cfg.local_batch
        phases["grad_allreduce"] = half_allreduce + self._wait(p, data + forward + backward)
        rate = self._memory_rate(cfg.local_batch)
        project = 2 * pairs * (vector / p) / rate  # V's shard read twice
        update = self.compute.optimizer_s(cfg.local_batch) / p + project
        # two allreduces, each after its half of the update: (V g, V v), then V d2
        phases["optimizer"] = slow * update + 2 * self._wait(p, update / 2)
        phases["optimizer"] += collective_s(self.network, "allreduce", 2 * pairs * 4, p)
        phases["optimizer"] += collective_s(self.network, "allreduce", pairs * 4, p)
        idle = self._wait(p, 0.0)  # of a collective after almost no compute
        phases["param_allgather"] = half_allreduce + idle
        share = cfg.curvature_share
        product = share * 2 * backward
        passes = share * (forward + backward) + iters * product
        checked = 0.0
        if cfg.fosi_ese_check:
            passes += share * forward
            wait = self._wait(p, share * forward)
            checked = collective_s(self.network, "allreduce", 16, p) + wait
        traffic, collectives = self._lanczos_steps(cfg, iters, idle)
        ese = slow * (passes + traffic / rate) + iters * 2 * half_allreduce
        # every collective waits as the sync fit says after the compute before it: the
        # product's reduce-scatter after the product, the vector's gather after almost none
        waits = iters * (self._wait(p, product) + idle)
        phases["ese"] = (ese + collectives + waits + checked) * cfg.ese_per_step

    def _lanczos_steps(self, cfg: PlanConfig, iters: int, idle: float) -> tuple[float, float]:
        """(bytes of elementwise traffic, seconds of small collectives, each with its wait
        ``idle`` after a few vector passes) of ``iters`` Lanczos steps outside their products
        and of the Ritz vectors they give, as lanczos.py runs them in ``cfg``'s basis dtype and
        reorthogonalization mode."""
        p, shard = cfg.ranks, self.shape.params / cfg.ranks
        width = basis_element_bytes(cfg.fosi_lanczos_dtype)
        # a float64 basis: the vector cast to the parameters' dtype for the product, the
        # product cast back (a read and a write each)
        casts = 0 if width == _FLOAT_BYTES else 2 * (width + _FLOAT_BYTES)
        traffic = iters * shard * (_STEP_PASSES * width + casts)

        # each step: ⟨Hq, q⟩ and ‖Hq‖² in one allreduce of 2 float64, the residual's norm in one
        def small(nbytes: int) -> float:
            return collective_s(self.network, "allreduce", nbytes, p) + idle

        collectives = iters * (small(16) + small(8))
        if cfg.fosi_reorthogonalize == "full":
            for j in range(iters):  # the basis' j + 1 rows read twice, j + 1 coefficients
                traffic += shard * width * (2 * (j + 1) + _REORTH_PASSES)
                collectives += small(8 * (j + 1)) + small(8)
        # the Ritz vectors: the basis' rows read once, the k + l vectors written
        traffic += shard * width * (iters + cfg.fosi_k + cfg.fosi_l)
        return traffic, collectives

    def _memory_rate(self, batch: int) -> float:
        """Bytes per second of elementwise traffic: the optimizer's (5 × 4 bytes per
        parameter for SGD with momentum) over its measured or rated time."""
        seconds = self.compute.optimizer_s(batch)
        return 5 * 4 * self.shape.params / seconds if seconds > 0 else float("inf")


def kfac_assignment(shape: ModelShape, cfg: PlanConfig) -> KAISAAssignment:
    """The preconditioner's KAISA assignment of ``shape``'s layers (keyed by their index, in
    registration order) at ``cfg``'s ranks and grad-worker fraction, under the
    preconditioner's default assignment options."""
    assert cfg.strategy is not None
    fraction = cfg.strategy if cfg.grad_worker_fraction is None else cfg.grad_worker_fraction
    layers = {f"{n}": (layer.n_a, layer.n_g, layer.groups) for n, layer in enumerate(shape.layers)}
    return preconditioner_assignment(layers, cfg.ranks, fraction)
