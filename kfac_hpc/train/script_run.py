"""``kfac_hpc.Run``: a user's own training loop writing the run directory of ``kfac-hpc train``.

::

    with kfac_hpc.Run(run_dir, model="mycnn", dataset="digits") as run:
        model, opt, pre = ...                              # the user's own objects
        run.track(model=model, optimizer=opt, preconditioner=pre, sampler=sampler)
        for step, batch in run.steps(loader, epochs=3):   # resumes where the last attempt stopped
            with run.phase("forward"):
                loss = loss_fn(model(batch[0]), batch[1])
            ...
            run.log(loss=loss)                             # the step's training loss: windows
        run.log(eval_loss=..., accuracy=...)               # an evaluation record

The same contract as the job (docs/contracts.md): config.json, metrics.jsonl windows and
evaluations, run.json at the end of every attempt, HDF5 checkpoints through the checkpoint
manager (the model, the optimizer, the K-FAC preconditioner's or FOSI's state, the RNG streams
and the data position), exactly one of ``done``/``error``/``preempted``. USR2 or TERM on any
rank: every rank stops at the same step, checkpoints and exits 75; the next attempt resumes
there. Ranks and world come from the launch's environment (:mod:`kfac_hpc.runtime`). Under
``kfac-hpc sweep --script``, ``KFAC_HPC_RUN_DIR`` names the point's run directory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    DataPosition,
    LoadedCheckpoint,
    capture_training_state,
    check_restorable,
    restore_training_state,
)
from kfac_hpc.cli_errors import bad_input
from kfac_hpc.contracts import PHASES, SCHEMA_VERSION, HostMemory, RunDir, write_json_atomic
from kfac_hpc.contracts.environment import RUN_DIR_ENV
from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.grad_workers import parse_grad_worker_fraction
from kfac_hpc.contracts.method_state import Checkpointable
from kfac_hpc.contracts.options import FIRST_ORDER, SCALINGS
from kfac_hpc.contracts.phases import FOSI_PHASES
from kfac_hpc.contracts.targets import HIGHER_IS_BETTER
from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.runtime import DistributedContext, init_distributed, shutdown
from kfac_hpc.runtime.host_memory import huge_pages_enabled
from kfac_hpc.train.attempt import (
    average_buffers,
    begin_attempt,
    broadcast_parameters,
    end_attempt,
    parameters_finite,
    record_failure,
)
from kfac_hpc.train.faults import fault_plan
from kfac_hpc.train.grad_sync import GradientAllreduce
from kfac_hpc.train.methods.base import TrainingDiverged
from kfac_hpc.train.methods.fosi import FOSIState
from kfac_hpc.train.preemption import PreemptionHandler
from kfac_hpc.train.records import WindowRecorder, eval_record, launch_facts
from kfac_hpc.train.summary import AttemptLog
from kfac_hpc.train.threads import set_rank_threads
from kfac_hpc.train.timing import PhaseTimer, phase_timer

__all__ = ["Run"]

_WHO = "Run"  # bad input: "kfac-hpc Run: error: FIELD: reason", exit 2


class _Tracked:
    """What :meth:`Run.track` was given, and the training method it makes."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        preconditioner: Any,
        sampler: Any,
    ) -> None:
        self.model, self.sampler = model, sampler
        fosi = next((o for o in (optimizer, preconditioner) if isinstance(o, FOSI)), None)
        self.state: Checkpointable | None
        if fosi is not None:  # FOSI holds its base optimizer's state (re-shardable)
            self.method, self.state, self.optimizer = "fosi", FOSIState(fosi), None
            base = fosi.base
        else:
            self.method = "kfac" if isinstance(preconditioner, KFACPreconditioner) else FIRST_ORDER
            self.state, self.optimizer, base = preconditioner, optimizer, optimizer
        self.optimizer_name = type(base).__name__.lower()
        self.preconditioner = (
            preconditioner if isinstance(preconditioner, KFACPreconditioner) else None
        )
        self.phases = PHASES + (FOSI_PHASES if self.method == "fosi" else ())
        self.grad_worker_fraction = 1.0  # the share of ranks preconditioning each layer
        if self.preconditioner is not None:
            fraction = self.preconditioner.options.grad_worker_fraction
            world = self.preconditioner.world_size
            self.grad_worker_fraction = parse_grad_worker_fraction(fraction, world)


