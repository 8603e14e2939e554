"""Values of the job's options: from TOML, JSON or command-line text to the option's kind,
checked against its choices and range; the aliases expanded into the fields they set."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from kfac_hpc.contracts.durations import parse_duration_s
from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.grad_workers import check_grad_worker_fraction
from kfac_hpc.contracts.options import Option

__all__ = [
    "FLOAT_MAX",
    "INT_MAX",
    "check_value",
    "coerce_value",
    "expand_aliases",
    "range_problem",
    "valid_range",
    "validity_problem",
]

# The largest value of an integer option without its own ``maximum`` (32-bit signed: steps,
# sizes and counts are stored in int32/int64 tensors and HDF5 attributes).
INT_MAX = 2**31 - 1
# The largest value of a float option without its own ``maximum`` (far past any real setting,
# far below where products with it overflow).
FLOAT_MAX = 1e12

# Range checks of numbers: accept, and the valid range in words.
_RANGES = {
    "positive": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
    "nonnegative": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "decay": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "at_least_one": (lambda v: math.isfinite(v) and v >= 1, "a finite number >= 1"),
}


def coerce_value(option: Option, value: Any, *, text: bool = False) -> Any:
    """``value`` (TOML, JSON or, with ``text``, a command-line string) as the option's kind;
    InputError naming the option when it is not one."""
    if value is None and option.optional:
        return None
    kind, ok = option.kind, False
    if kind == "bool":
        if text and isinstance(value, str):
            value = {
                "true": True,
                "1": True,
                "yes": True,
                "on": True,
                "false": False,
                "0": False,
                "no": False,
                "off": False,
            }.get(value.strip().lower(), value)
        ok = isinstance(value, bool)
    elif kind in ("int", "float"):
        if text and isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = int(value) if kind == "int" else float(value)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if kind == "int":
            ok = ok and (isinstance(value, int) or (math.isfinite(value) and value.is_integer()))
            value = int(value) if ok else value
        else:
            value = float(value) if ok else value
    elif kind == "str":
        if option.check == "grad_workers" and isinstance(value, int | float):
            value, ok = str(float(value)), not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
    else:
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        try:
            cast = int if kind == "ints" else str
            ok = isinstance(value, list | tuple) and all(
                isinstance(v, int | str) and not isinstance(v, bool) for v in value
            )
            value = tuple(cast(v) for v in value) if ok else value
        except (TypeError, ValueError):
            ok = False
    if not ok:
        described = {"strs": "list of str", "ints": "list of int"}.get(kind, kind)
        raise InputError(option.name, f"{value!r} is not a {described}")
    return value


def valid_range(option: Option) -> str:
    """The option's mathematically valid range in words (``a finite number > 0``), or ""."""
    if option.check and option.check != "grad_workers":
        return _RANGES[option.check][1]
    return ""


def validity_problem(option: Option, value: float) -> str | None:
    """The option's mathematically valid range in words (its ``check``: > 0, in [0, 1), ...)
    when ``value`` is outside it, else None. The library (``KFACPreconditioner``) checks only
    this; the job adds the operational bound (:func:`range_problem`)."""
    if option.check and option.check != "grad_workers":
        accept, valid = _RANGES[option.check]
        if not accept(value):
            return valid
    return None


def range_problem(option: Option, value: float) -> str | None:
    """The option's range in words when ``value`` (a number of the option's kind) is outside
    it, else None: its validity (:func:`validity_problem`) and its operational bound (its
    ``maximum``, else INT_MAX / FLOAT_MAX). What ``kfac-hpc train`` and ``sweep`` accept."""
    problem = validity_problem(option, value)
    if problem is not None:
        return problem
    limit = option.maximum
    if limit is None:
        limit = INT_MAX if option.kind in ("int", "ints") else FLOAT_MAX
    if limit is not None and not value <= limit:
        shown = int(limit) if float(limit).is_integer() else limit
        return f"at most {shown}"
    return None


def check_value(option: Option, value: Any) -> None:
    """InputError when a value of the right kind is out of the option's choices or range."""
    if value is None:
        return
    if option.choices and value not in option.choices:
        raise InputError(option.name, f"{value!r} is not one of {', '.join(option.choices)}")
    if option.check == "grad_workers":
        try:
            check_grad_worker_fraction(value)
        except ValueError as exc:
            raise InputError(option.name, str(exc)) from None
    elif option.kind in ("int", "float", "ints"):
        for item in value if isinstance(value, tuple) else (value,):
            problem = range_problem(option, item)
            if problem is not None:
                raise InputError(option.name, f"{item!r} must be {problem}")


def expand_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``time_limit`` and ``checkpoint_every`` turned into the fields they set
    (``checkpoint_every``: an integer is steps, a duration is minutes); InputError if bad."""
    out = dict(raw)
    if "time_limit" in out:
        out["time_limit_s"] = parse_duration_s(out.pop("time_limit"), "time_limit")
    if "checkpoint_every" in out:
        text = str(out.pop("checkpoint_every")).strip()
        out.pop("checkpoint_every_steps", None)
        out.pop("checkpoint_every_min", None)
        if text.isascii() and text.isdigit():
            out["checkpoint_every_steps"] = int(text)
        else:
            out["checkpoint_every_min"] = parse_duration_s(text, "checkpoint_every") / 60.0
    return out
