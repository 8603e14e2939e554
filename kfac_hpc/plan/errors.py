"""``kfac-hpc plan``'s name for bad input, an :class:`~kfac_hpc.contracts.errors.InputError`,
so that the planner's modules need not know the CLI."""

from __future__ import annotations

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.options import TEXT_DATASETS, TEXT_MODELS

__all__ = ["PlanInputError", "check_planned", "shown"]


class PlanInputError(InputError):
    """Bad plan input, an :class:`InputError`: ``kfac-hpc plan: error: --flag: message`` on one
    line, exit 2, nothing written (cli_errors.py)."""


def shown(text: str) -> str:
    """``text`` as a message shows it: as is when printable, else its ``repr`` (one line)."""
    return text if text.isprintable() else repr(text)


def check_planned(model: str, dataset: str) -> None:
    """PlanInputError for the transformer workload (gpt on text): its cost model (attention,
    sequence rows) is not written yet, so plan says so rather than predict it wrongly."""
    for field, value, text in (("model", model, TEXT_MODELS), ("dataset", dataset, TEXT_DATASETS)):
        if value in text:
            raise PlanInputError(
                field,
                f"{value!r}: kfac-hpc plan does not model the transformer workload yet; "
                "plan an image or mnist1d workload, or measure gpt with kfac-hpc sweep",
            )
