"""Small statistics on plain lists (no numpy: collecting 1,000 runs must stay fast)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    The same definition as ``numpy.percentile``'s default ("linear", Hyndman-Fan type 7).
    """
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    """:func:`percentile` of ``values`` at each of ``qs``, sorting once."""
    if not values:
        return [None for _ in qs]
    ordered = sorted(values)
    out: list[float | None] = []
    for q in qs:
        position = (len(ordered) - 1) * q / 100.0
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return out


def median(values: Sequence[float]) -> float | None:
    """The median, None for no values."""
    return percentile(values, 50.0)


def weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float | None:
    """``sum(v * w) / sum(w)``; None when there are no values or the weights sum to zero."""
    total = sum(weights)
    if not values or total <= 0:
        return None
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total


def relative_spread(values: Sequence[float]) -> float | None:
    """``(max - min) / mean``: 0 when all values agree; None for no values or a zero mean."""
    if not values:
        return None
    mean = sum(values) / len(values)
    return (max(values) - min(values)) / mean if mean > 0 else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
