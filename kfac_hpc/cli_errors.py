"""How every ``kfac-hpc`` command family ends on an error: one line on stderr, one exit code.

Bad input (:class:`~kfac_hpc.contracts.errors.InputError` and its subclasses) exits 2 having
written nothing; a failing outside command (a scheduler's) exits 1.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.exit_codes import ExitCode

__all__ = ["exit_with", "guard"]

F = TypeVar("F", bound=Callable[..., Any])


def exit_with(command: str, message: str, code: ExitCode) -> NoReturn:
    """Print ``kfac-hpc COMMAND: MESSAGE`` on stderr and exit with ``code``."""
    click.echo(f"kfac-hpc {command}: {message}", err=True)
    sys.exit(int(code))


def guard(command: str, failures: tuple[tuple[type[Exception], str], ...] = ()) -> Callable[[F], F]:
    """Decorate a command's body: InputError -> ``error: ...``, exit 2; an exception of
    ``failures`` (type, label) -> ``LABEL: ...``, exit 1."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except InputError as exc:
                exit_with(command, f"error: {exc}", ExitCode.BAD_INPUT)
            except Exception as exc:
                for kind, label in failures:
                    if isinstance(exc, kind):
                        exit_with(command, f"{label}: {exc}", ExitCode.FAILED)
                raise

        return wrapper  # type: ignore[return-value]

    return decorate
