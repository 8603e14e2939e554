"""FOSI / DHO2 around the job's first-order optimizer (docs/fosi.md).

FOSI reduces the gradients itself (``reduces_gradients``): the job skips its allreduce, each
rank's local gradient is reduce-scattered so that every rank gets the mean over its own
coordinates, updates only those (V, velocity and base state live for the slice, ZeRO-1) and
all-gathers the new parameters. The step's timing phases: ``grad_allreduce`` (the
reduce-scatter), ``ese``, ``optimizer`` and ``param_allgather``. Its checkpoint state is the
whole state gathered over coordinates (``full_state_dict``), so a run saved at P ranks resumes
at any P'. With ``curvature_ranks`` the last ranks compute ESEs only (the gradients are
reduce-scattered over the training ranks): they take no step but serve each ESE the training
ranks request (the job's curvature loop, kfac_hpc/train/curvature_ranks.py), and before a
checkpoint every rank takes training rank 0's model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from kfac_hpc.contracts.method_state import MethodState, SavedState, UnitShapes
from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.contracts.phases import FOSI_PHASES
from kfac_hpc.optim.fosi import FOSI, NonFiniteCurvature
from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.methods.base import CurvatureLoss, Method, MethodSetup, TrainingDiverged
from kfac_hpc.train.methods.registry import register
from kfac_hpc.train.optimizers import make_optimizer
from kfac_hpc.train.timing import PhaseTimer

__all__ = ["FOSIMethod", "FOSIState"]


class FOSIState:
    """FOSI's checkpoint state: the whole state (every vector over all coordinates), shared."""

    label = "FOSI"
    state_group = "fosi_state"
    shard_group = "fosi_shard"

    def __init__(self, optimizer: FOSI) -> None:
        self.optimizer = optimizer

    def checkpoint_state(self, include_shard: bool = True) -> MethodState:
        """Collective: gathers V, the velocity and the base state over coordinates."""
        return MethodState(self.optimizer.full_state_dict(), strategy=self.strategy)

    @property
    def strategy(self) -> str:
        return f"coordinates/{self.optimizer.shard.world}"

    def expected_shapes(self) -> UnitShapes:
        # load_full_state_dict checks the parameter shapes itself (the state is not per layer)
        return UnitShapes(path=("by_layer",), shapes={})

    def load_checkpoint_state(self, saved: SavedState) -> None:
        try:
            self.optimizer.load_full_state_dict(saved.shared)
        except (KeyError, TypeError, ValueError) as exc:
            message = f"the checkpoint's FOSI state does not fit: {exc}"
            raise ConfigError("resume_from", message) from None

    def warm_start(self, saved: SavedState) -> int:
        raise ConfigError("init_factors", "FOSI has no K-FAC factors to start from; leave it out")


