"""One attempt of one training run on this rank: set-up, resume, the step loop, evaluation,
checkpoints, and the facts of ``run.json`` that only the live job knows.

The training method is built from the registry (:mod:`kfac_hpc.train.methods`); the job never
asks which method it runs. Preemption is agreed once per step: each rank's flag
(:meth:`~kfac_hpc.train.preemption.PreemptionHandler.local_flag`) rides in the step's gradient
allreduce with the time-limit and checkpoint flags, so it costs no collective of its own.

A method's curvature ranks (FOSI's ``curvature_ranks``) take no step: they run
:meth:`Job.serve` instead of the loop, on orders from training rank 0
(:mod:`kfac_hpc.train.curvature_ranks`), and the step's flags are summed over the training
ranks only, and so is an evaluation; the whole world meets at checkpoints and the attempt's
end.

A run whose training loss or parameters become non-finite stops with
:class:`TrainingDiverged` on every rank alike, and never checkpoints that state: rank 0 sees a
non-finite window loss and says so in the next step's flags; a checkpoint first checks that the
parameters are finite on every rank.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.checkpoint import (
    AsyncCheckpointWriter,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    DataPosition,
    LoadedCheckpoint,
    SkippedCheckpoint,
    capture_training_state,
    check_restorable,
    init_factors_from,
    load_checkpoint,
    restore_training_state,
)
from kfac_hpc.contracts import OPTIONS, PHASES, HostMemory, RunDir
from kfac_hpc.contracts.targets import HIGHER_IS_BETTER
from kfac_hpc.runtime import DistributedContext
from kfac_hpc.runtime.host_memory import huge_pages_enabled
from kfac_hpc.train.attempt import average_buffers, broadcast_parameters, parameters_finite
from kfac_hpc.train.batchnorm import recomputed_batchnorm
from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.curvature_ranks import (
    ENDS,
    Order,
    OrderSender,
    PeerAborted,
    receive_order,
)
from kfac_hpc.train.data import DataSource, ShardedBatches
from kfac_hpc.train.faults import fault_plan
from kfac_hpc.train.methods import MethodSetup, build_method, method_name
from kfac_hpc.train.methods.base import TrainingDiverged
from kfac_hpc.train.methods.resume import recorded, training_mismatch
from kfac_hpc.train.optimizers import learning_rate
from kfac_hpc.train.precision import Precision
from kfac_hpc.train.preemption import PreemptionHandler
from kfac_hpc.train.progress import Progress
from kfac_hpc.train.records import WindowRecorder, eval_record, run_facts
from kfac_hpc.train.step import TrainStep, evaluate
from kfac_hpc.train.summary import AttemptLog
from kfac_hpc.train.threads import set_rank_threads
from kfac_hpc.train.timing import PhaseTimer, phase_timer
from kfac_hpc.train.workloads import build_model

__all__ = ["Job", "PeerInputError", "Position", "TrainingDiverged", "agree_on_input"]

_RETRY = (
    f"lower {OPTIONS['lr'].flag} (or, with K-FAC, raise {OPTIONS['damping'].flag}) "
    "and start a new run"
)


class StepFlags(NamedTuple):
    """The decisions every rank must share, as the floats that ride in the step's gradient
    allreduce (summed over ranks): this order is the one definition of their slots."""

    time_up: float  # the time limit is reached (on any rank)
    checkpoint_due: float  # a checkpoint is due by rank 0's clock
    diverged_at: float  # the step at which rank 0 saw the loss diverge (0: it did not)
    preempted: float  # a preemption signal reached a rank


def _stop_if_diverged(step: float) -> None:
    """Raise TrainingDiverged when ``step`` (agreed by every rank) names a diverged window."""
    if step > 0:
        raise TrainingDiverged(
            f"the training loss became non-finite in the window ending at step {int(step)}; "
            f"the run stopped without checkpointing that state: {_RETRY}"
        )


class PeerInputError(ConfigError):
    """Bad input that another rank reports: this rank exits 2 without a line of its own."""

    quiet = True


def agree_on_input(
    error: ConfigError | None, rank: int, world_size: int, device: torch.device
) -> None:
    """Collective (when the process group is up): every rank learns whether any rank found bad
    input. The lowest such rank raises its own ``error``, marked ``quiet = False`` (the one
    line the CLI prints); every other rank raises :class:`PeerInputError` (exit 2, no line)."""
    lowest = rank if error is not None else world_size
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        agreed = torch.tensor([lowest], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        lowest = int(agreed.item())
    if lowest >= world_size:
        return
    if error is not None and lowest == rank:
        error.quiet = False  # type: ignore[attr-defined]
        raise error
    raise PeerInputError(
        error.field if error is not None else "input", f"bad input reported by rank {lowest}"
    )


@contextmanager
def _user_file(option: str, path: str) -> Iterator[None]:
    """A checkpoint the user named that cannot be used is bad input of ``option`` (a
    ConfigError raised inside, naming its own setting, passes as it is)."""
    try:
        yield
    except ConfigError:
        raise
    except (CheckpointError, KeyError, TypeError, ValueError) as exc:
        reason = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        if str(path) not in reason:
            reason = f"{path}: {reason}"
        raise ConfigError(option, f"unusable checkpoint: {reason}") from None


def _saved_config(checkpoint: LoadedCheckpoint) -> dict[str, Any]:
    """The config of the run that saved ``checkpoint`` ({} when it has none readable)."""
    try:
        config = json.loads(checkpoint.tree.get("config_json", ""))
    except (TypeError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


@dataclass
class Position:
    """Optimizer steps done, and the attempt's starting point."""

    step: int
    start_step: int


