"""FOSI (Sivan et al., ICLR 2024) and its distributed design DHO2: one torch.optim-style class.

Every ``ese_every`` steps from step ``warmup`` on, an extreme-spectrum estimation (ESE) finds
the ``k`` largest and ``l`` smallest eigenpairs (V, λ) of the Hessian of the closure's loss.
A step then splits the gradient g of the objective (loss + weight decay) into g1 = Vᵀ(V g) and
the rest, keeps a velocity v ← βv + (1 − β)g1, takes the subspace Newton step
d1 = −α Vᵀ(|λ|⁻¹ ⊙ V v), lets the base optimizer update with the rest, projects that update d2
out of span(V) and applies θ ← θ + s·d2 + d1, s = clip(λ_max/λ_k, 1, clip) (1 for adaptive
bases), bounded so that s times the base's steady-state step on curvature λ_k is at most a
Newton step (docs/fosi.md, "Why it diverged"). Before the first ESE it is the base optimizer,
bit for bit.

Safeguards (each an option): Ritz pairs whose residual is above ``residual_tol`` × max|λ| are
dropped; after an ESE whose new subspace step raises the curvature batch's loss the base update
runs alone until the next ESE (``ese_check``); a non-finite gradient raises at its step
(``nonfinite_stop``).

With torch.distributed initialized, every vector (eigenvectors, Lanczos basis, velocity, base
state) is sharded over parameter coordinates: see sharding.py, sharded_base.py, pipeline.py.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.optim.fosi.ese_interval import next_interval, subspace_movement
from kfac_hpc.optim.fosi.flat_params import FlatParameters
from kfac_hpc.optim.fosi.hvp import HessianVectorProduct
from kfac_hpc.optim.fosi.lanczos import (
    ExtremeSpectrum,
    NonFiniteCurvature,
    converged_pairs,
    lanczos_extremes,
    warm_start_vector,
)
from kfac_hpc.optim.fosi.options import FOSIOptions, lanczos_basis_dtype
from kfac_hpc.optim.fosi.pipeline import CurvaturePipeline
from kfac_hpc.optim.fosi.sharded_base import ShardedBase, weight_decay_vector
from kfac_hpc.optim.fosi.sharding import CoordinateShard

__all__ = ["FOSI"]

Closure = Callable[[], torch.Tensor]
# the closure FOSI.step takes: called with no argument, or with ``curvature_fraction`` below 1
StepClosure = Callable[..., torch.Tensor]


def _no_lap(phase: str) -> None:
    """The default ``lap`` of :meth:`FOSI.step`: nobody times the step's parts."""


STATE_FORMAT = "fosi-full-v1"


def _same_kind(saved: dict[str, Any], live: dict[str, Any]) -> bool:
    """Whether a saved parameter group's settings are of the live base's kind (SGD-like,
    Adam-like; decoupled weight decay or not), for states that do not name their base."""
    for key in ("betas", "nesterov"):
        if (key in saved) != (key in live):
            return False
    key = "decoupled_weight_decay"
    return key not in saved or key not in live or bool(saved[key]) == bool(live[key])


