"""The one error type for bad ``kfac-hpc plan`` input: it names the field and the fix."""

from __future__ import annotations

__all__ = ["PlanInputError"]


class PlanInputError(ValueError):
    """Bad user input. The CLI prints ``field: message`` on one line and exits 2."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
