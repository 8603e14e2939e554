"""The training job: set-up, the step loop, evaluation, checkpoints, and how a run ends.

One step: data -> forward -> backward -> gradient allreduce -> K-FAC ``step()`` -> optimizer.
Decisions every rank must share (stop for the time limit, checkpoint by the clock) ride on the
gradient allreduce; preemption is agreed by the checkpoint layer's ``should_stop()``. Every
run ends with exactly one marker: ``done``, ``error`` (with the message), or ``preempted``
(exit 75, waiting for its requeue).
"""

from __future__ import annotations

import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc import __version__
from kfac_hpc.checkpoint import (
    REQUEUE_EXIT_CODE,
    CheckpointManager,
    DataPosition,
    PreemptionHandler,
    capture_training_state,
    init_factors_from,
    load_checkpoint,
    restore_training_state,
)
from kfac_hpc.contracts import SCHEMA_VERSION, ExitCode, RunDir, write_json_atomic
from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.runtime import DistributedContext, init_distributed, shutdown
from kfac_hpc.train.config import ConfigError, TrainConfig, check_run_dir
from kfac_hpc.train.data import DataSource, ShardedBatches, load_data
from kfac_hpc.train.faults import fault_plan
from kfac_hpc.train.grad_sync import GradientAllreduce
from kfac_hpc.train.models import build_model
from kfac_hpc.train.optimizers import learning_rate, make_optimizer
from kfac_hpc.train.records import WindowRecorder, peak_memory, step_time_stats
from kfac_hpc.train.summary import AttemptLog, build_summary
from kfac_hpc.train.timing import PhaseTimer

__all__ = ["Job", "run_training"]

EXIT_DONE, EXIT_FAILED = ExitCode.DONE, ExitCode.FAILED
_EVAL_BATCH = 512


@dataclass
class Position:
    """Optimizer steps done, and the attempt's starting point."""

    step: int
    start_step: int


