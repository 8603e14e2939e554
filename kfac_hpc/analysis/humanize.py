"""Numbers and column titles for people: 3 significant digits in the unit that fits.

The machine-readable tables keep SI base units in their column names (``_s``, ``_fraction``);
the report shows ``forward (ms)`` with ``84.3``, never ``8.43e-02``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Time units, largest first: (name, seconds per unit).
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))


def sig3(value: float) -> str:
    """``value`` with 3 significant digits, in plain notation (``1,230``, ``84.3``,
    ``0.00512``); integers of 4+ digits get thousands separators and no decimals."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    magnitude = math.floor(math.log10(abs(value)))
    rounded = round(value, 2 - magnitude)
    magnitude = math.floor(math.log10(abs(rounded))) if rounded else magnitude
    if magnitude >= 2:
        return f"{rounded:,.0f}"
    return f"{rounded:.{2 - magnitude}f}"


def axis_number(value: float) -> str:
    """A tick label: ``950``, ``2.5k``, ``128k``, ``1.5M``, ``0.25``: at most 3 significant
    digits, thousands as ``k``, millions as ``M``; never ``131072`` nor e-notation."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{float(f'{value / scale:.3g}'):g}{suffix}"
    if value and abs(value) < 1e-3:
        return sig3(value)
    return f"{float(f'{value:.3g}'):g}"


def time_unit(values: Iterable[float | None]) -> tuple[str, float]:
    """The unit (name, seconds per unit) in which the median of ``values`` is at least 1."""
    present = sorted(abs(v) for v in values if v)
    if not present:
        return TIME_UNITS[0]
    middle = present[len(present) // 2]
    return next(((n, f) for n, f in TIME_UNITS if middle >= f), TIME_UNITS[-1])


@dataclass(frozen=True)
class Column:
    """A column for people: the row key, its title, and its kind: ``text``, ``count``,
    ``time`` (seconds in the data, shown in the fitting unit), ``percent`` (a fraction in the
    data), ``rate`` (samples/s), ``ratio`` (dimensionless, e.g. speedup), ``accuracy`` (a
    fraction, shown in %) or ``number`` (3 significant digits, no unit)."""

    key: str
    title: str
    kind: str = "text"


def _cell(value: Any, kind: str, scale: float) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if kind == "text" or isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if kind == "count":
        return f"{value:,.0f}" if float(value).is_integer() else sig3(float(value))
    if kind == "time":
        return sig3(value / scale)
    if kind in ("percent", "accuracy"):
        return sig3(100 * value)
    if kind == "ratio":
        return sig3(value) + "×"
    return sig3(float(value))


def render_columns(
    rows: Sequence[dict[str, Any]], columns: Sequence[Column]
) -> tuple[list[str], list[list[str]]]:
    """(titles with units, cell texts) of ``rows``: each time column in its own unit."""
    titles, scales = [], []
    for column in columns:
        scale, unit = 1.0, ""
        if column.kind == "time":
            name, scale = time_unit(r.get(column.key) for r in rows)
            unit = name
        elif column.kind in ("percent", "accuracy"):
            unit = "%"
        elif column.kind == "rate":
            unit = "samples/s"
        titles.append(f"{column.title} ({unit})" if unit else column.title)
        scales.append(scale)
    cells = [
        [_cell(r.get(c.key), c.kind, scale) for c, scale in zip(columns, scales, strict=True)]
        for r in rows
    ]
    return titles, cells
