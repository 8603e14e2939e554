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

__all__ = [
    "TIME_FORMS",
    "check_identifier",
    "check_line",
    "check_slurm_time",
    "quote",
    "slurm_time_seconds",
]

_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# D-HH:MM:SS, D-HH:MM, D-HH, HH:MM:SS, MM:SS, MM (Slurm's --time formats)
_SLURM_TIME = re.compile(
    r"(?:(\d{1,5})-(\d{1,2})(?::(\d{2}))?(?::(\d{2}))?|(\d{1,7})(?::(\d{2}))?(?::(\d{2}))?)"
)
TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
MAX_TIME_S = 365 * 86400  # a year: no partition runs one job longer
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


def slurm_time_seconds(value: str) -> int | None:
    """Seconds of a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``);
    None when ``value`` is not one, or its minutes or seconds are not below 60."""
    found = _SLURM_TIME.fullmatch(value)
    if found is None:
        return None
    days, d_hours, d_minutes, d_seconds, first, second, third = found.groups()
    if days is not None:
        hours, minutes, seconds = int(d_hours), int(d_minutes or 0), int(d_seconds or 0)
        minutes_checked = d_minutes
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = int(first), int(second), int(third)
        minutes_checked = second
    else:  # MM or MM:SS: the minutes may be any count
        hours, minutes, seconds = 0, int(first), int(second or 0)
        minutes_checked = None
    if seconds >= 60 or (minutes_checked is not None and minutes >= 60):
        return None
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_slurm_time(field: str, value: str) -> str:
    """A Slurm time limit such as ``30``, ``00:30:00`` or ``1-12:00:00``, above zero."""
    check_line(field, value)
    seconds = slurm_time_seconds(value)
    flag = "--time" if field == "time" else field
    if seconds is None:
        raise SweepInputError(
            field,
            f"{value!r} is not a Slurm time limit; give {flag} as {TIME_FORMS} "
            "(minutes and seconds below 60), e.g. 00:30:00",
        )
    if not 0 < seconds <= MAX_TIME_S:
        raise SweepInputError(
            field,
            f"{value!r} must be above 0 and at most 365 days; give {flag} as {TIME_FORMS}, "
            "e.g. 00:30:00",
        )
    return value


def quote(value: object) -> str:
    """Shell-quote a value for a rendered script (Jinja2 filter ``q``)."""
    return shlex.quote(str(value))
