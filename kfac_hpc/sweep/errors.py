"""The one error type for bad sweep input: it names the field and the fix."""

from __future__ import annotations

from kfac_hpc.contracts.errors import InputError

__all__ = ["SweepInputError", "WorkflowError"]


class SweepInputError(InputError):
    """Bad user input. The CLI prints ``field: message`` on one line and exits 2."""


class WorkflowError(RuntimeError):
    """A workflow step failed for a reason other than bad input or the scheduler: one line
    naming the step (``kfac-hpc sweep`` exits 1 with it)."""
