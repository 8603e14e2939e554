"""Point states: one documented vocabulary for the sweep manifest, ``status``, the workflow and
the collector, and the one classifier of a point's state from its run directory.

The scheduler backends translate their own words (Slurm's ``TIMEOUT``, a local exit code) into
:class:`PointState`; nothing above this module compares state strings.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from kfac_hpc.contracts.rundir import Markers

__all__ = [
    "ENDED_BADLY",
    "LIVE",
    "RESUMABLE",
    "TERMINAL",
    "PointState",
    "Verdict",
    "classify_point",
]


class PointState(str, enum.Enum):
    """The state of one point (one training run) of a sweep, as stored in the manifest."""

    PENDING = "pending"  # in the manifest, never submitted (or the submission was not reached)
    SUBMITTED = "submitted"  # the scheduler holds it, not started yet
    RUNNING = "running"  # a job of it runs now
    # Checkpointed on a signal and back in the queue: live, unlike PREEMPTED, because the
    # scheduler will start it again without anyone asking.
    REQUEUED = "requeued"
    DONE = "done"  # the ``done`` marker: run.json is complete
    FAILED = "failed"  # the ``error`` marker, a failing exit, or gone without any end marker
    # The scheduler's time limit ended it: not FAILED, because the run itself was healthy
    # and ``resume`` continues it from its latest checkpoint instead of starting it again.
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"  # ``kfac-hpc cancel`` or scancel; resumable like TIMEOUT
    # Checkpointed on a signal (exit 75) and nobody will requeue it (a local run, or a requeue
    # that did not happen): terminal until ``resume``.
    PREEMPTED = "preempted"

    def __str__(self) -> str:
        return self.value


# A point in one of these states needs nobody: it has ended for good or until `resume`.
TERMINAL = frozenset(
    {
        PointState.DONE,
        PointState.FAILED,
        PointState.TIMEOUT,
        PointState.CANCELLED,
        PointState.PREEMPTED,
    }
)
# The scheduler still holds the point (or will start it): `wait` waits, `cancel` cancels.
LIVE = frozenset(
    {PointState.PENDING, PointState.SUBMITTED, PointState.RUNNING, PointState.REQUEUED}
)
# The states `resume` runs again (FAILED clean, the others from their checkpoint).
RESUMABLE = frozenset(
    {PointState.FAILED, PointState.TIMEOUT, PointState.CANCELLED, PointState.PREEMPTED}
)
# Final verdicts of a scheduler (or of an earlier refresh) that a ``preempted`` marker does
# not overrule: the requeue that marker asked for did not happen.
ENDED_BADLY = frozenset({PointState.FAILED, PointState.TIMEOUT, PointState.CANCELLED})


class Verdict(NamedTuple):
    """A state and the one-line detail shown beside it (empty when there is nothing to add)."""

    state: PointState
    detail: str = ""


def classify_point(
    markers: Markers,
    known: Verdict,
    *,
    live: Verdict | None = None,
    ended: Verdict | None = None,
    asked: bool = False,
) -> Verdict:
    """The state of a point, from (in this order) the job the scheduler holds now (``live``),
    the run directory's markers, the last known verdict (``known``, e.g. the manifest's), and
    the scheduler's final word on the job (``ended``: Slurm's accounting, a local exit code).

    ``asked`` says the scheduler was asked about this point's job: a point it does not hold,
    with no end marker and no final word, then ended without one and is FAILED.
    """
    if live is not None:
        if live.state is PointState.SUBMITTED and markers.preempted is not None:
            return Verdict(PointState.REQUEUED, live.detail)
        return live
    if markers.done is not None:
        return Verdict(PointState.DONE)
    if markers.error is not None:
        return Verdict(PointState.FAILED, markers.error[:200] or "error marker")
    if known.state in ENDED_BADLY:
        return known
    if markers.preempted is not None:
        return Verdict(PointState.PREEMPTED, "checkpointed, waiting for a requeue")
    if ended is not None:
        return ended
    if asked and known.state in LIVE:
        return Verdict(
            PointState.FAILED, "gone from the scheduler without a marker; see the log in logs/"
        )
    return known