class Job:
    """One attempt of one training run on this rank; built by :func:`run_training`."""

    def __init__(
        self, config: TrainConfig, ctx: DistributedContext, run_dir: RunDir, data: DataSource
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.run_dir = run_dir
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.comm_device = torch.device("cpu") if ctx.backend == "gloo" else ctx.device
        self.sizes = config.batch_sizes(ctx.world_size)
        self.batches = ShardedBatches(
            data,
            self.sizes.global_batch_size,
            self.rank,
            self.world_size,
            config.seed,
            config.augment,
        )
        self.steps_per_epoch = self.batches.steps_per_epoch
        self.total_steps = config.steps or config.epochs * self.steps_per_epoch
        self.started = time.perf_counter()
        self.attempts = AttemptLog(run_dir)
        self.attempt = 0
        self.wall_base_s = 0.0
        self.fault = fault_plan()
        torch.manual_seed(config.seed)
        self.model: nn.Module = build_model(config.model, data.shape, data.num_classes)
        self.model.to(ctx.device)
        self.optimizer = make_optimizer(config, self.model)
        self.kfac = self._make_kfac() if config.kfac else None
        self.grad_sync = GradientAllreduce(self.model, self.world_size)
        self.loss_fn = nn.CrossEntropyLoss()
        self.manager = CheckpointManager(
            run_dir.checkpoints,
            keep=config.keep_checkpoints,
            rank=self.rank,
            world_size=self.world_size,
        )
        self.timer: PhaseTimer = PhaseTimer(config.cuda_sync)
        self.reached_target = False
        self.last_ckpt_time = time.perf_counter()

    # ----------------------------------------------------------------- set-up
    def _make_kfac(self) -> KFACPreconditioner:
        def current_lr(_step: int) -> float:
            return float(self.optimizer.param_groups[0]["lr"])

        return KFACPreconditioner(
            self.model,
            lr=current_lr,
            synchronize_timings=self.config.cuda_sync,
            **self.config.kfac_options(),
        )

    def wall_s(self) -> float:
        """Seconds of running time of the whole run (earlier attempts included)."""
        return self.wall_base_s + time.perf_counter() - self.started

    def strategy(self) -> str | None:
        return self.config.grad_worker_fraction if self.kfac is not None else None

    def resume(self) -> Position:
        """Continue from the run directory's latest checkpoint, else ``--resume-from``; apply
        ``--init-factors`` to a fresh start."""
        checkpoint = self.manager.load_latest()
        if checkpoint is None and self.config.resume_from:
            checkpoint = load_checkpoint(self.config.resume_from)
        if checkpoint is None:
            if self.config.init_factors and self.kfac is not None:
                init_factors_from(self.config.init_factors, self.kfac)
            self._broadcast_parameters()
            return Position(0, 0)
        restored = restore_training_state(
            checkpoint,
            model=self.model,
            optimizer=self.optimizer,
            preconditioner=self.kfac,
            rank=self.rank,
            world_size=self.world_size,
        )
        return Position(restored.step, restored.step)

    def _broadcast_parameters(self) -> None:
        """Every rank starts from rank 0's weights (same seed already; this makes it certain)."""
        if self.world_size > 1:
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)

    # ----------------------------------------------------------------- the step
    def train_step(self, step: int, flags: list[float]) -> tuple[torch.Tensor, list[float]]:
        """One optimizer step; returns (loss, the flags summed over ranks)."""
        timer = self.timer
        epoch, index = divmod(step, self.steps_per_epoch)
        x, y = self.batches.batch(epoch, index)
        x = x.to(self.ctx.device, non_blocking=True)
        y = y.to(self.ctx.device, non_blocking=True)
        timer.lap("data")
        loss = self.loss_fn(self.model(x), y)
        timer.lap("forward")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        timer.lap("backward")
        flags = self.grad_sync(flags)
        timer.lap("grad_allreduce")
        lr = learning_rate(self.config, step, self.steps_per_epoch, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.kfac is not None:
            self.kfac.step()
            timer.add(self.kfac.last_timings)
            timer.skip()
        self.optimizer.step()
        timer.lap("optimizer")
        return loss, flags

    def _local_flags(self) -> list[float]:
        """[time limit reached here, checkpoint due by rank 0's clock]."""
        now = time.perf_counter()
        limit = self.config.time_limit_s
        time_up = limit is not None and self.wall_s() >= limit
        every = self.config.checkpoint_every_min
        due = self.rank == 0 and every is not None and now - self.last_ckpt_time >= every * 60
        return [float(time_up), float(due)]

    # ----------------------------------------------------------------- evaluation
    def evaluate(self, step: int) -> float:
        """Test accuracy over every rank's share of the test set; rank 0 records it."""
        self._average_buffers()
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        with torch.no_grad():
            for idx in self.batches.test_batches(_EVAL_BATCH):
                x, y = self.batches.source.test(idx)
                x, y = x.to(self.ctx.device), y.to(self.ctx.device)
                logits = self.model(x)
                totals[0] += nn.functional.cross_entropy(logits, y, reduction="sum")
                totals[1] += (logits.argmax(1) == y).sum()
                totals[2] += len(y)
        self.model.train()
        if self.world_size > 1:
            dist.all_reduce(totals)
        loss, correct, count = totals.tolist()
        accuracy = correct / max(count, 1.0)
        if self.rank == 0:
            self.run_dir.append_metrics(
                {
                    "schema": SCHEMA_VERSION,
                    "kind": "eval",
                    "attempt": self.attempt,
                    "step": step,
                    "epoch": step // self.steps_per_epoch,
                    "wall_s": round(self.wall_s(), 6),
                    "loss": loss / max(count, 1.0),
                    "accuracy": accuracy,
                }
            )
        return accuracy

    def _average_buffers(self) -> None:
        """BatchNorm running statistics differ per rank; test (and save) their average."""
        if self.world_size == 1:
            return
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                dist.all_reduce(buffer)
                buffer.div_(self.world_size)

    # ----------------------------------------------------------------- checkpoints
    def save(self, step: int) -> None:
        self._average_buffers()
        epoch, index = divmod(step, self.steps_per_epoch)
        state = capture_training_state(
            step=step,
            model=self.model,
            optimizer=self.optimizer,
            preconditioner=self.kfac,
            data_position=DataPosition(epoch, index, self.config.seed),
            config=self.config.to_dict(),
            config_hash=self.config.config_hash(),
            rank=self.rank,
            world_size=self.world_size,
            strategy=self.strategy(),
            extra={"attempt": self.attempt, "wall_s": self.wall_s()},
        )
        self.manager.save(state)
        self.last_ckpt_time = time.perf_counter()

    # ----------------------------------------------------------------- the loop
    def loop(
        self,
        pos: Position,
        recorder: WindowRecorder,
        progress: Progress,
        preemption: PreemptionHandler,
    ) -> str:
        """Train until done; returns how the attempt ended: done, time_limit, target, preempted."""
        config = self.config
        while pos.step < self.total_steps:
            if self.fault is not None:
                self.fault.check(self.rank, pos.step)
            self.timer.begin_step()
            loss, flags = self.train_step(pos.step, self._local_flags())
            pos.step += 1
            recorder.add_loss(loss)
            preempted = preemption.should_stop()
            self.timer.skip()  # the agreement is neither optimizer nor checkpoint time
            every = config.checkpoint_every_steps
            if preempted or flags[1] > 0 or (every and pos.step % every == 0):
                self.save(pos.step)
                self.timer.lap("checkpoint")
            self.timer.end_step()
            end_of_epoch = pos.step % self.steps_per_epoch == 0
            if pos.step % config.log_every == 0:
                self._close_window(recorder, pos.step, progress)
            if end_of_epoch:
                self._end_epoch(pos.step, progress)
            if preempted:
                return "preempted"
            if flags[0] > 0:
                return "time_limit"
            if self.reached_target and config.stop_at_target:
                return "target"
        return "done"

    def _close_window(self, recorder: WindowRecorder, step: int, progress: Progress) -> None:
        record = recorder.close(self.timer, step, step // self.steps_per_epoch, self.wall_s())
        progress.window(step, record)

    def _end_epoch(self, step: int, progress: Progress) -> None:
        accuracy = self.evaluate(step)
        target = self.config.target_accuracy
        if target is not None and accuracy >= target:
            self.reached_target = True
        progress.epoch(step, accuracy, self.wall_s())

    def finish(self, pos: Position, recorder: WindowRecorder, end: str, progress: Progress) -> None:
        """Close the last window, evaluate if the last step was not evaluated, and save a final
        checkpoint when checkpointing is on (so a longer run can continue from it)."""
        self._close_window(recorder, pos.step, progress)
        if end != "preempted" and pos.step % self.steps_per_epoch != 0:
            self._end_epoch(pos.step, progress)
        checkpointing = self.config.checkpoint_every_steps or self.config.checkpoint_every_min
        if end != "preempted" and checkpointing and pos.step > pos.start_step:
            self.save(pos.step)

    # ----------------------------------------------------------------- records
    def facts(self, step: int, step_times: list[float]) -> dict[str, Any]:
        """What ``run.json`` reports that only the live job knows."""
        rss, cuda = peak_memory(self.ctx.device)
        config = self.config
        return {
            "run_id": self.run_dir.root.resolve().name,
            "config_hash": config.config_hash(),
            "model": config.model,
            "dataset": config.dataset,
            "optimizer": config.optimizer,
            "kfac": config.kfac,
            "grad_worker_fraction": config.grad_worker_share(self.world_size),
            "scaling": config.scaling,
            "world_size": self.world_size,
            "nodes": self.ctx.launch.num_nodes,
            "ranks_per_node": self.ctx.launch.local_world_size,
            "launcher": self.ctx.launch.source,
            "backend": self.ctx.backend,
            "global_batch_size": self.sizes.global_batch_size,
            "per_rank_batch_size": self.sizes.per_rank_batch_size,
            "steps": step,
            "epochs": step // self.steps_per_epoch,
            "target_accuracy": config.target_accuracy,
            "step_s": step_time_stats(step_times),
            "peak_rss_bytes": rss,
            "peak_cuda_bytes": cuda,
            "versions": {
                "kfac_hpc": __version__,
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
        }


class Progress:
    """One line per epoch on rank 0; a live step counter when stderr is a terminal."""

    def __init__(self, job: Job, enabled: bool) -> None:
        self.job = job
        self.enabled = enabled and job.rank == 0
        self.tty = self.enabled and sys.stderr.isatty()
        self.last_loss: float | None = None
        self.last_rate: float | None = None

    def window(self, step: int, record: dict[str, Any]) -> None:
        if record:
            self.last_loss, self.last_rate = record["loss"], record["samples_per_s"]
        if self.tty:
            job = self.job
            done = step % job.steps_per_epoch or job.steps_per_epoch
            width = 30
            bar = "#" * (width * done // job.steps_per_epoch)
            sys.stderr.write(f"\r  [{bar:<{width}}] {done}/{job.steps_per_epoch}")
            sys.stderr.flush()

    def epoch(self, step: int, accuracy: float, wall_s: float) -> None:
        if not self.enabled:
            return
        job = self.job
        epochs = -(-job.total_steps // job.steps_per_epoch)
        loss = "-" if self.last_loss is None else f"{self.last_loss:.4f}"
        rate = "-" if self.last_rate is None else f"{self.last_rate:.0f}"
        if self.tty:
            sys.stderr.write("\r" + " " * 50 + "\r")
        print(
            f"epoch {-(-step // job.steps_per_epoch)}/{epochs} step {step}/{job.total_steps} "
            f"loss {loss} acc {accuracy:.4f} {rate} samples/s {wall_s:.1f}s",
            flush=True,
        )


# --------------------------------------------------------------------- the run
def _prepare_run_dir(config: TrainConfig, run_dir: RunDir, ctx: DistributedContext) -> bool:
    """Check the run directory on every rank; rank 0 creates it and writes config.json.
    Returns False when the run is already done. Raises ConfigError for a different experiment."""
    check_run_dir(config, run_dir.saved_config_hash(), str(run_dir.root))
    if run_dir.marker("done").exists():
        return False
    if ctx.rank == 0:
        run_dir.create()
        run_dir.clear_markers()
        sizes = config.batch_sizes(ctx.world_size)
        resolved = {"schema": SCHEMA_VERSION, **config.to_dict()}
        resolved.update(
            config_hash=config.config_hash(),
            world_size=ctx.world_size,
            global_batch_size=sizes.global_batch_size,
            per_rank_batch_size=sizes.per_rank_batch_size,
        )
        write_json_atomic(run_dir.config, resolved)
    if ctx.world_size > 1:
        dist.barrier()
    return True


def _check_inputs(config: TrainConfig, ctx: DistributedContext) -> DataSource:
    """Input problems only the launched job can see, as ConfigError (exit 2, nothing written)."""
    sizes = config.batch_sizes(ctx.world_size)
    workers = config.grad_worker_share(ctx.world_size) * ctx.world_size
    if abs(workers - round(workers)) > 1e-9 or ctx.world_size % max(1, round(workers)):
        raise ConfigError(
            "grad_worker_fraction",
            f"{config.grad_worker_fraction} of {ctx.world_size} ranks is not a whole number of "
            "ranks dividing the world size; use comm-opt, mem-opt, hybrid-opt or such a fraction",
        )
    try:
        data = load_data(config)
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError("data_path", str(exc)) from None
    if data.train_len < sizes.global_batch_size:
        raise ConfigError(
            "batch_size",
            f"the global batch {sizes.global_batch_size} exceeds the {data.train_len} training "
            f"samples of {config.dataset}; use a smaller --batch-size",
        )
    return data


def run_training(config: TrainConfig, root: str | Path) -> int:
    """Run (or resume) the training run in ``root`` on this rank; returns the exit code.

    Raises ConfigError (before anything is written) for bad input.
    """
    backend = None if config.backend == "auto" else config.backend
    ctx = init_distributed(backend, config.collective_timeout_s)
    run_dir = RunDir(root)
    try:
        data = _check_inputs(config, ctx)
        fresh = _prepare_run_dir(config, run_dir, ctx)
    except ConfigError:
        shutdown()
        raise
    if not fresh:
        if ctx.rank == 0:
            print(f"{run_dir.root}: already done", flush=True)
        shutdown()
        return EXIT_DONE
    job: Job | None = None
    try:
        job = Job(config, ctx, run_dir, data)
        code = _run_attempt(job)
    except BaseException as exc:  # every failure must leave the error marker
        return _fail(run_dir, ctx, job, exc)
    shutdown()
    return code


def _run_attempt(job: Job) -> int:
    # Catch preemption signals from the start: a signal during set-up stops at the first step.
    with PreemptionHandler() as preemption:
        return _attempt(job, preemption)


def _attempt(job: Job, preemption: PreemptionHandler) -> int:
    run_dir, attempts = job.run_dir, job.attempts
    pos = job.resume()
    if job.rank == 0:
        job.attempt = attempts.next_attempt()
        job.wall_base_s = sum(a["wall_s"] for a in attempts.attempts())
        attempts.start(job.attempt, pos.start_step)
    if job.world_size > 1:
        shared = torch.tensor(
            [job.attempt, job.wall_base_s], dtype=torch.float64, device=job.comm_device
        )
        dist.broadcast(shared, src=0)
        job.attempt, job.wall_base_s = int(shared[0].item()), float(shared[1].item())
    recorder = WindowRecorder(
        run_dir,
        job.rank,
        job.world_size,
        job.comm_device,
        job.sizes.global_batch_size,
        job.attempt,
    )
    progress = Progress(job, job.config.progress)
    end = job.loop(pos, recorder, progress, preemption)
    job.finish(pos, recorder, end, progress)
    if job.rank == 0:
        attempt_wall = time.perf_counter() - job.started
        attempts.end(job.attempt, pos.step, attempt_wall, end)
        state = "preempted" if end == "preempted" else "done"
        summary = build_summary(run_dir, state, job.facts(pos.step, recorder.rank0_step_s))
        summary["end"] = end
        write_json_atomic(run_dir.run, summary)
        run_dir.write_marker(state)
    if job.world_size > 1:
        dist.barrier()
    return REQUEUE_EXIT_CODE if end == "preempted" else EXIT_DONE


def _fail(run_dir: RunDir, ctx: DistributedContext, job: Job | None, exc: BaseException) -> int:
    """Leave the error marker (first failing rank's message wins) and a run.json, then end this
    rank without touching the process group (a peer may be dead; collectives would hang)."""
    message = f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        if run_dir.write_marker("error", message) and job is not None:
            facts = job.facts(0, [])
            facts["steps"] = max((r["step"] for r in run_dir.read_metrics()), default=0)
            attempt_s = time.perf_counter() - job.started
            job.attempts.end(job.attempt, facts["steps"], attempt_s, "error")
            write_json_atomic(run_dir.run, build_summary(run_dir, "error", facts, message))
    finally:
        traceback.print_exception(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        if ctx.world_size > 1:
            os._exit(EXIT_FAILED)
    shutdown()
    return EXIT_FAILED