class Job:
    """One attempt of one training run on this rank (built by ``run.run_training``)."""

    def __init__(
        self,
        config: TrainConfig,
        ctx: DistributedContext,
        run_dir: RunDir,
        data: DataSource,
        host_memory: HostMemory = HostMemory.DEFAULT,
    ) -> None:
        self.config = config
        self.host_memory = host_memory  # what keep_freed_host_memory() left this process in
        self.ctx = ctx
        self.run_dir = run_dir
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.comm_device = torch.device("cpu") if ctx.backend == "gloo" else ctx.device
        self.sizes = config.batch_sizes(ctx.world_size)
        self.threads = set_rank_threads(config.threads, ctx.launch.local_world_size)
        threads = int(self.threads["threads"])
        workers = config.data_workers if config.data_workers is not None else min(4, threads // 2)
        self.data_workers = workers if data.dataset is not None else 0
        self.batches = ShardedBatches(
            data,
            self.sizes.global_batch_size,
            self.rank,
            self.world_size,
            config.seed,
            config.augment,
            pin_memory=ctx.device.type == "cuda",
            workers=self.data_workers,
        )
        self.steps_per_epoch = self.batches.steps_per_epoch
        self.total_steps = config.steps or config.epochs * self.steps_per_epoch
        self.started = time.perf_counter()
        self.attempts = AttemptLog(run_dir)
        self.attempt = 0
        self.wall_base_s = 0.0
        self.fault = fault_plan()
        torch.manual_seed(config.seed)
        self.model: nn.Module = build_model(
            config, data.shape, data.num_classes, self.rank, self.world_size
        )
        self.model.to(ctx.device)
        self.precision = Precision(config.precision, ctx.device)
        self.method = build_method(
            method_name(config),
            MethodSetup(config, self.model, self.world_size, self.precision.scaler),
        )
        self.step = TrainStep(
            self.model, self.batches, ctx.device, self.method, self.world_size, self.precision
        )
        self.manager = CheckpointManager(
            run_dir.checkpoints,
            keep=config.keep_checkpoints,
            rank=self.rank,
            world_size=self.world_size,
        )
        # --checkpoint-async: the step pays for a host snapshot; a thread writes the file.
        self.writer = AsyncCheckpointWriter(self.manager) if config.checkpoint_async else None
        extra = tuple(p for p in self.method.phases if p not in PHASES)
        self.timer: PhaseTimer = phase_timer(config.cuda_sync, ctx.device, PHASES + extra)
        self.reached_target = False
        self.diverged_at = 0  # rank 0: the step ending the first window with a non-finite loss
        self.last_ckpt_time = time.perf_counter()
        self.skipped: list[SkippedCheckpoint] = []  # checkpoints this attempt's resume passed
        curvature = self.method.curvature_ranks
        self.trainers = self.world_size - curvature  # the first ranks; the others serve them
        self.orders = (  # training rank 0's orders to the curvature ranks
            OrderSender(self.trainers, curvature, ctx.timeout_s)
            if curvature and self.rank == 0
            else None
        )

    def _skip(self, item: SkippedCheckpoint) -> None:
        """A checkpoint the resume passed over: a line on rank 0, an entry of run.json."""
        self.skipped.append(item)
        if self.rank == 0:
            print(
                f"kfac-hpc train: skipped checkpoint {item.path}: {item.reason}",
                file=sys.stderr,
                flush=True,
            )

    def wall_s(self) -> float:
        """Seconds of running time of the whole run (earlier attempts included)."""
        return self.wall_base_s + time.perf_counter() - self.started

    # ----------------------------------------------------------------- set-up
    def resume(self) -> Position:
        """Continue from the run directory's latest checkpoint that fits (others are skipped),
        else ``--resume-from``; apply ``--init-factors`` to a fresh start. Writes nothing; a
        user's file that cannot be used is ConfigError naming its option."""
        state = self.method.state

        def fits(checkpoint: LoadedCheckpoint, named: bool = False) -> None:
            saved_config = _saved_config(checkpoint)
            mismatch = training_mismatch(
                checkpoint.tree,
                saved_config,
                method=self.method.name,
                config_method=self.config.method,
                optimizer=self.config.optimizer,
                workload=self.config.workload(),
            )
            if mismatch is not None and named:  # the user's file: refused naming the setting
                where = f"; {OPTIONS['resume_from'].flag} {checkpoint.path}"
                raise ConfigError(mismatch.field, mismatch.reason(where))
            if mismatch is not None:  # the run dir's own (its config hash refused it first)
                flag = OPTIONS[mismatch.field].flag
                raise CheckpointMismatchError(f"{flag}: {mismatch.reason()}")
            self.method.check_checkpoint(saved_config)
            check_restorable(
                checkpoint,
                model=self.model,
                optimizer=self.method.checkpointed_optimizer,
                preconditioner=state,
            )

        checkpoint = self.manager.load_latest(fits, on_skip=self._skip)
        error = None
        try:  # the user's files: read by each rank alone, so all agree before going on
            if checkpoint is None and self.config.resume_from:
                with _user_file("resume_from", self.config.resume_from):
                    checkpoint = load_checkpoint(self.config.resume_from, on_skip=self._skip)
                    fits(checkpoint, named=True)
            if checkpoint is None and self.config.init_factors and state is not None:
                with _user_file("init_factors", self.config.init_factors):
                    init_factors_from(self.config.init_factors, state)
        except ConfigError as exc:
            error = exc
        agree_on_input(error, self.rank, self.world_size, self.comm_device)
        if checkpoint is None:
            broadcast_parameters(self.model, self.world_size)
            return Position(0, 0)
        restored = restore_training_state(
            checkpoint,
            model=self.model,
            optimizer=self.method.checkpointed_optimizer,
            preconditioner=state,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.method.resumed(restored.config)
        return Position(restored.step, restored.step)

    def _local_flags(self, preemption: PreemptionHandler) -> StepFlags:
        """This rank's terms of the flags summed over ranks in the step's gradient allreduce."""
        now = time.perf_counter()
        limit = self.config.time_limit_s
        time_up = limit is not None and self.wall_s() >= limit
        every = self.config.checkpoint_every_min
        due = self.rank == 0 and every is not None and now - self.last_ckpt_time >= every * 60
        return StepFlags(
            float(time_up), float(due), float(self.diverged_at), preemption.local_flag()
        )

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, step: int) -> tuple[float, float]:
        """Test (loss, accuracy) over every training rank's share of the test set; rank 0
        records it. A method's curvature ranks take no part (the training ranks hold the
        training model): an evaluation never waits for their work. With
        ``precise_bn_batches`` N, BatchNorm is tested with statistics recomputed from N
        training batches of this epoch (batchnorm.py), averaged over the training ranks;
        training's own statistics return afterwards."""
        group = self.method.training_group
        if not self.method.curvature_ranks:
            self.method.synchronize()
        with self._test_statistics(step):
            average_buffers(self.model, self.trainers, group)
            loss, accuracy = evaluate(
                self.model, self.batches, self.ctx.device, self.trainers, self.precision, group
            )
        if self.rank == 0:
            epoch = step // self.steps_per_epoch
            record = eval_record(self.attempt, step, epoch, self.wall_s(), loss, accuracy)
            self.run_dir.append_metrics(record)
        return loss, accuracy

    def _test_statistics(self, step: int) -> AbstractContextManager[object]:
        """BatchNorm statistics recomputed at the current parameters for an evaluation at
        ``step`` (``precise_bn_batches`` > 0), from this rank's batches 0..N-1 of the epoch of
        ``step`` (the training data stream is indexed, so it is not moved)."""
        count = min(self.config.precise_bn_batches, self.steps_per_epoch)
        if count == 0:
            return nullcontext()
        epoch = step // self.steps_per_epoch
        device = self.ctx.device
        inputs = (self.batches.batch(epoch, index)[0].to(device) for index in range(count))

        def forward(x: torch.Tensor) -> object:
            with self.precision.autocast():
                return self.model(x)

        return recomputed_batchnorm(self.model, inputs, forward)

    # ----------------------------------------------------------------- checkpoints
    def save(self, step: int) -> None:
        """Checkpoint the training state at ``step`` (collective, curvature ranks included):
        BatchNorm statistics are averaged over the training ranks first, then
        ``synchronize`` gives every rank the training model."""
        if not self.method.is_curvature_rank:
            average_buffers(self.model, self.trainers, self.method.training_group)
        self.method.synchronize()
        self._check_finite_parameters(step)
        epoch, index = divmod(step, self.steps_per_epoch)
        state = capture_training_state(
            step=step,
            model=self.model,
            optimizer=self.method.checkpointed_optimizer,
            preconditioner=self.method.state,
            data_position=DataPosition(epoch, index, self.config.seed),
            config=self.config.to_dict(),
            config_hash=self.config.config_hash(),
            rank=self.rank,
            world_size=self.world_size,
            strategy=self.method.strategy,
            extra={
                "attempt": self.attempt,
                "wall_s": self.wall_s(),
                **recorded(self.method.name, self.config.optimizer, self.config.workload()),
            },
        )
        (self.writer or self.manager).save(state)
        self.last_ckpt_time = time.perf_counter()

    def _check_finite_parameters(self, step: int) -> None:
        """Raise TrainingDiverged on every rank when any rank's parameters are non-finite."""
        if not parameters_finite(self.model, self.world_size, self.comm_device):
            raise TrainingDiverged(
                f"the model's parameters are non-finite at step {step}; no checkpoint of them "
                f"was written: {_RETRY}"
            )

    # ----------------------------------------------------------------- the loop
    def loop(
        self,
        pos: Position,
        recorder: WindowRecorder,
        progress: Progress,
        preemption: PreemptionHandler,
    ) -> str:
        """Train until done (a curvature rank: :meth:`serve`); returns how the attempt ended:
        done, time_limit, target, preempted. Training rank 0 tells the curvature ranks."""
        if self.method.is_curvature_rank:
            return self.serve(pos)
        try:
            end = self._train(pos, recorder, progress, preemption)
        except BaseException:
            if self.orders is not None:
                self.orders.abort(pos.step)
            raise
        if self.orders is not None:
            self.orders.send(Order.FINISH, pos.step, ENDS.index(end))
        return end

    def serve(self, pos: Position) -> str:
        """A curvature rank: serve training rank 0's orders until the loop ends (``pos.step``
        is then the step it ended at); returns how it ended."""
        while True:
            order, step, value = receive_order()
            if order is Order.ESE:
                if self.fault is not None:
                    self.fault.hold_ese(self.rank, step, self.run_dir.root)
                x, y = self.step.batch(step)
                self.method.serve(step, value, self.step.curvature_loss(x, y))
            elif order is Order.SAVE:
                self.save(step)
            elif order is Order.FINISH:
                pos.step = step
                return ENDS[value]
            elif order is Order.ABORT:
                self._await_error_marker()
                raise PeerAborted(f"training rank 0 stopped the run at step {step}")

    def _await_error_marker(self, bound_s: float = 30.0) -> None:
        """Give the failing training rank the time to leave its message as the run's error."""
        deadline = time.monotonic() + bound_s
        while not self.run_dir.marker("error").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _train(
        self,
        pos: Position,
        recorder: WindowRecorder,
        progress: Progress,
        preemption: PreemptionHandler,
    ) -> str:
        """The training ranks' loop."""
        config, orders = self.config, self.orders
        while pos.step < self.total_steps:
            if self.fault is not None:
                self.fault.check(self.rank, self.world_size, pos.step, pos.start_step, preemption)
                self.fault.release(self.rank, pos.step, self.run_dir.root)
            self.timer.begin_step()
            lr = learning_rate(config, pos.step, self.steps_per_epoch, self.total_steps)
            local = list(self._local_flags(preemption))
            if orders is not None:
                number = self.method.curvature_request()
                if number is not None:
                    orders.send(Order.ESE, pos.step, number)
                orders.tick(pos.step)
            loss, summed = self.step(pos.step, lr, local, self.timer)
            flags = StepFlags(*summed)
            pos.step += 1
            recorder.add_loss(loss)
            _stop_if_diverged(flags.diverged_at)
            preempted = preemption.agreed(flags.preempted)
            self.timer.skip()  # the bookkeeping is neither optimizer nor checkpoint time
            every = config.checkpoint_every_steps
            if preempted or flags.checkpoint_due > 0 or (every and pos.step % every == 0):
                if orders is not None:
                    orders.send(Order.SAVE, pos.step)
                self.save(pos.step)
                self.timer.lap("checkpoint")
            self.timer.end_step()
            if pos.step % config.log_every == 0:
                self._close_window(recorder, pos.step, progress)
            if self._evaluation_due(pos.step):
                self._evaluate_at(pos.step, progress)
            if preempted:
                return "preempted"
            if flags.time_up > 0:
                return "time_limit"
            if self.reached_target and config.stop_at_target:
                return "target"
        return "done"

    def _evaluation_due(self, step: int) -> bool:
        """At every epoch end, and every ``eval_every_steps`` steps when that is set."""
        every = self.config.eval_every_steps
        return step % self.steps_per_epoch == 0 or (every > 0 and step % every == 0)

    def _close_window(self, recorder: WindowRecorder, step: int, progress: Progress) -> None:
        if self.method.is_curvature_rank:  # training rank 0 writes its row
            return
        curvature = self.method.drain_curvature_phases() if self.rank == 0 else None
        epoch = step // self.steps_per_epoch
        record = recorder.close(self.timer, step, epoch, self.wall_s(), curvature)
        progress.window(step, record)
        if record and not self.diverged_at and not math.isfinite(record["loss"]):
            self.diverged_at = step

    def _evaluate_at(self, step: int, progress: Progress) -> None:
        loss, accuracy = self.evaluate(step)
        target = self.config.target
        if target is not None and target.reached(accuracy, loss):
            self.reached_target = True
        progress.epoch(step, accuracy, self.wall_s())

    def finish(self, pos: Position, recorder: WindowRecorder, end: str, progress: Progress) -> None:
        """Close the last window, evaluate if the last step was not evaluated, and save a final
        checkpoint when checkpointing is on (so a longer run can continue from it)."""
        self._close_window(recorder, pos.step, progress)
        training = not self.method.is_curvature_rank
        if training:  # a curvature rank fails with the training ranks (a peer's exit)
            seen = torch.tensor(
                [float(self.diverged_at)], dtype=torch.float64, device=self.comm_device
            )
            if self.trainers > 1:  # the last window was seen by rank 0 only
                dist.all_reduce(seen, group=self.method.training_group)
            _stop_if_diverged(seen.item())
        if training and end != "preempted" and not self._evaluation_due(pos.step):
            self._evaluate_at(pos.step, progress)
        checkpointing = self.config.checkpoint_every_steps or self.config.checkpoint_every_min
        if end != "preempted" and checkpointing and pos.step > pos.start_step:
            self.save(pos.step)
        if self.writer is not None:  # exit and requeue wait for the write in flight
            self.writer.wait()

    # ----------------------------------------------------------------- records
    def facts(self, step: int, step_times: list[float]) -> dict[str, Any]:
        """What ``run.json`` reports that only the live job knows."""
        method = {"method": self.method.name, **self.method.run_facts()}
        epochs = step // self.steps_per_epoch
        facts = run_facts(self.config, self.ctx, self.run_dir, method, step, epochs, step_times)
        metric = self.batches.source.metric
        return {
            **facts,
            **self.threads,
            "huge_pages": huge_pages_enabled(),
            "data_workers": self.data_workers,
            "metric": metric,
            "higher_is_better": HIGHER_IS_BETTER[metric],
            "host_memory": str(self.host_memory),
            "skipped_checkpoints": self._skipped_records(),
        }

    def _skipped_records(self) -> list[dict[str, Any]]:
        """Every checkpoint a resume of this run passed over: the earlier attempts' (from the
        last run.json) and this one's, each ``{"attempt", "file", "reason"}``."""
        earlier: list[dict[str, Any]] = []
        try:
            previous = json.loads(self.run_dir.run.read_text(encoding="utf-8"))
            listed = previous.get("skipped_checkpoints") if isinstance(previous, dict) else None
            if isinstance(listed, list):
                earlier = [
                    e
                    for e in listed
                    if isinstance(e, dict)
                    and isinstance(e.get("attempt"), int)
                    and e["attempt"] < self.attempt
                ]
        except (OSError, UnicodeDecodeError, ValueError):  # none yet, or unreadable
            pass
        return earlier + [{"attempt": self.attempt, **s.record()} for s in self.skipped]
