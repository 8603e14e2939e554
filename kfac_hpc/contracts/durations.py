"""Durations as users write them: ``90``, ``90s``, ``30m``, ``2h``, ``1d`` or Slurm's
``[D-]HH:MM:SS``."""

from __future__ import annotations

import re

from kfac_hpc.contracts.errors import InputError

__all__ = ["parse_duration_s"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*$", re.ASCII)
_CLOCK = re.compile(r"^\s*(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)\s*$", re.ASCII)
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str | float, name: str) -> float:
    """Seconds of a duration; InputError naming ``name`` when ``text`` is not one."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    match = _DURATION.match(str(text))
    if match:
        return float(match.group(1)) * _UNIT_S[match.group(2)]
    clock = _CLOCK.match(str(text))
    if clock:
        days, hours, minutes, seconds = (int(g) if g else 0 for g in clock.groups())
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    raise InputError(name, f"{text!r} is not a duration; write e.g. 90s, 30m, 2h or 01:30:00")