class FOSIMethod(Method):
    """``kfac_hpc.FOSI`` with the job's optimizer as its base; it reduce-scatters the
    gradients and all-gathers the parameters itself."""

    name = "fosi"
    phases = (*FOSI_PHASES, "optimizer")

    def __init__(self, setup: MethodSetup) -> None:
        _check_sizes(setup.config, sum(p.numel() for p in setup.model.parameters()))
        base = make_optimizer(setup.config, setup.model)
        try:
            fosi = FOSI(
                setup.model.parameters(),
                base,
                model=setup.model,
                average_gradients=True,  # its reduce-scatter: the job does not allreduce
                **setup.config.fosi_options(),
            )
        except ValueError as exc:
            raise ConfigError("fosi", str(exc)) from None
        super().__init__(fosi)
        self.fosi = fosi
        self.config = setup.config
        self.resume_note: str | None = None  # what a resume re-estimated, said in the log
        self._state = FOSIState(fosi)
        self.ese_s: list[float] = []  # seconds of every ESE this rank ran (this attempt)
        self._drained = 0  # of fosi.curvature_ese_s, those already in a timing window

    def step(self, timer: PhaseTimer, curvature_loss: CurvatureLoss) -> None:
        self.fosi.last_ese_s = 0.0
        try:
            self.fosi.step(curvature_loss, lap=timer.lap)  # charges each part of the step
        except NonFiniteCurvature as exc:  # on every rank alike (allreduced numbers)
            raise _diverged(exc) from None
        if self.fosi.last_ese_s:
            self.ese_s.append(self.fosi.last_ese_s)
        timer.lap("optimizer")

    @property
    def curvature_ranks(self) -> int:
        return 0 if self.fosi.pipeline is None else self.fosi.pipeline.curvers

    @property
    def is_curvature_rank(self) -> bool:
        return self.fosi.is_curvature_rank

    @property
    def training_group(self) -> Any:
        return None if self.fosi.pipeline is None else self.fosi.pipeline.shard.group

    def curvature_request(self) -> int | None:
        """The ESE's number when the next step requests one of the curvature ranks."""
        fosi = self.fosi
        return fosi.ese_count if fosi.pipeline is not None and fosi.ese_due() else None

    def serve(self, step: int, number: int, curvature_loss: CurvatureLoss) -> None:
        """The ESE requested at ``step`` (the ``number``-th of the run)."""
        try:
            self.fosi.serve_ese(step, number, curvature_loss)
        except NonFiniteCurvature as exc:  # on every curvature rank alike
            raise _diverged(exc) from None
        self.ese_s.append(self.fosi.last_ese_s)

    def drain_curvature_phases(self) -> dict[str, float]:
        """The seconds of the ESEs swapped in since the last call, as the curvature ranks
        reported them."""
        reported = self.fosi.curvature_ese_s
        seconds = sum(reported[self._drained :])
        self._drained = len(reported)
        return {"ese": seconds}

    @property
    def checkpointed_optimizer(self) -> None:
        return None  # FOSIState holds the base state, re-shardable

    @property
    def state(self) -> FOSIState:
        return self._state

    @property
    def strategy(self) -> str:
        return self._state.strategy

    @property
    def reduces_gradients(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.fosi.pipeline is None:
            return
        model = self.fosi.model
        assert model is not None
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)

    def run_facts(self) -> dict[str, Any]:
        fosi = self.fosi
        memory = fosi.memory_usage()
        return {
            "kfac": False,
            "grad_worker_fraction": 1.0,  # no K-FAC work to divide
            "fosi": True,
            "fosi_eigenvalues": [float(x) for x in fosi.eigenvalues],
            "ese_count": fosi.ese_count,
            # with curvature ranks: every ESE swapped in, as the curvature ranks reported it
            "ese_s": list(self.ese_s if fosi.pipeline is None else fosi.curvature_ese_s),
            "ese_staleness_steps": list(fosi.staleness),
            "ese_staleness_max": max(fosi.staleness, default=0),
            "fosi_late_steps": len(fosi.late_steps),
            "hvp_mode_used": fosi.hvp_mode_used,
            "curvature_ranks": 0 if fosi.pipeline is None else fosi.pipeline.curvers,
            "fosi_memory_bytes": memory,
            "fosi_reestimated_at_steps": list(fosi.reestimated_at),
            "fosi_pairs_kept": list(fosi.pairs_kept),
            "fosi_subspace_rejected_at_steps": list(fosi.rejected_at),
            "fosi_adaptive_ese": fosi.options.adaptive_ese,
            "fosi_lanczos_dtype": fosi.options.lanczos_dtype,
            "fosi_reorthogonalize": fosi.options.reorthogonalize,
            "fosi_reorthogonalized_steps": fosi.last_reorthogonalized,
            "fosi_subspace_movement": list(fosi.movements),
            "fosi_ese_intervals": list(fosi.intervals),
            "fosi_lanczos_steps": fosi.last_lanczos_steps,
            "fosi_resume_note": self.resume_note,
        }

    # A checkpoint of another base optimizer (or method) is refused by name by the job
    # (methods/resume.py) before this is reached; another k or l is taken and re-estimated.
    def resumed(self, saved_config: Mapping[str, Any]) -> None:
        """A checkpoint saved with another --fosi-k or --fosi-l: its eigenpairs are dropped and
        the next step runs an ESE; said on rank 0's log and in run.json."""
        fosi, config = self.fosi, self.config
        saved = (saved_config.get("fosi_k"), saved_config.get("fosi_l"))
        mine = (config.fosi_k, config.fosi_l)
        has_spectrum = fosi.eigenvalues.numel() > 0 or fosi.vectors is not None
        if None not in saved and saved != mine and has_spectrum:
            fosi.reestimate_spectrum()  # the FOSI state did not say its k and l (older files)
        if not fosi.reestimate_pending:
            return
        k_flag, l_flag = OPTIONS["fosi_k"].flag, OPTIONS["fosi_l"].flag
        was = f"{k_flag} {saved[0]} {l_flag} {saved[1]}" if None not in saved else "another k, l"
        self.resume_note = (
            f"the checkpoint was saved with {was}, this run has {k_flag} {mine[0]} {l_flag} "
            f"{mine[1]}: its eigenpairs are dropped and re-estimated by an ESE at step "
            f"{fosi.step_count}"
        )
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(f"kfac-hpc train: resume: {self.resume_note}", flush=True)


def _diverged(exc: NonFiniteCurvature) -> TrainingDiverged:
    """The job's error for a non-finite gradient or curvature that FOSI found."""
    what, found = (
        ("loss", "FOSI's check of every step: the gradient is")
        if exc.in_gradient
        else ("loss", "FOSI's ESE: the parameters or the curvature-batch loss are")
        if exc.diverged
        else ("curvature", "FOSI's ESE: the loss is finite, its Hessian-vector products are")
    )
    lr, alpha, clip = (OPTIONS[n].flag for n in ("lr", "fosi_alpha", "fosi_clip"))
    return TrainingDiverged(
        f"the {what} became non-finite at step {exc.step} ({found} not finite); the run "
        f"stopped at that step without checkpointing that state: lower {lr}, {alpha} or "
        f"{clip} and start a new run"
    )


def _check_sizes(config: TrainConfig, parameters: int) -> None:
    """ConfigError unless k + l and the Lanczos steps are below the model's parameter count
    (before anything is written: more would allocate bases of n x n or beyond)."""
    pairs = config.fosi_k + config.fosi_l
    where = f"the {parameters} parameters of {OPTIONS['model'].flag} {config.model}"
    if pairs >= parameters:
        name = "fosi_k" if config.fosi_k >= config.fosi_l else "fosi_l"
        raise ConfigError(name, f"k + l = {pairs} must be below {where}; use fewer eigenpairs")
    iters = config.lanczos_iters
    if iters is not None and iters >= parameters:
        raise ConfigError(
            "lanczos_iters", f"{iters} must be below {where}; use fewer or leave it out"
        )


register(FOSIMethod.name, FOSIMethod)
