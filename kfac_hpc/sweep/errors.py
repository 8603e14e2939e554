"""The sweep's errors: bad input is an :class:`~kfac_hpc.contracts.errors.InputError`
(contracts/errors.py); a failed workflow step is not bad input."""

from __future__ import annotations

from kfac_hpc.contracts.errors import InputError

__all__ = ["SweepInputError", "WorkflowError"]


class SweepInputError(InputError):
    """Bad sweep input, an :class:`InputError`: ``kfac-hpc sweep: error: field: message`` on
    one line, exit 2 (cli_errors.py)."""


class WorkflowError(RuntimeError):
    """A workflow step failed for a reason other than bad input or the scheduler: one line
    naming the step (``kfac-hpc sweep`` exits 1 with it)."""