def _cloned(tree: Any) -> Any:
    """``tree`` with every tensor copied (torch optimizers' state_dict() hands out their live
    buffers, and load_state_dict() keeps a tensor of the right dtype as it is)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_cloned(value) for value in tree]
    return tree


class FOSI(torch.optim.Optimizer):
    """FOSI / DHO2 around ``base`` (built on the same ``params``); see the module docstring and
    docs/fosi.md. ``model``: the module the parameters belong to, to keep its buffers
    (BatchNorm statistics) unchanged by ESE, and for forward-over-reverse HVPs when
    ``hvp="forward-over-reverse"`` (``"auto"`` is double backward).

    Its ``param_groups`` are the base's (the same dicts), so a learning-rate scheduler may be
    attached to either."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        base: torch.optim.Optimizer,
        k: int = 10,
        l: int = 0,  # noqa: E741 (the paper's name)
        alpha: float = 0.01,
        ese_every: int = 100,
        warmup: int = 20,
        lanczos_iters: int | None = None,
        clip: float = 3.0,
        *,
        model: nn.Module | None = None,
        **options: Any,
    ) -> None:
        self.options = FOSIOptions(k, l, alpha, ese_every=ese_every, warmup=warmup,
                                   lanczos_iters=lanczos_iters, clip=clip, **options)  # fmt: skip
        self.params = [p for g in base.param_groups for p in g["params"]]
        if {id(p) for p in params} != {id(p) for p in self.params}:
            raise ValueError("FOSI params: pass the parameters the base optimizer was built on")
        dtypes = {(p.dtype, p.device) for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(
                f"FOSI params: one dtype and device needed, got {sorted(map(str, dtypes))}"
            )
        super().__init__(self.params, {})
        self.param_groups = base.param_groups
        self.base, self.model = base, model
        bounds, start = [], 0
        for group in base.param_groups:
            size = sum(p.numel() for p in group["params"])
            bounds.append((start, start + size))
            start += size
        self.n, self.bounds = start, bounds
        if k + l > self.n:
            raise ValueError(
                f"FOSI option k={k} (+ l={l}) is invalid: use k + l <= {self.n}, the number of "
                "parameters"
            )
        self.pipeline: CurvaturePipeline | None = None
        distributed = dist.is_available() and dist.is_initialized()
        if self.options.curvature_ranks:
            if not distributed:
                raise ValueError("FOSI option curvature_ranks needs torch.distributed; use 0")
            self.pipeline = CurvaturePipeline(self.n, k + l, self.options.curvature_ranks)
            self.shard = self.pipeline.shard
        elif distributed:
            self.shard = CoordinateShard(self.n, dist.get_world_size(), dist.get_rank())
        else:
            self.shard = CoordinateShard(self.n, 1, 0)
        # the parameters become views of one flat buffer; this rank's coordinates of it
        self.flat = FlatParameters(self.params)
        self.local = self.shard.local(self.flat.values)
        self.sharded_base = (
            None if self.is_curvature_rank else ShardedBase(base, self.shard, bounds, self.local)
        )
        # zeros (n_r,): the dot product with it is 0 for a finite gradient, NaN otherwise
        self._zeros = torch.zeros(self.shard.size, dtype=self.flat.values.dtype,
                                  device=self.flat.values.device)  # fmt: skip
        self.step_count = 0
        self.ese_count = 0
        self.eigenvalues = torch.empty(0, dtype=torch.float64)
        self.vectors: torch.Tensor | None = None  # (K, n_r), this rank's coordinates
        self.velocity: torch.Tensor | None = None  # (n_r,)
        self.staleness: list[int] = []  # steps between snapshot and swap, per ESE
        # pipelined: steps whose update was the base's alone (the curvature was late), and the
        # step from which the eigenpairs in use are too old, for an ESE that was in flight when
        # the state was saved (its result is lost with the old run; None: none such)
        self.late_steps: list[int] = []
        self.late_from: int | None = None
        self.hvp_mode_used: str | None = None
        self.lanczos_basis_bytes = 0
        self._basis: torch.Tensor | None = None  # keep_basis: the basis, kept between ESEs
        self.last_ese_s = 0.0  # seconds of this rank's last ESE (0 on pipelined trainers)
        # pipelined training ranks: the seconds of every ESE swapped in (this run), as reported
        # by the curvature ranks with the result
        self.curvature_ese_s: list[float] = []
        self.last_lanczos_steps = 0  # Lanczos steps of this rank's last ESE
        self.last_reorthogonalized = 0  # of them, those that passed over the basis
        self.reestimated_at: list[int] = []  # steps whose ESE replaced eigenpairs dropped
        self.reestimate_pending = False  # an ESE is due at the next step, whatever the schedule
        self.top = 0  # how many of the eigenpairs are of the largest (the rest: the smallest)
        self.pairs_kept: list[int] = []  # per ESE: Ritz pairs that passed the residual test
        self.rejected_at: list[int] = []  # steps whose ESE's subspace step raised the loss
        # the ESE schedule with adaptive_ese: the next ESE's step and the interval it came from
        self.next_ese = self.options.warmup
        self.interval = self.options.ese_every
        self.movements: list[float] = []  # per synchronous ESE after the first: mean sin²
        self.intervals: list[int] = []  # per synchronous ESE: the steps to the next one
        self._last_estimate: torch.Tensor | None = None  # the last ESE's V (kept if rejected)
        self._extremes_of: tuple[torch.Tensor, tuple[int, int], float, float] | None = None

    # -- properties -------------------------------------------------------------------
    @property
    def is_curvature_rank(self) -> bool:
        """True on a rank given to ESE only (``curvature_ranks``); its gradients are unused."""
        return self.pipeline is not None and self.pipeline.is_curvature

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds: eigenvectors, velocity, base optimizer state, the zeros its
        non-finite check multiplies the gradient by, and the Lanczos basis of the last ESE
        (alive during ESE only; with ``keep_basis`` resident from the first ESE on)."""

        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.element_size() * t.numel()

        return {
            "eigenvectors_bytes": size(self.vectors),
            "velocity_bytes": size(self.velocity),
            "base_state_bytes": 0 if self.sharded_base is None else self.sharded_base.state_bytes(),
            "finite_probe_bytes": size(self._zeros),
            "lanczos_basis_bytes": self.lanczos_basis_bytes,
        }

    # -- the step ---------------------------------------------------------------------
    def ese_due(self) -> bool:
        """Whether the next :meth:`step` (step ``step_count``) runs or requests an ESE."""
        o = self.options
        if self.reestimate_pending:
            return True
        if o.adaptive_ese:
            return self.step_count >= self.next_ese
        return self.step_count >= o.warmup and (self.step_count - o.warmup) % o.ese_every == 0

    def reestimate_spectrum(self) -> None:
        """Drop the eigenpairs and the subspace velocity: the next step runs an ESE whatever
        the schedule (call it on every rank alike). For a state saved with another ``k`` or
        ``l`` (:meth:`load_full_state_dict` calls it then); the step is recorded in
        ``reestimated_at``."""
        self.eigenvalues = torch.empty(0, dtype=torch.float64)
        self.vectors = None
        self.velocity = None
        self._last_estimate = None
        self.top = 0
        self.reestimate_pending = True
        if self.step_count not in self.reestimated_at:
            self.reestimated_at.append(self.step_count)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: StepClosure | None = None, *, lap: Callable[[str], None] | None = None
    ) -> torch.Tensor | None:
        """One update from the parameters' ``.grad``; ``closure()`` (the curvature batch's
        loss, with graph) is called only when an ESE is due, as ``closure(f)`` with
        ``curvature_fraction`` f < 1 (the loss of that share of the batch). Returns the
        closure's last loss.

        ``lap(phase)`` (a phase timer's lap) is called as each part of the step ends:
        ``grad_allreduce`` (the gradient reduce-scatter), ``ese`` (on a rank that ran one),
        ``optimizer`` (the update of this rank's slice), ``param_allgather``."""
        lap = lap or _no_lap
        due = self.ese_due()
        self.reestimate_pending = False
        runs_ese = self.pipeline is None or self.is_curvature_rank
        if due and runs_ese and closure is None:
            raise ValueError(
                f"FOSI.step: an ESE is due at step {self.step_count}; pass closure= (a callable "
                "returning the curvature-batch loss with its graph)"
            )
        loss = None
        fraction = self.options.curvature_fraction
        if closure is not None and fraction < 1.0:
            closure = functools.partial(closure, fraction)
        seed = self.options.seed + self.ese_count  # of this ESE's Lanczos start vector
        self.ese_count += int(due)  # on every rank, whichever runs the ESE
        if self.is_curvature_rank:
            if due:
                assert closure is not None
                loss = self._serve(closure, seed)
                lap("ese")
            self.step_count += 1
            return loss
        self.flat.check()
        grads = self.flat.gradients()
        if self.options.average_gradients:
            g = self.shard.reduce_scatter_mean(grads)
        else:
            g = self.shard.local(grads)
        if self.options.nonfinite_stop:
            self._check_finite(g)
        lap("grad_allreduce")
        if due and self.pipeline is not None:
            self.pipeline.request(self.step_count, self.flat.values)
        elif due:
            assert closure is not None
            spectrum, loss = self._estimate(closure, seed)
            self._install(spectrum.eigenvalues, spectrum.vectors, self.step_count, spectrum.top)
            self._schedule()
            if self.options.ese_check:
                self._check_subspace(closure, g, loss)
            lap("ese")
        late = self.pipeline is not None and self._swap_arrived()
        if late:  # the eigenpairs in use are older than max_staleness allows
            assert self.sharded_base is not None
            self.late_steps.append(self.step_count)
            self.sharded_base.step(g)
        else:
            self._update(g)
        lap("optimizer")
        self._publish()
        lap("param_allgather")
        self.step_count += 1
        return loss

    def close(self) -> None:
        """End of training, on every rank: a pipelined training rank waits for the ESEs still
        in flight and drops their results, so that no message is left half-sent when the
        process group goes away (pipeline.drain). Nothing to do otherwise."""
        if self.pipeline is not None and not self.is_curvature_rank:
            self.pipeline.drain()

    @torch.no_grad()
    def serve_ese(self, step: int, index: int, closure: StepClosure) -> torch.Tensor | None:
        """A curvature rank driven by training rank 0's messages instead of :meth:`step`
        (the training job): run the ESE that training rank 0 requested at ``step``, the
        ``index``-th of the run (its Lanczos seed), on the snapshot it sends; returns the
        closure's last loss."""
        if not self.is_curvature_rank:
            raise ValueError("FOSI.serve_ese: only a curvature rank (curvature_ranks) serves ESEs")
        self.step_count, self.ese_count = step, index + 1
        self.reestimate_pending = False
        fraction = self.options.curvature_fraction
        if fraction < 1.0:
            closure = functools.partial(closure, fraction)
        return self._serve(closure, self.options.seed + index)

    def _serve(self, closure: Closure, seed: int) -> torch.Tensor | None:
        """A curvature rank: receive the snapshot, estimate, send every training rank its
        share of the result."""
        assert self.pipeline is not None
        self.pipeline.receive_snapshot(self.flat.values)
        spectrum, loss = self._estimate(closure, seed)
        self.pipeline.send(spectrum, self.params[0].dtype, self.last_ese_s)
        return loss

    def _swap_arrived(self) -> bool:
        """Pipelined training ranks, at a step boundary: swap in the curvature results that
        have arrived on every training rank (with ``max_staleness = 0``: wait for the one
        requested at this step); whether the eigenpairs in use are then older than the bound
        (an ESE requested ``max_staleness`` or more steps ago has not arrived, or one was in
        flight when the state was saved)."""
        pipeline, bound = self.pipeline, self.options.max_staleness
        assert pipeline is not None
        for _ in range(len(pipeline.pending) if bound == 0 else pipeline.arrived()):
            snapshot, values, vectors, top, seconds = pipeline.take()
            self._install(values, vectors, snapshot, top)
            self.curvature_ese_s.append(seconds)
        if self.late_from is not None and self.step_count >= self.late_from:
            return True
        return pipeline.late(self.step_count, bound)

    def _update(self, g: torch.Tensor) -> None:
        """Update this rank's coordinates (``self.local``, in place) given the mean gradient
        ``g``: θ' = θ + s·d2 + d1 (the base's update d2 in the buffer, then θ' there)."""
        assert self.sharded_base is not None
        V, v = self.vectors, self.velocity
        if V is None or v is None or V.shape[0] == 0:
            self.sharded_base.step(g)
            return
        o = self.options
        theta = self.local.clone()
        c_g, c_v = self._coefficients(theta, g)
        g1 = c_g @ V
        v.mul_(o.momentum).add_(g1, alpha=1 - o.momentum)
        # the base adds its weight decay itself: it gets the loss gradient minus g1
        self.sharded_base.step(g - g1)
        d2 = self.local.sub_(theta)  # the base's update d2, in the buffer
        # θ + s·(d2 − Vᵀ(V d2)) + d1 = θ + s·d2 + Vᵀ(c1 − s·V d2), c1 d1's coefficients: one
        # pass over V for the projection and the Newton step together
        scale = self._scale()
        c_d2 = self.shard.allreduce(V @ d2)
        d2.mul_(scale).add_(theta).add_((self._newton_coefficients(c_v) - scale * c_d2) @ V)

    def _schedule(self) -> None:
        """After a synchronous ESE: how far the subspace moved since the last one (recorded),
        and, with ``adaptive_ese``, the step of the next ESE (ese_interval.py)."""
        assert self.vectors is not None
        if self._last_estimate is not None:
            movement = subspace_movement(self.shard, self._last_estimate, self.vectors)
            self.movements.append(movement)
            if self.options.adaptive_ese:
                self.interval = next_interval(self.interval, movement, self.options.ese_every)
        self._last_estimate = self.vectors
        self.next_ese = self.step_count + self.interval
        self.intervals.append(self.interval)

    def _coefficients(self, theta: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(V g_obj, V v'): the gradient of the objective and the velocity after this step's
        update in the eigenbasis (k + l numbers each, one allreduce; V orthonormal)."""
        V, v = self.vectors, self.velocity
        assert V is not None and v is not None and self.sharded_base is not None
        wd = self.sharded_base.weight_decay(g.dtype)
        objective = g if wd is None else g + wd * theta
        # both products in one pass over V
        coeffs = self.shard.allreduce(torch.stack([objective, v]) @ V.T)
        beta = self.options.momentum
        return coeffs[0], beta * coeffs[1] + (1 - beta) * coeffs[0]

    def _newton_coefficients(self, c_v: torch.Tensor) -> torch.Tensor:
        """The coefficients −α |λ|⁻¹ ⊙ c_v of the Newton step d1 in the rows of V, from the
        velocity's coefficients ``c_v``."""
        lam = self.eigenvalues.abs().to(c_v.dtype)
        return -self.options.alpha * (c_v / lam)

    def _newton_step(self, c_v: torch.Tensor) -> torch.Tensor:
        """d1 = −α Vᵀ(|λ|⁻¹ ⊙ V v) from the velocity's coefficients ``c_v``."""
        assert self.vectors is not None
        return self._newton_coefficients(c_v) @ self.vectors

    def _scale(self) -> float:
        """s = clip(λ_max / λ_k, 1, clip), at most 1 / (η λ_k) (η: the base's steady-state
        step, lr/(1 − momentum)) but at least 1; 1 for adaptive bases, without k or with
        λ_k <= 0."""
        k = self.top
        assert self.sharded_base is not None
        if self.sharded_base.adaptive or k == 0:
            return 1.0
        lam_1, lam_k = self._extremes()
        if lam_k <= 0:
            return 1.0
        ratio = min(max(lam_1 / lam_k, 1.0), self.options.clip)
        step = self.sharded_base.effective_step()  # 0 at a learning rate of 0 (warm-up)
        newton = math.inf if step <= 0 else 1.0 / (step * lam_k)
        return min(ratio, max(newton, 1.0))

    def _extremes(self) -> tuple[float, float]:
        """(λ_1, λ_top) as floats, read from the eigenvalues once per set of them."""
        values, cached = self.eigenvalues, self._extremes_of
        key = (values._version, self.top)
        if cached is None or cached[0] is not values or cached[1] != key:
            cached = (values, key, float(values[0]), float(values[self.top - 1]))
            self._extremes_of = cached
        return cached[2], cached[3]

    def _check_finite(self, g: torch.Tensor) -> None:
        """Raise :class:`NonFiniteCurvature` (on every rank alike) when the gradient of this
        step is NaN or inf on some rank: the loss or the parameters diverged."""
        probe = torch.dot(g, self._zeros).reshape(1).to(torch.float64)  # NaN: some is not finite
        if not math.isfinite(self.shard.allreduce(probe).item()):
            raise NonFiniteCurvature(
                f"FOSI: the gradient is not finite (NaN or inf) at step {self.step_count}: the "
                "loss or the parameters diverged; lower the learning rate, alpha or clip",
                step=self.step_count,
                diverged=True,
                in_gradient=True,
            )

    def _check_subspace(self, closure: Closure, g: torch.Tensor, loss: torch.Tensor | None) -> None:
        """Drop the new eigenpairs (the base update alone until the next ESE; the step is
        recorded in ``rejected_at``) when the subspace step d1 they give now raises the
        closure's loss (summed over ranks). The parameters and the module's buffers are left
        as they were."""
        if self.vectors is None or not self.eigenvalues.numel() or loss is None:
            return
        saved = self.flat.values.clone()
        theta = self.shard.local(saved)
        _, c_v = self._coefficients(theta, g)
        buffers = [] if self.model is None else [b.clone() for b in self.model.buffers()]
        self._write_local(theta + self._newton_step(c_v))
        trial = closure().detach()
        self._write_params(saved)
        if self.model is not None:
            for live, kept in zip(self.model.buffers(), buffers, strict=True):
                live.copy_(kept)
        losses = self.shard.allreduce(torch.stack([loss, trial]).to(torch.float64))
        if not bool(losses[1] <= losses[0]):  # a NaN trial loss is a rise too
            self.eigenvalues = torch.empty(0, dtype=torch.float64)
            self.vectors, self.velocity, self.top = None, None, 0
            self.rejected_at.append(self.step_count)

    # -- ESE --------------------------------------------------------------------------
    def _estimate(self, closure: Closure, seed: int) -> tuple[ExtremeSpectrum, torch.Tensor | None]:
        """Lanczos on the mean Hessian (+ weight decay) of every rank's closure loss, its
        converged pairs only (``residual_tol``); the module's buffers are restored afterwards.
        Raises :class:`NonFiniteCurvature` (on every rank) when a Hessian-vector product is NaN
        or inf, naming the step and the loss."""
        started = time.perf_counter()
        buffers = [] if self.model is None else [b.clone() for b in self.model.buffers()]
        hvp = HessianVectorProduct(self.params, closure, self.model, self.options.hvp)
        shard, dtype, o = self.shard, self.params[0].dtype, self.options
        basis_dtype = lanczos_basis_dtype(o.lanczos_dtype, dtype)
        wd = weight_decay_vector(self.base, self.bounds, shard).to(basis_dtype)
        decays = bool(wd.any())  # no weight decay: no pass over wd and q per product

        def operator(q: torch.Tensor) -> torch.Tensor:
            hv = hvp(shard.gather(q.to(dtype)))  # cast first: half the bytes gathered
            # a new tensor (the product's own, or its cast), so the decay is added in place
            hv = shard.reduce_scatter_mean(hv).to(basis_dtype)
            return hv.addcmul_(wd, q) if decays else hv

        m = min(o.iterations, self.n)
        start = None  # warm: from the last ESE's V, where this rank holds one
        if o.warm_start and self.vectors is not None and self.vectors.shape[0]:
            start = warm_start_vector(shard, self.vectors, seed, basis_dtype)
        if o.keep_basis and self._basis is None:
            self._basis = torch.empty(m, shard.size, dtype=basis_dtype)
        try:
            spectrum = lanczos_extremes(
                operator,
                shard,
                o.k,
                o.l,
                m,
                seed,
                o.lanczos_tol,
                start,
                basis_dtype,
                o.reorthogonalize,
                dtype,
                self._basis,
            )
        except NonFiniteCurvature as exc:
            loss = float("nan") if hvp.loss is None else float(hvp.loss)
            diverged = not (math.isfinite(loss) and bool(torch.isfinite(self.flat.values).all()))
            cause = (
                "the parameters or the loss are not finite: training diverged before this ESE; "
                "lower the learning rate, alpha or clip"
                if diverged
                else "the loss is finite but its curvature overflowed"
            )
            raise NonFiniteCurvature(
                f"FOSI: ESE at step {self.step_count}: {exc}; curvature-batch loss {loss:.6g}: "
                f"{cause}",
                step=self.step_count,
                diverged=diverged,
            ) from None
        if self.model is not None:
            for live, saved in zip(self.model.buffers(), buffers, strict=True):
                live.copy_(saved)
        self.hvp_mode_used = hvp.mode_used
        self.lanczos_basis_bytes = spectrum.basis_bytes
        self.last_ese_s = time.perf_counter() - started
        self.last_lanczos_steps = spectrum.iterations
        self.last_reorthogonalized = spectrum.reorthogonalized
        return converged_pairs(spectrum, self.options.residual_tol), hvp.loss

    def _install(
        self, values: torch.Tensor, vectors: torch.Tensor, snapshot_step: int, top: int
    ) -> None:
        """Swap in eigenpairs (float64 ``(K,)``, ``(K, n_r)``; the first ``top`` of the
        largest) computed at ``snapshot_step``."""
        dtype = self.params[0].dtype
        self.top = top
        self.pairs_kept.append(values.numel())
        self.eigenvalues = values.to(torch.float64).clone()
        self.vectors = vectors.to(dtype).contiguous()
        if self.velocity is None:
            self.velocity = torch.zeros(self.shard.size, dtype=dtype)
        self.staleness.append(self.step_count - snapshot_step)
        self.late_from = None  # a lost ESE's bound no longer matters

    def set_spectrum(self, eigenvalues: torch.Tensor, vectors: torch.Tensor) -> None:
        """Use these eigenpairs from now on: ``eigenvalues`` ``(K,)`` largest first, ``vectors``
        ``(K, n)`` orthonormal rows over all coordinates (this rank keeps its slice)."""
        if vectors.shape != (eigenvalues.numel(), self.n):
            raise ValueError(
                f"FOSI.set_spectrum: vectors must be ({eigenvalues.numel()}, {self.n})"
            )
        top = min(self.options.k, eigenvalues.numel())
        self._install(eigenvalues, self.shard.local(vectors), self.step_count, top)

    # -- parameters -------------------------------------------------------------------
    def _write_params(self, flat: torch.Tensor) -> None:
        """Set the parameters to the flat vector ``flat`` (``(n,)``)."""
        self.flat.values.copy_(flat)

    def _publish(self) -> None:
        """All-gather every rank's coordinates of the buffer into the parameters (nothing to
        do with one rank: the buffer is the parameters)."""
        if self.shard.world > 1:
            self._write_params(self.shard.gather(self.local))

    def _write_local(self, local: torch.Tensor) -> None:
        """Set this rank's coordinates to ``local`` and all-gather every rank's."""
        self.local.copy_(local)
        self._publish()

    # -- state ------------------------------------------------------------------------
    def _counters(self) -> dict[str, Any]:
        return {
            "step_count": self.step_count,
            "ese_count": self.ese_count,
            "staleness": list(self.staleness),
            "hvp_mode_used": self.hvp_mode_used,
            "reestimated_at": list(self.reestimated_at),
            "top": self.top,
            "pairs_kept": list(self.pairs_kept),
            "rejected_at": list(self.rejected_at),
            "next_ese": self.next_ese,
            "ese_interval": self.interval,
            "movements": list(self.movements),
            "intervals": list(self.intervals),
            "late_steps": list(self.late_steps),
            "late_from": self._late_from_saved(),
        }

    def _late_from_saved(self) -> int | None:
        """The step from which a run resumed from this state must not use its eigenpairs: that
        of the bound of the oldest ESE in flight (whose result a checkpoint cannot hold)."""
        pending = [] if self.pipeline is None else self.pipeline.pending
        steps = [p.step + self.options.max_staleness for p in pending[:1]]
        if self.late_from is not None:
            steps.append(self.late_from)
        return min(steps, default=None)

    def _load_counters(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self.ese_count = int(state["ese_count"])
        self.staleness = [int(s) for s in state["staleness"]]
        self.hvp_mode_used = state["hvp_mode_used"]
        self.reestimated_at = [int(s) for s in state.get("reestimated_at", [])]
        self.reestimate_pending = False
        pairs = int(state["eigenvalues"].numel())
        self.top = int(state.get("top", min(self.options.k, pairs)))
        self.pairs_kept = [int(s) for s in state.get("pairs_kept", [])]
        self.rejected_at = [int(s) for s in state.get("rejected_at", [])]
        self.next_ese = int(state.get("next_ese", self.options.warmup))
        self.interval = int(state.get("ese_interval", self.options.ese_every))
        self.movements = [float(s) for s in state.get("movements", [])]
        self.intervals = [int(s) for s in state.get("intervals", [])]
        self.late_steps = [int(s) for s in state.get("late_steps", [])]
        late_from = state.get("late_from")
        self.late_from = None if late_from is None else int(late_from)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (its coordinates of V, the velocity and the base state, plus λ
        and the counters); :meth:`load_state_dict` on the same rank of the same world size is
        its exact inverse. A pipelined ESE still in flight is not part of it: a run loaded from
        it takes the base update alone from that ESE's staleness bound until the next ESE
        arrives (``late_from``)."""

        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return {
            **self._counters(),
            "world_size": self.shard.world,
            "rank": self.shard.rank,
            "n": self.n,
            "eigenvalues": self.eigenvalues.clone(),
            "eigenvectors": copy(self.vectors),
            "velocity": copy(self.velocity),
            **self._movement_basis(copy),
            "base": None
            if self.sharded_base is None
            else _cloned(self.sharded_base.optimizer.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (same world size and rank; for another world size use
        :meth:`load_full_state_dict`)."""
        mine = (self.shard.world, self.shard.rank, self.n)
        saved = (state["world_size"], state["rank"], state["n"])
        if saved != mine:
            raise ValueError(
                f"FOSI state: saved for (world_size, rank, n) = {saved}, this is {mine}; "
                "re-shard with full_state_dict()/load_full_state_dict()"
            )
        self._load_counters(state)
        self.eigenvalues = state["eigenvalues"].clone()
        vectors, velocity = state["eigenvectors"], state["velocity"]
        self.vectors = None if vectors is None else vectors.clone()
        self._load_movement_basis(state, lambda t: t.clone())
        self.velocity = None if velocity is None else velocity.clone()
        if self.sharded_base is not None:
            self.sharded_base.optimizer.load_state_dict(_cloned(state["base"]))

    def _movement_basis(
        self, save: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> dict[str, Any]:
        """The V the next ESE's subspace movement is measured from (ese_interval.py): the
        eigenvectors in use, or (after an ESE the check rejected, or set_spectrum) another."""
        current = self._last_estimate is self.vectors
        basis = None if current or self._last_estimate is None else save(self._last_estimate)
        return {"movement_basis_is_current": current, "movement_basis": basis}

    def _load_movement_basis(
        self, state: dict[str, Any], load: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """Inverse of :meth:`_movement_basis` (older states: the eigenvectors)."""
        basis = state.get("movement_basis")
        if state.get("movement_basis_is_current", True):
            self._last_estimate = self.vectors
        else:
            self._last_estimate = None if basis is None else load(basis)

    def full_state_dict(self) -> dict[str, Any]:
        """The whole state with every vector gathered over all coordinates (collective on
        every rank): plain tensors, numbers and strings, for an HDF5 tree. ``shapes``: the
        parameter shapes it belongs to. Curvature ranks hold no update state (None)."""

        def whole(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else self.shard.gather(t).clone()

        training = self.sharded_base is not None
        return {
            "format": STATE_FORMAT,
            "n": self.n,
            "shapes": [list(p.shape) for p in self.params],
            "base_optimizer": type(self.base).__name__,
            "k": self.options.k,
            "l": self.options.l,
            **self._counters(),
            "eigenvalues": self.eigenvalues.clone(),
            "eigenvectors": whole(self.vectors) if training else None,
            "velocity": whole(self.velocity) if training else None,
            **self._movement_basis(whole if training else lambda t: None),
            "base": self.sharded_base.full_state() if self.sharded_base is not None else None,
        }

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`full_state_dict` saved at any world size: this rank takes its slices.

        ValueError (nothing loaded) when it was saved around another base optimizer class. A
        state saved with another ``k`` or ``l`` loads without its eigenpairs, which the next
        step re-estimates (:meth:`reestimate_spectrum`)."""
        shapes = [list(p.shape) for p in self.params]
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"FOSI state: format {state.get('format')!r}, need {STATE_FORMAT!r}")
        if [list(s) for s in state["shapes"]] != shapes:
            raise ValueError("FOSI state: parameter shapes differ from this model's; load it "
                             "into the model it was saved from")  # fmt: skip
        self._check_base(state)
        self._load_counters(state)
        self.eigenvalues = state["eigenvalues"].to(torch.float64).clone()
        dtype = self.params[0].dtype
        vectors, velocity = state["eigenvectors"], state["velocity"]
        self.vectors = None if vectors is None else self.shard.local(vectors).to(dtype).clone()
        self._load_movement_basis(state, lambda t: self.shard.local(t).to(dtype).clone())
        self.velocity = None if velocity is None else self.shard.local(velocity).to(dtype).clone()
        if self.sharded_base is not None and state["base"] is not None:
            self.sharded_base.load_full_state(state["base"])
        if self._other_pairs(state) and (vectors is not None or self.eigenvalues.numel()):
            self.reestimate_spectrum()

    def _check_base(self, state: dict[str, Any]) -> None:
        """ValueError when ``state`` was saved around another base optimizer class (older
        states, without its name: another kind of parameter-group settings)."""
        mine, saved = type(self.base).__name__, state.get("base_optimizer")
        if saved is not None and saved != mine:
            raise ValueError(
                f"FOSI state: saved around base optimizer {saved}, this FOSI's base is {mine}; "
                f"load it into a FOSI around {saved}"
            )
        groups = (state.get("base") or {}).get("param_groups") if saved is None else None
        if groups and not _same_kind(groups[0], self.base.param_groups[0]):
            raise ValueError(
                f"FOSI state: saved around another base optimizer, this FOSI's base is {mine}; "
                "load it into a FOSI around the base it was saved with"
            )

    def _other_pairs(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was saved with another ``k`` or ``l`` (older states, without
        them: more eigenpairs than k + l)."""
        o = self.options
        if "k" in state and "l" in state:
            return (int(state["k"]), int(state["l"])) != (o.k, o.l)
        return int(state["eigenvalues"].numel()) > o.k + o.l
