"""The options of FOSI / DHO2, validated once when the optimizer is built.

Every invalid value raises ``ValueError`` naming the option, the value and the valid range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kfac_hpc.optim.fosi.hvp import HVP_MODES, HvpMode

__all__ = ["FOSIOptions"]


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"FOSI option {name}={value!r} is invalid: use {want}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class FOSIOptions:
    """``k`` largest and ``l`` smallest eigenpairs; ``alpha``: Newton step size in the
    subspace; ``momentum``: EMA factor of the subspace velocity; an ESE every ``ese_every``
    steps from step ``warmup`` on, with ``lanczos_iters`` (default 4(k + l)) Lanczos steps;
    ``clip``: bound of the base-update scale λ_max/λ_k (SGD-family bases); ``hvp``: autodiff
    route; ``seed``: of the Lanczos start vectors; ``average_gradients``: FOSI averages the
    gradients over ranks itself (False when DDP already did); ``curvature_ranks``: ranks given to
    ESE only (0: every rank does both); ``max_staleness``: steps a pipelined ESE may lag."""

    k: int = 10
    l: int = 0  # noqa: E741 (the paper's name)
    alpha: float = 0.01
    momentum: float = 0.9
    ese_every: int = 100
    warmup: int = 20
    lanczos_iters: int | None = None
    clip: float = 3.0
    hvp: HvpMode = "auto"
    seed: int = 0
    average_gradients: bool = True
    curvature_ranks: int = 0
    max_staleness: int = 0

    def __post_init__(self) -> None:
        _check(_is_int(self.k) and self.k >= 0, "k", self.k, "an integer >= 0")
        _check(_is_int(self.l) and self.l >= 0, "l", self.l, "an integer >= 0")
        _check(self.k + self.l >= 1, "k", self.k, "k + l >= 1")
        _check(math.isfinite(self.alpha) and self.alpha > 0, "alpha", self.alpha, "a number > 0")
        _check(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        _check(_is_int(self.ese_every) and self.ese_every >= 1, "ese_every", self.ese_every,
               "an integer >= 1")  # fmt: skip
        _check(_is_int(self.warmup) and self.warmup >= 0, "warmup", self.warmup, "an integer >= 0")
        iters = self.lanczos_iters
        _check(iters is None or (_is_int(iters) and iters >= self.k + self.l), "lanczos_iters",
               iters, f"None or an integer >= k + l = {self.k + self.l}")  # fmt: skip
        _check(math.isfinite(self.clip) and self.clip >= 1, "clip", self.clip, "a number >= 1")
        _check(self.hvp in HVP_MODES, "hvp", self.hvp, f"one of {', '.join(HVP_MODES)}")
        _check(_is_int(self.seed), "seed", self.seed, "an integer")
        _check(isinstance(self.average_gradients, bool), "average_gradients",
               self.average_gradients, "True or False")  # fmt: skip
        _check(_is_int(self.curvature_ranks) and self.curvature_ranks >= 0, "curvature_ranks",
               self.curvature_ranks, "an integer >= 0")  # fmt: skip
        _check(_is_int(self.max_staleness) and 0 <= self.max_staleness < self.ese_every,
               "max_staleness", self.max_staleness, "an integer in [0, ese_every)")  # fmt: skip

    @property
    def iterations(self) -> int:
        """Lanczos steps m (before capping at the parameter count)."""
        return self.lanczos_iters if self.lanczos_iters is not None else 4 * (self.k + self.l)
