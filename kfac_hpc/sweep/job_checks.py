"""Every point checked as its job will check it, before anything is written or submitted.

The sweep knows the job only as a command (its arguments, :mod:`kfac_hpc.sweep.train_args`)
and through the contracts. What only the job can judge it asks the job, through one seam:
:mod:`kfac_hpc.train.launch_checks`, reached by name (:data:`JOB_CHECKS`), the sweep's only
reference to ``kfac_hpc.train`` (tests/sweep/test_layering.py holds it to that).

:func:`check_train_values` has each point's train command line, the ``--train-arg``
pass-through arguments included, parsed by the ``kfac-hpc train`` command's own flags and
validated as the job validates it at the point's world size, so a value ``kfac-hpc train``
rejects is rejected by the sweep, with the same message. :func:`check_loadable` has the job
load each distinct dataset and build each distinct model (torch is imported): a point whose
data or model cannot load fails here, not in the queue.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol, cast

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.spec import Point
from kfac_hpc.sweep.train_args import train_argv

__all__ = ["JOB_CHECKS", "check_loadable", "check_train_values"]

# The seam (its contract: JobChecks below).
JOB_CHECKS = "kfac_hpc.train.launch_checks"


class JobChecks(Protocol):
    """What the sweep asks of :data:`JOB_CHECKS`."""

    ARGUMENTS: str  # the field of arguments the train command's parser refuses
    RUN_DIR: str  # the field of arguments that name a --run-dir

    def check_train_args(self, argv: Sequence[str], world_size: int) -> None: ...

    def check_loadable(self, argvs: Sequence[Sequence[str]]) -> tuple[int, InputError] | None: ...


def _job() -> JobChecks:
    return cast(JobChecks, importlib.import_module(JOB_CHECKS))


def _world_size(point: Point) -> int:
    return int(point.params["nodes"]) * int(point.params["ranks_per_node"])


def _where(point: Point) -> str:
    return f"point {point.point_id} ({point.params['nodes']} node(s), {_world_size(point)} rank(s))"


def _refused(job: JobChecks, exc: InputError, point: Point) -> SweepInputError:
    """The job's refusal as the sweep's: the field to fix, and the point."""
    if exc.field == job.ARGUMENTS:
        why = f"kfac-hpc train refuses the --train-arg arguments: {exc.reason}"
        return SweepInputError("extra_args", why)
    if exc.field == job.RUN_DIR:
        why = "--run-dir is the sweep's (SWEEP_DIR/runs/POINT); remove it from --train-arg"
        return SweepInputError("extra_args", why)
    return SweepInputError(exc.field, f"{exc.reason} ({_where(point)})")


def check_train_values(points: Sequence[Point]) -> None:
    """SweepInputError naming the field when a point's train values are not valid for
    ``kfac-hpc train`` at the point's world size."""
    job = _job()
    seen: set[str] = set()
    for point in points:
        key = repr(sorted((k, repr(v)) for k, v in point.params.items() if k != "repeat"))
        if key in seen:
            continue
        seen.add(key)
        try:
            job.check_train_args(train_argv(point.params), _world_size(point))
        except InputError as exc:
            raise _refused(job, exc, point) from None


def check_loadable(points: Sequence[Point]) -> None:
    """SweepInputError naming the point's flag when its dataset cannot be loaded or its model
    cannot be built here."""
    job = _job()
    failed = job.check_loadable([train_argv(p.params) for p in points])
    if failed is not None:
        index, exc = failed
        raise _refused(job, exc, points[index])
