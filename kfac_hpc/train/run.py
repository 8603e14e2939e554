"""The lifecycle of one training run on this rank: check the input, prepare the run directory,
run an attempt under the preemption handler, and end with exactly one marker: ``done``,
``error`` (with the message), or ``preempted`` (exit 75, waiting for its requeue).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kfac_hpc.contracts import SCHEMA_VERSION, ExitCode, HostMemory, RunDir, write_json_atomic
from kfac_hpc.runtime import DistributedContext, init_distributed, keep_freed_host_memory, shutdown
from kfac_hpc.train.attempt import begin_attempt, end_attempt, record_failure
from kfac_hpc.train.config import ConfigError, TrainConfig, check_run_dir
from kfac_hpc.train.curvature_ranks import PeerAborted
from kfac_hpc.train.data import DataSource
from kfac_hpc.train.job import Job, Position, TrainingDiverged, agree_on_input
from kfac_hpc.train.preemption import REQUEUE_EXIT_CODE, PreemptionHandler, ignore_signals
from kfac_hpc.train.progress import Progress
from kfac_hpc.train.records import WindowRecorder
from kfac_hpc.train.summary import AttemptLog
from kfac_hpc.train.workloads import load_data

__all__ = ["EXIT_DONE", "EXIT_FAILED", "run_training"]

EXIT_DONE, EXIT_FAILED = int(ExitCode.DONE), int(ExitCode.FAILED)


def _is_done(config: TrainConfig, run_dir: RunDir) -> bool:
    """Whether the run is already done; ConfigError for a different experiment. Reads only."""
    check_run_dir(config, run_dir.saved_config_hash(), str(run_dir.root))
    return run_dir.marker("done").exists()


def _prepare_run_dir(config: TrainConfig, run_dir: RunDir, ctx: DistributedContext) -> None:
    """Rank 0 creates the run directory and writes config.json (every input checked)."""
    if ctx.rank == 0:
        try:
            run_dir.create()
        except OSError as exc:
            raise ConfigError("run_dir", f"cannot create {str(run_dir.root)!r}: {exc}") from None
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


def _check_inputs(config: TrainConfig, ctx: DistributedContext) -> DataSource:
    """Input problems only the launched job can see, as ConfigError (exit 2, nothing written)."""
    sizes = config.batch_sizes(ctx.world_size)
    config.check_world_size(ctx.world_size)
    workers = config.grad_worker_share(ctx.world_size) * ctx.world_size
    if abs(workers - round(workers)) > 1e-9 or ctx.world_size % max(1, round(workers)):
        raise ConfigError(
            "grad_worker_fraction",
            f"{config.grad_worker_fraction} of {ctx.world_size} ranks is not a whole number of "
            "ranks dividing the world size; use comm-opt, mem-opt, hybrid-opt or such a fraction",
        )
    data = load_data(config, ctx.rank, ctx.world_size)
    if data.train_len < sizes.global_batch_size:
        raise ConfigError(
            "batch_size",
            f"the global batch {sizes.global_batch_size} exceeds the {data.train_len} training "
            f"samples of {config.dataset}; use a smaller --batch-size",
        )
    return data


def run_training(
    config: TrainConfig, root: str | Path, *, ignore_late_signals: bool = False
) -> int:
    """Run (or resume) the training run in ``root`` on this rank; returns the exit code.

    Raises ConfigError (before anything is written) for bad input. ``ignore_late_signals``
    (the train command, whose process exits next): once the run's end is on disk, preemption
    signals are ignored until the process exits, so a late one cannot change the exit status;
    without it (a caller that goes on) the signal handlers from before are put back.
    """
    host_memory = keep_freed_host_memory() if config.keep_freed_memory else HostMemory.DEFAULT
    backend = None if config.backend == "auto" else config.backend
    ctx = init_distributed(backend, config.collective_timeout_s)
    run_dir = RunDir(root)
    error = None
    try:
        data = _check_inputs(config, ctx)
        done = _is_done(config, run_dir)
    except ConfigError as exc:
        error = exc
    try:  # every rank exits 2 if any rank found bad input; the lowest of them says why
        comm_device = torch.device("cpu") if ctx.backend == "gloo" else ctx.device
        agree_on_input(error, ctx.rank, ctx.world_size, comm_device)
    except ConfigError:
        shutdown()
        raise
    if done:
        if ignore_late_signals:
            ignore_signals()  # nothing to stop: a late signal must not turn exit 0 into a kill
        if ctx.rank == 0:
            print(f"{run_dir.root}: already done", flush=True)
        shutdown()
        return EXIT_DONE
    job: Job | None = None
    written = False
    try:
        # Catch preemption signals from the start: a signal during set-up stops at step one.
        with PreemptionHandler() as preemption:
            job = Job(config, ctx, run_dir, data, host_memory)
            pos = job.resume()  # a user's checkpoint that cannot be used: ConfigError
            _prepare_run_dir(config, run_dir, ctx)
            written = True
            code = _attempt(job, pos, preemption, ignore_late_signals)
    except ConfigError as exc:
        if written:
            return _fail(run_dir, ctx, job, exc)
        shutdown()
        raise
    except BaseException as exc:  # every failure must leave the error marker
        return _fail(run_dir, ctx, job, exc)
    shutdown()
    return code


def _attempt(
    job: Job, pos: Position, preemption: PreemptionHandler, ignore_late_signals: bool
) -> int:
    job.attempt, job.wall_base_s = begin_attempt(
        job.attempts, job.rank, job.world_size, job.comm_device, pos.start_step
    )
    recorder = WindowRecorder(
        job.run_dir,
        job.rank,
        job.world_size,
        job.comm_device,
        job.sizes.global_batch_size,
        job.attempt,
        job.method.curvature_ranks,
        job.method.training_group,
    )
    progress = Progress(job, job.config.progress)
    end = job.loop(pos, recorder, progress, preemption)
    job.finish(pos, recorder, end, progress)
    if job.rank == 0:
        facts = job.facts(pos.step, recorder.rank0_step_s)
        end_attempt(
            job.attempts, job.attempt, pos.step, time.perf_counter() - job.started, end, facts
        )
    if job.world_size > 1:
        dist.barrier()
    if ignore_late_signals:
        preemption.settle()  # the end is on disk: a late signal must not change the exit status
    return REQUEUE_EXIT_CODE if end == "preempted" else EXIT_DONE


def _fail(run_dir: RunDir, ctx: DistributedContext, job: Job | None, exc: BaseException) -> int:
    """Leave the error marker and a run.json (:func:`~kfac_hpc.train.attempt.record_failure`)."""

    def ended() -> tuple[AttemptLog, int, float, dict[str, Any]]:
        assert job is not None
        return job.attempts, job.attempt, time.perf_counter() - job.started, job.facts(0, [])

    return record_failure(
        run_dir,
        ctx.rank,
        ctx.world_size,
        exc,
        None if job is None else ended,
        prefix="kfac-hpc train",
        quiet=(TrainingDiverged, PeerAborted),
    )
