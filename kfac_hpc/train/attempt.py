"""The bookkeeping of one attempt that the job and a script's :class:`~kfac_hpc.train.
script_run.Run` share: its number and the run's earlier wall time (agreed by every rank), its
end (the attempt log, ``run.json`` and exactly one marker), a failure's ``error`` marker, and
the model-wide checks and averages every rank takes part in before a checkpoint.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.contracts import RunDir, write_json_atomic
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.optim.finite import all_finite
from kfac_hpc.runtime import shutdown
from kfac_hpc.train.summary import AttemptLog, build_summary

__all__ = [
    "average_buffers",
    "begin_attempt",
    "broadcast_parameters",
    "end_attempt",
    "parameters_finite",
    "record_failure",
]


def begin_attempt(
    attempts: AttemptLog, rank: int, world_size: int, device: torch.device, start_step: int
) -> tuple[int, float]:
    """(this attempt's number, wall seconds of the earlier attempts): rank 0 logs the start and
    broadcasts both. Collective."""
    attempt, wall_base = 0, 0.0
    if rank == 0:
        attempt = attempts.next_attempt()
        wall_base = sum(a["wall_s"] for a in attempts.attempts())
        attempts.start(attempt, start_step)
    if world_size > 1:
        shared = torch.tensor([attempt, wall_base], dtype=torch.float64, device=device)
        dist.broadcast(shared, src=0)
        attempt, wall_base = int(shared[0].item()), float(shared[1].item())
    return attempt, wall_base


def end_attempt(
    attempts: AttemptLog, attempt: int, step: int, attempt_s: float, end: str, facts: dict[str, Any]
) -> None:
    """Rank 0: log the attempt's end, write run.json and the ``done`` or ``preempted`` marker."""
    attempts.end(attempt, step, attempt_s, end)
    state = "preempted" if end == "preempted" else "done"
    summary = build_summary(attempts.run_dir, state, facts)
    summary["end"] = end
    write_json_atomic(attempts.run_dir.run, summary)
    attempts.run_dir.write_marker(state)


def record_failure(
    run_dir: RunDir,
    rank: int,
    world_size: int,
    exc: BaseException,
    ended: Callable[[], tuple[AttemptLog, int, float, dict[str, Any]]] | None,
    *,
    prefix: str,
    quiet: tuple[type[BaseException], ...] = (),
    report: bool = True,
) -> int:
    """Leave the error marker (the first failing rank's message wins) and a run.json, then end
    this rank without touching the process group (a peer may be dead; collectives would hang).

    ``ended`` gives (attempt log, attempt, attempt seconds, facts) once the attempt started
    (None before). An exception of a ``quiet`` type is the user's input, not a bug: one line
    after ``prefix``, no traceback; ``report=False``: nothing printed (the caller re-raises
    it). With several ranks the process exits here."""
    message = f"rank {rank}: {type(exc).__name__}: {exc}"
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        if run_dir.write_marker("error", message) and ended is not None:
            attempts, attempt, attempt_s, facts = ended()
            facts["steps"] = max((r["step"] for r in run_dir.read_metrics()), default=0)
            attempts.end(attempt, facts["steps"], attempt_s, "error")
            write_json_atomic(run_dir.run, build_summary(run_dir, "error", facts, message))
    finally:
        if not report:
            pass
        elif isinstance(exc, quiet):
            print(f"{prefix}: {message}", file=sys.stderr)
        else:
            traceback.print_exception(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        if world_size > 1:
            os._exit(int(ExitCode.FAILED))
    shutdown()
    return int(ExitCode.FAILED)


def broadcast_parameters(model: nn.Module, world_size: int) -> None:
    """Every rank starts from rank 0's weights. Collective."""
    if world_size > 1:
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)


def average_buffers(model: nn.Module, world_size: int, group: Any = None) -> None:
    """BatchNorm running statistics differ per rank; test (and save) their average over the
    ``world_size`` ranks of ``group`` (None: the world)."""
    if world_size == 1:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, group=group)
            buffer.div_(world_size)


def parameters_finite(model: nn.Module, world_size: int, device: torch.device) -> bool:
    """Whether every rank's parameters are finite (the same answer on every rank). Collective."""
    finite = all_finite(list(model.parameters()))
    bad = torch.tensor([0.0 if finite else 1.0], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(bad)
    return bool(bad.item() == 0)
