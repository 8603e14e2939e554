"""Exit codes of every ``kfac-hpc`` command, the job's included: one vocabulary for the job,
its sbatch script, the local workflow and the CLI."""

from __future__ import annotations

import enum

__all__ = ["ExitCode"]


class ExitCode(enum.IntEnum):
    """What a process's exit status means.

    ``PREEMPTED`` is 75 (``EX_TEMPFAIL`` of sysexits.h): the job checkpointed on a signal and
    asks to be run again; the sbatch script turns it into ``scontrol requeue``. It is not
    ``FAILED`` because nothing went wrong: the next attempt continues from the checkpoint.
    """

    DONE = 0
    FAILED = 1  # the run failed (its ``error`` marker holds the message), or a scheduler command
    BAD_INPUT = 2  # a one-line error named the field and the fix; nothing was written
    PREEMPTED = 75
