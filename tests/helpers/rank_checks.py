"""The rank side of a multi-rank test: named checks in lockstep, and a job that ends the moment
any rank fails, so that a failure on one rank is reported by it instead of becoming a hang.

A rank that fails cannot know whether another rank is blocked in a collective it will now never
join, so it reports and leaves the job at once (``os._exit``): the launcher (mpiexec, or srun
with ``--kill-on-bad-exit``) ends the other ranks, and a rank blocked on it in gloo gets a closed
connection. A failed rank never enters another collective, so no collective can be matched
with the wrong one. Ranks that passed a check agree on it with a barrier before the next one.

Each rank prints one JSON record per check, ``{"rank", "world_size", "check", "error"}``
(``error`` null: the check passed on every rank, since the record is printed after the
agreement), and ``{"rank", "world_size", "finished": true}`` at the end. The pytest side reads
them with :func:`tests.helpers.rank_records.CheckReport`.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch.distributed as dist


def emit(record: dict[str, Any]) -> None:
    """Print one JSON line with one ``write`` (the launcher merges every rank's stdout)."""
    os.write(1, (json.dumps(record) + "\n").encode())


def leave_job(code: int = 1) -> NoReturn:
    """End this rank now: no atexit handler, no join of a background thread, no collective."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_checks(checks: Mapping[str, Callable[[], None]]) -> None:
    """Run ``checks`` in order on every rank; the first failure anywhere ends the job."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for name, check in checks.items():
        try:
            check()
        except BaseException:
            error = traceback.format_exc(limit=4)
            emit({"rank": rank, "world_size": world_size, "check": name, "error": error})
            leave_job()
        try:
            dist.barrier()  # every rank passed `name` before anyone starts the next check
        except Exception:
            leave_job()
        emit({"rank": rank, "world_size": world_size, "check": name, "error": None})
    emit({"rank": rank, "world_size": world_size, "finished": True})


def main_or_leave(main: Callable[[], int | None]) -> NoReturn:
    """Run a rank's ``main``; on any exception print it and leave the job at once (a rank that
    raised must not wait in interpreter shutdown while the others wait for it)."""
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:
        rank = os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "?"))
        sys.stderr.write(f"rank {rank} failed:\n{traceback.format_exc()}")
        leave_job()
    sys.exit(code or 0)
