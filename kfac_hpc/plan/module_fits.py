"""Forward and backward prices of a model's own modules, by module kind.

Each kind's seconds are ``per_call + flops · s_per_flop + elements · s_per_element`` in the
forward and again in the backward, over the whole local batch: ``flops`` the multiply-adds ×2
of a convolution's or linear layer's weight product (0 for the others), ``elements`` the
module's input plus output elements. The call term is dispatch and launch cost, the FLOP term
the arithmetic, the element term the memory traffic: what makes a 1 → 16 channel convolution
run several times below the FLOP rate of a 32 → 32 one of the same FLOPs, and what a
FLOP-free module (normalization, activation, pooling) costs. ``plan calibrate`` fits the
coefficients to real modules timed on the device (layer_rates.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MODULE_KINDS", "ModuleFit", "fit_module"]

# the kinds a profile may price (kfac_hpc.plan.layers.module_kind sorts modules into them)
MODULE_KINDS = (
    "conv",
    "linear",
    "batchnorm",
    "layernorm",
    "activation",
    "pool",
    "adaptive_pool",
    "view",
)

Coefficients = tuple[float, float, float]  # seconds per call, per FLOP, per element
ModulePoint = tuple[float, float, float, float]  # FLOPs, elements, forward s, backward s


@dataclass(frozen=True)
class ModuleFit:
    """One kind's coefficients, forward and backward (each >= 0)."""

    forward: Coefficients
    backward: Coefficients

    def seconds(self, flops: float, elements: float) -> tuple[float, float]:
        """(forward s, backward s) of one call over ``flops`` and ``elements``."""
        return tuple(  # type: ignore[return-value]
            c[0] + flops * c[1] + elements * c[2] for c in (self.forward, self.backward)
        )

    def row(self) -> list[float]:
        """The six numbers a profile holds for the kind."""
        return [*self.forward, *self.backward]


def _nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> Coefficients:
    """Coefficients >= 0 that minimize the relative residuals (each point's error over its
    own seconds, so a 10 µs point counts as much as a 10 ms one): the best unconstrained
    least-squares fit over every subset of the three terms whose coefficients are all >= 0
    (exact non-negative least squares for three unknowns)."""
    weighted = features / seconds[:, None]
    target = np.ones_like(seconds)
    best: tuple[float, np.ndarray] | None = None
    for size in (1, 2, 3):
        for subset in itertools.combinations(range(3), size):
            columns = weighted[:, subset]
            if not np.any(columns):
                continue
            solution = np.linalg.lstsq(columns, target, rcond=None)[0]
            if np.any(solution < 0):
                continue
            residual = float(np.sum((columns @ solution - target) ** 2))
            if best is None or residual < best[0]:
                full = np.zeros(3)
                full[list(subset)] = solution
                best = (residual, full)
    if best is None:  # no term explains any point (all features 0): the mean as a call cost
        return float(seconds.mean()), 0.0, 0.0
    return float(best[1][0]), float(best[1][1]), float(best[1][2])


def fit_module(points: Sequence[ModulePoint]) -> ModuleFit:
    """The kind's coefficients fitted to ``points`` (FLOPs, elements, forward s, backward s;
    at least one, all seconds > 0)."""
    data = np.array(points, dtype=float)
    features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    return ModuleFit(_nonnegative_fit(features, data[:, 2]), _nonnegative_fit(features, data[:, 3]))
