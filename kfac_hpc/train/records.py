"""Timing records: every rank's window of phase times gathered to rank 0, once per window.

A window is ``log_every`` steps (or fewer at the end of an attempt). Each rank packs
``[steps, step seconds, loss sum, seconds of each phase of the timer]`` into one float64 tensor; one
``gather`` brings them to rank 0, which writes the ``train`` record of docs/contracts.md and
keeps its own step durations for the percentiles of ``run.json``.

A method's curvature ranks take no step and are in no per-step collective: the gather runs over
the training ranks, and rank 0 writes each curvature rank's row itself from what the curvature
ranks reported with their results received in the window (the seconds of each phase, e.g. FOSI's
``ese``; step seconds: their sum; no loss). The window's loss and step seconds are the training
ranks' means; its phases the means over every rank, as before. Also here: the ``eval``
record, and the facts of ``run.json`` that only the live job knows.
"""

from __future__ import annotations

import platform
import resource
import statistics
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from kfac_hpc import __version__
from kfac_hpc.contracts import SCHEMA_VERSION, RunDir
from kfac_hpc.contracts.records import EVAL, TRAIN
from kfac_hpc.runtime import DistributedContext
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.timing import PhaseTimer

__all__ = [
    "NullRecorder",
    "WindowRecorder",
    "eval_record",
    "launch_facts",
    "peak_memory",
    "run_facts",
    "step_time_stats",
]

_HEAD = 3  # steps, step seconds, loss sum


