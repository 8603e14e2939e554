"""How every ``kfac-hpc`` command ends on an error: one line on stderr, one exit code. The one
exit path of every command (train, sweep, status, resume, cancel, plan, collect, report,
checkpoint, doctor): nothing else calls ``sys.exit`` with ``ExitCode.BAD_INPUT``.

Bad input (:class:`~kfac_hpc.contracts.errors.InputError` and its subclasses, and click's own
flag-parsing errors) is ``kfac-hpc COMMAND: error: FIELD: reason`` and exit 2, having written
nothing; a failing outside command (a scheduler's) exits 1.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.exit_codes import ExitCode

__all__ = ["bad_input", "exit_with", "guard", "usage_error"]

F = TypeVar("F", bound=Callable[..., Any])


def exit_with(command: str, message: str, code: ExitCode) -> NoReturn:
    """Print ``kfac-hpc COMMAND: MESSAGE`` on stderr and exit with ``code``."""
    click.echo(f"kfac-hpc {command}: {message}", err=True)
    sys.exit(int(code))


def bad_input(command: str, field: str, reason: str, *, quiet: bool = False) -> NoReturn:
    """Exit 2 with ``kfac-hpc COMMAND: error: FIELD: reason`` (one line), or silently with
    ``quiet`` (a rank of a multi-rank job whose peer prints the line)."""
    if quiet:
        sys.exit(int(ExitCode.BAD_INPUT))
    exit_with(command, f"error: {field}: {' '.join(str(reason).split())}", ExitCode.BAD_INPUT)


def guard(command: str, failures: tuple[tuple[type[Exception], str], ...] = ()) -> Callable[[F], F]:
    """Decorate a command's body: InputError -> ``error: FIELD: reason``, exit 2; an exception
    of ``failures`` (type, label) -> ``LABEL: ...``, exit 1."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except InputError as exc:
                bad_input(command, exc.field, exc.reason)
            except Exception as exc:
                for kind, label in failures:
                    if isinstance(exc, kind):
                        exit_with(command, f"{label}: {exc}", ExitCode.FAILED)
                raise

        return wrapper  # type: ignore[return-value]

    return decorate


def usage_error(command: str, exc: click.UsageError) -> NoReturn:
    """Exit 2 with click's flag-parsing error as one line: ``error: --flag: reason`` (a bad
    value, a missing value or argument, an unknown flag), else ``error: MESSAGE``."""
    field, reason = "", exc.format_message()
    if isinstance(exc, click.NoSuchOption):
        field, reason = exc.option_name, "no such option"
        if exc.possibilities:
            reason += f"; did you mean {', '.join(sorted(exc.possibilities))}?"
    elif isinstance(exc, click.BadOptionUsage):
        field, reason = exc.option_name, exc.message
    elif isinstance(exc, click.MissingParameter) and exc.param is not None:
        field, reason = _field(exc.param), "missing"
    elif isinstance(exc, click.BadParameter) and exc.param is not None:
        field, reason = _field(exc.param), exc.message
    text = " ".join(str(reason).split())
    exit_with(command, f"error: {field}: {text}" if field else f"error: {text}", ExitCode.BAD_INPUT)


def _field(param: click.Parameter) -> str:
    """How a user wrote ``param``: its longest flag, or an argument's metavar."""
    if isinstance(param, click.Option) and param.opts:
        return max(param.opts, key=len)
    return param.human_readable_name
