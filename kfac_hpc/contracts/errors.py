"""The one error type for bad user input, shared by every command family (its subclasses,
``ConfigError``, ``SweepInputError``, ``PlanInputError``, only name where it came from); every
command ends on it by the one exit path, kfac_hpc/cli_errors.py."""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Bad user input; ``str()`` is one line naming the field and the fix. Every command
    prints it and exits with ``ExitCode.BAD_INPUT`` having written nothing."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.field = name
        self.reason = message
        self.message = message