class WindowRecorder:
    """Closes logging windows: a collective (every rank calls :meth:`close` at the same step)."""

    def __init__(
        self,
        run_dir: RunDir,
        rank: int,
        world_size: int,
        device: torch.device,
        global_batch: int,
        attempt: int,
        curvature_ranks: int = 0,
        group: Any = None,
    ) -> None:
        """``curvature_ranks``: the world's last ranks, which take no step; ``group``: the
        process group of the others (None: the world)."""
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.trainers = world_size - curvature_ranks
        self.group = group
        self.device = device
        self.global_batch = global_batch
        self.attempt = attempt
        self.rank0_step_s: list[float] = []  # every step of this attempt, for percentiles
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Accumulate on the device: no host sync per step."""
        self._loss_sum += loss.detach()

    def close(
        self,
        timer: PhaseTimer,
        step: int,
        epoch: int,
        wall_s: float,
        curvature: Mapping[str, float] | None = None,
    ) -> dict[str, Any]:
        """Gather the window from every training rank; rank 0 appends the record and returns
        it (other ranks return ``{}``). ``curvature`` (rank 0): the seconds of each phase the
        curvature ranks reported in the window."""
        phases, step_times = timer.drain()
        local = torch.tensor(
            [float(len(step_times)), sum(step_times), 0.0, *phases],
            dtype=torch.float64,
            device=self.device,
        )
        local[2] = self._loss_sum
        self._loss_sum.zero_()
        if self.trainers > 1:
            rows = (
                [torch.empty_like(local) for _ in range(self.trainers)] if self.rank == 0 else None
            )
            dist.gather(local, rows, dst=0, group=self.group)
        else:
            rows = [local]
        if self.rank != 0:
            return {}
        assert rows is not None
        table = torch.stack(rows).cpu().tolist()
        if self.trainers < self.world_size:
            busy = [float((curvature or {}).get(name, 0.0)) for name in timer.phases]
            steps = float(len(step_times))
            table += [[steps, sum(busy), 0.0, *busy]] * (self.world_size - self.trainers)
        self.rank0_step_s.extend(step_times)
        return self._record(table, timer.phases, step, epoch, wall_s)

    def _record(
        self,
        table: list[list[float]],
        names: tuple[str, ...],
        step: int,
        epoch: int,
        wall_s: float,
    ) -> dict[str, Any]:
        steps = int(table[0][0])
        if steps == 0:
            return {}
        rank_step_s = [row[1] / steps for row in table]
        training = table[: self.trainers]
        step_s = statistics.fmean(rank_step_s[: self.trainers])
        record = {
            "schema": SCHEMA_VERSION,
            "kind": TRAIN,
            "attempt": self.attempt,
            "step": step,
            "epoch": epoch,
            "wall_s": round(wall_s, 6),
            "window_steps": steps,
            "loss": statistics.fmean(row[2] / steps for row in training),
            "samples_per_s": self.global_batch / step_s if step_s > 0 else 0.0,
            "step_s": step_s,
            "phases_s": {
                name: statistics.fmean(row[_HEAD + i] / steps for row in table)
                for i, name in enumerate(names)
            },
            "rank_step_s": rank_step_s,
            "rank_phases_s": {
                name: [row[_HEAD + i] / steps for row in table] for i, name in enumerate(names)
            },
        }
        self.run_dir.append_metrics(record)
        return record


class NullRecorder(WindowRecorder):
    """Records off: nothing accumulated, gathered or written (the benchmark's baseline)."""

    def add_loss(self, loss: torch.Tensor) -> None:
        pass

    def close(
        self,
        timer: PhaseTimer,
        step: int,
        epoch: int,
        wall_s: float,
        curvature: Mapping[str, float] | None = None,
    ) -> dict[str, Any]:
        return {}


def step_time_stats(step_times: list[float]) -> dict[str, float | int | None]:
    """Mean, median and 90th percentile (nearest rank) of step durations in seconds."""
    if not step_times:
        return {"mean": None, "p50": None, "p90": None, "n": 0}
    ordered = sorted(step_times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "mean": statistics.fmean(ordered),
        "p50": statistics.median(ordered),
        "p90": p90,
        "n": len(ordered),
    }


def peak_memory(device: torch.device) -> tuple[int, int | None]:
    """(peak RSS of this process in bytes, peak CUDA allocation in bytes or None)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return int(rss), None if cuda is None else int(cuda)


def eval_record(
    attempt: int, step: int, epoch: int, wall_s: float, loss: float, accuracy: float
) -> dict[str, Any]:
    """The ``eval`` record of docs/contracts.md."""
    return {
        "schema": SCHEMA_VERSION,
        "kind": EVAL,
        "attempt": attempt,
        "step": step,
        "epoch": epoch,
        "wall_s": round(wall_s, 6),
        "loss": loss,
        "accuracy": accuracy,
    }


def launch_facts(
    ctx: DistributedContext, run_dir: RunDir, step_times: list[float]
) -> dict[str, Any]:
    """What ``run.json`` reports of the launch and the process, whatever the training config:
    the run's id, world, launcher, step-time statistics, peak memory and versions."""
    rss, cuda = peak_memory(ctx.device)
    return {
        "run_id": run_dir.root.resolve().name,
        "world_size": ctx.world_size,
        "nodes": ctx.launch.num_nodes,
        "ranks_per_node": ctx.launch.local_world_size,
        "launcher": ctx.launch.source,
        "backend": ctx.backend,
        "step_s": step_time_stats(step_times),
        "peak_rss_bytes": rss,
        "peak_cuda_bytes": cuda,
        "versions": {
            "kfac_hpc": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }


def run_facts(
    config: TrainConfig,
    ctx: DistributedContext,
    run_dir: RunDir,
    method: dict[str, Any],
    step: int,
    epochs: int,
    step_times: list[float],
) -> dict[str, Any]:
    """What ``run.json`` reports that only the live job knows; ``method`` holds the training
    method's name and the fields it adds."""
    sizes = config.batch_sizes(ctx.world_size)
    return {
        "config_hash": config.config_hash(),
        **config.workload(),
        "optimizer": config.optimizer,
        "precision": config.precision,
        **method,
        "scaling": config.scaling,
        "global_batch_size": sizes.global_batch_size,
        "per_rank_batch_size": sizes.per_rank_batch_size,
        "steps": step,
        "epochs": epochs,
        "target_accuracy": config.target_accuracy,
        "target_loss": config.target_loss,
        **launch_facts(ctx, run_dir, step_times),
    }
