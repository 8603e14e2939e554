"""``kfac-hpc plan``'s name for bad input, an :class:`~kfac_hpc.contracts.errors.InputError`,
so that the planner's modules need not know the CLI."""

from __future__ import annotations

from kfac_hpc.contracts.errors import InputError

__all__ = ["PlanInputError", "shown"]


class PlanInputError(InputError):
    """Bad plan input, an :class:`InputError`: ``kfac-hpc plan: error: --flag: message`` on one
    line, exit 2, nothing written (cli_errors.py)."""


def shown(text: str) -> str:
    """``text`` as a message shows it: as is when printable, else its ``repr`` (one line)."""
    return text if text.isprintable() else repr(text)
