"""The α-β (latency-bandwidth) model of the collectives K-FAC uses, and its least-squares fit.

A collective of ``n`` bytes over ``P`` ranks costs ``α·a(P) + β·n·b(P)`` seconds, with the
step counts of the algorithms NCCL and gloo use for large messages:

- allreduce, ring:             a = 2(P-1),      b = 2(P-1)/P
- broadcast / reduce, binomial tree: a = ⌈log₂P⌉, b = ⌈log₂P⌉

``α`` is seconds per message, ``β`` seconds per byte (1 / bandwidth). Fitting both to measured
timings is a linear least-squares problem in (α, β).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["COLLECTIVES", "AlphaBeta", "fit_alpha_beta", "step_counts"]

COLLECTIVES = ("allreduce", "broadcast", "reduce")


def step_counts(collective: str, ranks: int) -> tuple[float, float]:
    """(latency steps a(P), bandwidth factor b(P)) of one collective; zero at P = 1."""
    if ranks <= 1:
        return 0.0, 0.0
    if collective == "allreduce":
        return 2.0 * (ranks - 1), 2.0 * (ranks - 1) / ranks
    if collective in ("broadcast", "reduce"):
        depth = float(math.ceil(math.log2(ranks)))
        return depth, depth
    raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")


@dataclass(frozen=True)
class AlphaBeta:
    """One link class: ``alpha_s`` per message (s), ``beta_s_per_byte`` per byte (s/B)."""

    alpha_s: float
    beta_s_per_byte: float

    def time_s(self, collective: str, nbytes: float, ranks: int) -> float:
        """Predicted seconds of one collective of ``nbytes`` over ``ranks`` ranks."""
        a, b = step_counts(collective, ranks)
        return a * self.alpha_s + b * nbytes * self.beta_s_per_byte

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> AlphaBeta:
    """Least-squares (α, β) ≥ 0 from ``(collective, ranks, nbytes, seconds)`` samples.

    Rows are weighted by 1/seconds so that small, latency-bound messages count as much as
    large ones (relative error is what a prediction is judged by).
    """
    rows, times = [], []
    for collective, ranks, nbytes, seconds in samples:
        a, b = step_counts(collective, ranks)
        if a == 0 or seconds <= 0:
            continue
        rows.append((a / seconds, b * nbytes / seconds))
        times.append(1.0)
    if len(rows) < 2:
        raise ValueError("need timings of at least two collectives with P >= 2 to fit alpha, beta")
    matrix, target = np.asarray(rows), np.asarray(times)
    (alpha, beta), *_ = np.linalg.lstsq(matrix, target, rcond=None)
    if alpha < 0 or beta < 0:  # clamp one and refit the other (both ≥ 0 physically)
        col = 1 if alpha < 0 else 0
        only = matrix[:, col]
        value = float(only @ target / (only @ only))
        alpha, beta = (0.0, value) if col == 1 else (value, 0.0)
    return AlphaBeta(float(alpha), float(beta))
