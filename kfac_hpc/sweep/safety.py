"""Every user-provided string that reaches a shell script passes through here.

Two policies: *identifiers* (names, partitions, accounts, env var names) are validated against
a strict pattern; *free values* (paths, train arguments, env values, sbatch arguments) are
single-line strings that the templates only ever emit through :func:`shlex.quote`. Setup lines
of a site profile are shell by design (``module load ...``); they must still be one line.
"""

from __future__ import annotations

import re
import shlex

from kfac_hpc.sweep.errors import SweepInputError

__all__ = ["check_identifier", "check_line", "check_slurm_time", "quote"]

_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# D-HH:MM:SS, D-HH:MM, D-HH, HH:MM:SS, MM:SS, MM (Slurm's --time formats)
_SLURM_TIME = re.compile(r"(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_line(field: str, value: str) -> str:
    """A single-line string without control characters (newlines end a shell command)."""
    if not isinstance(value, str):
        raise SweepInputError(field, f"expected a string, got {value!r}")
    if _CONTROL.search(value):
        raise SweepInputError(field, f"{value!r} contains a newline or control character")
    return value


def check_identifier(field: str, value: str, *, env_name: bool = False) -> str:
    """A name safe to write unquoted (letters, digits, ``_.+-``; env names: ``[A-Za-z_]\\w*``)."""
    check_line(field, value)
    pattern = _ENV_NAME if env_name else _IDENTIFIER
    if not pattern.fullmatch(value):
        allowed = "[A-Za-z_][A-Za-z0-9_]*" if env_name else "letters, digits and _ . + -"
        raise SweepInputError(field, f"{value!r} is not a valid name (allowed: {allowed})")
    return value


def check_slurm_time(field: str, value: str) -> str:
    """A Slurm time limit such as ``30``, ``00:30:00`` or ``1-12:00:00``."""
    check_line(field, value)
    if not _SLURM_TIME.fullmatch(value):
        raise SweepInputError(field, f"{value!r} is not a Slurm time (e.g. 00:30:00 or 1-00:00:00)")
    return value


def quote(value: object) -> str:
    """Shell-quote a value for a rendered script (Jinja2 filter ``q``)."""
    return shlex.quote(str(value))