class Run:
    """One attempt of one training run driven by the user's loop; a context manager.

    ``run_dir``: the run directory (``KFAC_HPC_RUN_DIR``, set by ``kfac-hpc sweep --script``,
    takes precedence). ``model``, ``dataset``, ``scaling`` label the run for the collector and
    the report; ``metric`` is what judges it, "accuracy" (higher is better) or "loss" (the
    evaluation loss, lower is better); ``config`` holds the user's settings (JSON values),
    written to config.json and hashed: a run directory of another config is refused.
    ``seed`` is recorded with the data position. A window record closes every ``log_every``
    steps; a checkpoint every ``checkpoint_every`` steps (None: on preemption only),
    ``keep_checkpoints`` kept.
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        model: str = "custom",
        dataset: str = "custom",
        scaling: str = "strong",
        metric: str = "accuracy",
        config: Mapping[str, Any] | None = None,
        seed: int = 0,
        log_every: int = 10,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 2,
        backend: str | None = None,
    ) -> None:
        chosen = os.environ.get(RUN_DIR_ENV) or run_dir
        if not chosen:
            bad_input(_WHO, "run_dir", f"give Run(run_dir) or set {RUN_DIR_ENV}")
        if scaling not in SCALINGS:
            bad_input(_WHO, "scaling", f"{scaling!r} is not one of {', '.join(SCALINGS)}")
        if metric not in HIGHER_IS_BETTER:
            bad_input(_WHO, "metric", f"{metric!r} is not one of {', '.join(HIGHER_IS_BETTER)}")
        for name, value in (("log_every", log_every), ("keep_checkpoints", keep_checkpoints)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad_input(_WHO, name, f"{value!r} must be an integer >= 1")
        if checkpoint_every is not None and (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            bad_input(_WHO, "checkpoint_every", f"{checkpoint_every!r} must be None or >= 1")
        try:
            user_config = json.loads(json.dumps(dict(config or {})))
        except (TypeError, ValueError) as exc:
            bad_input(_WHO, "config", f"must hold JSON values only ({exc})")
        self.run_dir = RunDir(chosen)
        self.labels = {"model": str(model), "dataset": str(dataset), "scaling": scaling}
        self.metric = metric
        self.user_config = user_config
        self.seed, self.log_every = seed, log_every
        self.checkpoint_every, self.keep_checkpoints = checkpoint_every, keep_checkpoints
        self._backend = backend
        self._tracked: _Tracked | None = None
        self._timer: PhaseTimer | None = None
        self._recorder: WindowRecorder | None = None
        self._pending_pre: dict[str, float] | None = None
        self.step = 0  # optimizer steps done (the whole run's)
        self.start_step = 0
        self.steps_per_epoch = 1
        self.global_batch_size: int | None = None
        self.attempt, self.wall_base_s = 0, 0.0
        self.end = "done"
        self._started_loop = False
        self._saved_step = 0
        self._in_step = False  # inside the loop's body (the step not yet counted)
        self._grad_sync: GradientAllreduce | None = None
        self._step_flag: float | None = None  # the preemption flag summed with the gradients

    # ------------------------------------------------------------------ the context
    def __enter__(self) -> Run:
        try:
            self.run_dir.check_usable()
        except InputError as exc:
            bad_input(_WHO, exc.field, exc.reason)
        self.ctx: DistributedContext = init_distributed(self._backend)
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.device
        self.threads = set_rank_threads(None, self.ctx.launch.local_world_size)
        self._comm = torch.device("cpu") if self.ctx.backend == "gloo" else self.ctx.device
        if self.run_dir.marker("done").exists():
            if self.rank == 0:
                print(f"{self.run_dir.root}: already done", flush=True)
            shutdown()
            raise SystemExit(int(ExitCode.DONE))
        self.attempts = AttemptLog(self.run_dir)
        self.started = time.perf_counter()
        self.fault = fault_plan()
        self.preemption = PreemptionHandler().install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.preemption.uninstall()
        if isinstance(exc, SystemExit) and exc.code == ExitCode.BAD_INPUT:
            shutdown()  # refused input: one line said why, nothing was written
            return
        if exc is None:
            try:
                self._finish()
            except BaseException as error:  # every failure leaves the marker
                exc = error
        if exc is not None:
            self._fail(exc)
            return
        shutdown()
        if self.end == "preempted":
            raise SystemExit(int(ExitCode.PREEMPTED))

    # ------------------------------------------------------------------ the user's calls
    def track(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        preconditioner: Any = None,
        sampler: Any = None,
    ) -> None:
        """The objects a checkpoint saves and restores: the model, the optimizer (a FOSI, or
        the base of a K-FAC preconditioner), the preconditioner (K-FAC, or FOSI) and the
        sampler (its ``set_epoch(epoch)`` is called at every epoch, as the job's data is)."""
        self._tracked = _Tracked(model, optimizer, preconditioner, sampler)

    def steps(
        self, loader: Iterable[Any], *, epochs: int | None = None, steps: int | None = None
    ) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` for every optimizer step of the run from where the last attempt
        stopped: ``epochs`` passes over ``loader`` (it must have a length) or ``steps`` steps.
        Restores the latest checkpoint first. Stops early (the loop ends) when a preemption
        signal reached any rank; the run then checkpoints and exits 75 at the ``with``'s end."""
        tracked = self._require_tracked()
        total = self._total_steps(loader, epochs, steps)
        self._start(loader, tracked)
        assert self._timer is not None and self._recorder is not None
        timer, every = self._timer, self.checkpoint_every
        try:
            for epoch in itertools.count(self.step // self.steps_per_epoch):
                if self.step >= total:
                    break
                batches = self._epoch(loader, epoch, tracked)
                while self.step < total:
                    if self.fault is not None:
                        self.fault.check(
                            self.rank, self.world_size, self.step, self.start_step, self.preemption
                        )
                    timer.begin_step()
                    batch = next(batches, None)
                    if batch is None:
                        break  # the epoch ended (a loader shorter than its length said)
                    timer.lap("data")
                    self._in_step = True
                    yield self.step, batch
                    self._after_step(timer)
                    flag, self._step_flag = self._step_flag, None
                    preempted = (
                        self.preemption.should_stop()
                        if flag is None
                        else self.preemption.agreed(flag)
                    )
                    if preempted or (every and self.step % every == 0):
                        self._save()
                        timer.lap("checkpoint")
                    timer.end_step()
                    if self.step % self.log_every == 0:
                        self._close_window()
                    if preempted:
                        self.end = "preempted"
                        return
                    if self.step % self.steps_per_epoch == 0:
                        break
        except GeneratorExit:  # the user left the loop after a step: it counts
            self._after_step(timer)
            timer.end_step()
            raise

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time of the block to phase ``name`` (docs/contracts.md's names). A block
        around a K-FAC preconditioner's ``step()`` is charged by the preconditioner's own
        phase times (factor and inverse compute and communication, precondition, broadcast)."""
        if self._timer is None or name not in self._timer.phases:
            known = ", ".join(self._timer.phases if self._timer else PHASES)
            raise ValueError(f"Run.phase: {name!r} is not a phase here; use one of {known}")
        timer, pre = self._timer, self._tracked.preconditioner if self._tracked else None
        before = pre.last_timings if pre is not None else None
        timer.skip()  # the time before the block is no phase's
        yield
        if pre is not None and pre.last_timings is not before:
            timer.add(pre.last_timings)
            timer.skip()
        else:
            timer.lap(name)

    def average_gradients(self) -> None:
        """Average every tracked parameter's ``.grad`` over the ranks in one allreduce (timed
        as ``grad_allreduce``); the preemption flag rides in it, so the step needs no
        collective of its own. Not with FOSI, which reduces the gradients itself."""
        tracked = self._require_loop()
        if self._grad_sync is None:
            self._grad_sync = GradientAllreduce(tracked.model, self.world_size)
        assert self._timer is not None
        self._timer.skip()
        (self._step_flag,) = self._grad_sync([self.preemption.local_flag()])
        self._timer.lap("grad_allreduce")

    def log(
        self,
        *,
        loss: torch.Tensor | float | None = None,
        eval_loss: float | None = None,
        accuracy: float | None = None,
    ) -> None:
        """``loss``: this step's training loss (the windows average it over steps and ranks).
        ``eval_loss`` with ``accuracy``: an evaluation at the current step (rank 0 records
        its values: give the same on every rank, e.g. reduced over ranks)."""
        if loss is not None:
            if self._recorder is None:
                raise RuntimeError("Run.log(loss=...) belongs inside the run.steps() loop")
            value = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(loss)
            self._recorder.add_loss(value.to(self._comm, torch.float64))
        if (eval_loss is None) != (accuracy is None):
            raise ValueError("Run.log: an evaluation gives both eval_loss and accuracy")
        if eval_loss is not None and accuracy is not None and self.rank == 0:
            step = self.step + 1 if self._in_step else self.step  # the step in flight counts
            epoch = step // self.steps_per_epoch
            record = eval_record(
                self.attempt, step, epoch, self.wall_s(), float(eval_loss), float(accuracy)
            )
            self.run_dir.append_metrics(record)

    def wall_s(self) -> float:
        """Seconds of running time of the whole run (earlier attempts included)."""
        return self.wall_base_s + time.perf_counter() - self.started

    # ------------------------------------------------------------------ set-up
    def _require_tracked(self) -> _Tracked:
        if self._tracked is None:
            raise RuntimeError("Run.steps: call run.track(model=..., optimizer=...) first")
        if self._started_loop:
            raise RuntimeError("Run.steps: one loop per Run (give epochs or steps for all)")
        return self._tracked

    def _require_loop(self) -> _Tracked:
        if self._tracked is None or self._timer is None:
            raise RuntimeError("Run: this call belongs inside the run.steps() loop")
        return self._tracked

    def _total_steps(self, loader: Iterable[Any], epochs: int | None, steps: int | None) -> int:
        if (epochs is None) == (steps is None):
            bad_input(_WHO, "steps", "give Run.steps() either epochs or steps")
        try:
            self.steps_per_epoch = len(loader)  # type: ignore[arg-type]
        except TypeError:
            if epochs is not None:
                bad_input(_WHO, "epochs", "the loader has no length; give steps")
            self.steps_per_epoch = steps or 1
        if self.steps_per_epoch < 1:
            bad_input(_WHO, "loader", "yields no batch; give it at least one")
        total = steps if steps is not None else (epochs or 0) * self.steps_per_epoch
        if total < 1:
            bad_input(_WHO, "steps", f"{total} steps: give at least one")
        per_rank = getattr(loader, "batch_size", None)
        self.global_batch_size = per_rank * self.world_size if isinstance(per_rank, int) else None
        return total

    def _config(self, tracked: _Tracked) -> dict[str, Any]:
        """The run's config: its labels, the training method and the user's settings."""
        return {
            **self.labels,
            "optimizer": tracked.optimizer_name,
            "method": tracked.method,
            "seed": self.seed,
            "script_config": self.user_config,
        }

    def _config_hash(self, config: Mapping[str, Any]) -> str:
        return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]

    def _start(self, loader: Iterable[Any], tracked: _Tracked) -> None:
        """Refuse another experiment's run directory, resume, write config.json, start the
        attempt's records. Collective."""
        self._started_loop = True
        config = self._config(tracked)
        self.config_hash = self._config_hash(config)
        try:
            saved = self.run_dir.saved_config_hash()
        except InputError as exc:
            bad_input(_WHO, exc.field, exc.reason)
        if saved is not None and saved != self.config_hash:
            bad_input(
                _WHO,
                "run_dir",
                f"{str(self.run_dir.root)!r} holds another experiment (config hash {saved}, "
                f"this one {self.config_hash}); use a new run directory",
            )
        self.manager = CheckpointManager(
            self.run_dir.checkpoints,
            keep=self.keep_checkpoints,
            rank=self.rank,
            world_size=self.world_size,
        )
        self._resume(tracked)
        if self.rank == 0:
            self.run_dir.create()
            self.run_dir.clear_markers()
            resolved = {"schema": SCHEMA_VERSION, **config, "config_hash": self.config_hash}
            resolved.update(world_size=self.world_size, **self._batch_sizes())
            write_json_atomic(self.run_dir.config, resolved)
        if self.world_size > 1:
            dist.barrier()
        self.attempt, self.wall_base_s = begin_attempt(
            self.attempts, self.rank, self.world_size, self._comm, self.start_step
        )
        self._timer = phase_timer(False, self.device, tracked.phases)
        self._recorder = WindowRecorder(
            self.run_dir,
            self.rank,
            self.world_size,
            self._comm,
            self.global_batch_size or 0,
            self.attempt,
        )

    def _resume(self, tracked: _Tracked) -> None:
        """The newest checkpoint of the run directory that fits the tracked objects (others are
        skipped, each named on stderr by rank 0), or rank 0's weights on every rank."""

        def fits(checkpoint: LoadedCheckpoint) -> None:
            saved = checkpoint.tree.get("extra", {}).get("method")
            if saved is not None and saved != tracked.method:
                raise CheckpointMismatchError(f"saved by method {saved}, this run {tracked.method}")
            check_restorable(
                checkpoint,
                model=tracked.model,
                optimizer=tracked.optimizer,
                preconditioner=tracked.state,
            )

        checkpoint = self.manager.load_latest(fits)
        if checkpoint is None:
            broadcast_parameters(tracked.model, self.world_size)
            return
        restored = restore_training_state(
            checkpoint,
            model=tracked.model,
            optimizer=tracked.optimizer,
            preconditioner=tracked.state,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.step = self.start_step = self._saved_step = restored.step

    def _batch_sizes(self) -> dict[str, int | None]:
        per_rank = None
        if self.global_batch_size is not None:
            per_rank = self.global_batch_size // self.world_size
        return {"global_batch_size": self.global_batch_size, "per_rank_batch_size": per_rank}

    def _epoch(self, loader: Iterable[Any], epoch: int, tracked: _Tracked) -> Iterator[Any]:
        """The batches of ``epoch`` from the step the run is at (a resume skips those done)."""
        for source in (tracked.sampler, getattr(loader, "sampler", None)):
            if source is not None and hasattr(source, "set_epoch"):
                source.set_epoch(epoch)
                break
        done_in_epoch = self.step - epoch * self.steps_per_epoch
        return itertools.islice(iter(loader), done_in_epoch, None)

    # ------------------------------------------------------------------ each step
    def _after_step(self, timer: PhaseTimer) -> None:
        timer.skip()  # the user's code between phases is no phase's
        self.step += 1
        self._in_step = False

    def _save(self) -> None:
        """A checkpoint of everything tracked at this step. Collective."""
        tracked = self._tracked
        assert tracked is not None
        if not parameters_finite(tracked.model, self.world_size, self._comm):
            raise TrainingDiverged(
                f"the model's parameters are non-finite at step {self.step}; no checkpoint of "
                "them was written"
            )
        average_buffers(tracked.model, self.world_size)
        epoch, index = divmod(self.step, self.steps_per_epoch)
        state = capture_training_state(
            step=self.step,
            model=tracked.model,
            optimizer=tracked.optimizer,
            preconditioner=tracked.state,
            data_position=DataPosition(epoch, index, self.seed),
            config=self._config(tracked),
            config_hash=self.config_hash,
            rank=self.rank,
            world_size=self.world_size,
            extra={
                "attempt": self.attempt,
                "wall_s": self.wall_s(),
                "method": tracked.method,
                "optimizer": tracked.optimizer_name,
            },
        )
        self.manager.save(state)
        self._saved_step = self.step

    def _close_window(self) -> None:
        assert self._recorder is not None and self._timer is not None
        epoch = self.step // self.steps_per_epoch
        self._recorder.close(self._timer, self.step, epoch, self.wall_s())

    # ------------------------------------------------------------------ the end
    def _facts(self) -> dict[str, Any]:
        tracked = self._tracked
        step_times = self._recorder.rank0_step_s if self._recorder is not None else []
        facts: dict[str, Any] = {
            "config_hash": getattr(self, "config_hash", None),
            **self.labels,
            "optimizer": tracked.optimizer_name if tracked else None,
            "method": tracked.method if tracked else FIRST_ORDER,
            "kfac": tracked is not None and tracked.method == "kfac",
            "grad_worker_fraction": tracked.grad_worker_fraction if tracked else 1.0,
            "host_memory": str(HostMemory.DEFAULT),
            **self.threads,
            "huge_pages": huge_pages_enabled(),
            "model_args": {},
            "dataset_args": {},
            "metric": self.metric,
            "higher_is_better": HIGHER_IS_BETTER[self.metric],
            **self._batch_sizes(),
            "steps": self.step,
            "epochs": self.step // self.steps_per_epoch,
            "target_accuracy": None,
            "target_loss": None,
            **launch_facts(self.ctx, self.run_dir, step_times),
        }
        return facts

    def _finish(self) -> None:
        """Close the last window, checkpoint a run that checkpoints, write run.json and the
        marker. Collective."""
        if not self._started_loop:
            raise RuntimeError("Run: the with block ended without a run.steps() loop")
        self._close_window()
        if self.end != "preempted" and self.checkpoint_every and self._saved_step != self.step:
            self._save()
        if self.rank == 0:
            attempt_s = time.perf_counter() - self.started
            end_attempt(self.attempts, self.attempt, self.step, attempt_s, self.end, self._facts())
        if self.world_size > 1:
            dist.barrier()

    def _fail(self, exc: BaseException) -> None:
        def ended() -> tuple[AttemptLog, int, float, dict[str, Any]]:
            return self.attempts, self.attempt, time.perf_counter() - self.started, self._facts()

        record_failure(
            self.run_dir,
            self.rank,
            self.world_size,
            exc,
            ended if self._started_loop else None,
            prefix=_WHO,
            quiet=(TrainingDiverged,),
            report=self.world_size > 1,  # one rank: the exception goes on to the script
        )
