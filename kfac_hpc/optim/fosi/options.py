"""The options of FOSI / DHO2, validated once when the optimizer is built.

Every invalid value raises ``ValueError`` naming the option, the value and the valid range.
Only what is mathematically invalid (a wrong type, NaN, a negative count, ...) is refused here;
the bounds against nonsense (``--fosi-k 2147483647``) are the job's (contracts/options.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from kfac_hpc.contracts.option_values import valid_range, validity_problem
from kfac_hpc.contracts.options import LIBRARY_PARAMETERS, OPTIONS, library_default
from kfac_hpc.optim.fosi.hvp import HvpMode

__all__ = ["FOSIOptions", "lanczos_basis_dtype", "lanczos_steps"]

# FOSI's parameter -> the job's option (contracts/options.py): its default, kind, choices and
# valid range are the table's.
_OPTION_OF = LIBRARY_PARAMETERS["fosi"]
_DEFAULT: dict[str, Any] = {param: library_default(name) for param, name in _OPTION_OF.items()}


def lanczos_steps(k: int, l: int, lanczos_iters: int | None) -> int:  # noqa: E741
    """The Lanczos steps m an ESE asks for: ``lanczos_iters``, or 4(k + l) when None (before
    capping at the parameter count)."""
    return lanczos_iters if lanczos_iters is not None else 4 * (k + l)


def lanczos_basis_dtype(lanczos_dtype: str, training: torch.dtype) -> torch.dtype:
    """The dtype of the Lanczos basis and Ritz vectors for ``lanczos_dtype`` (a choice of
    ``--fosi-lanczos-dtype``): float64, or ``training``, the parameters' dtype."""
    return training if lanczos_dtype == "training" else torch.float64


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"FOSI option {name}={value!r} is invalid: use {want}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_table(name: str, value: object) -> None:
    """ValueError unless ``value`` of FOSI's parameter ``name`` has its job option's kind,
    choices and valid range (contracts/options.py); not the job's operational bounds."""
    option = OPTIONS[_OPTION_OF[name]]
    if value is None and option.optional:
        return
    if option.choices:
        _check(value in option.choices, name, value, f"one of {', '.join(option.choices)}")
        return
    if option.kind == "bool":
        _check(isinstance(value, bool), name, value, "True or False")
        return
    integer = option.kind == "int"
    kind_ok = _is_int(value) if integer else _is_finite(value)
    words = valid_range(option) or "a finite number"
    if integer:
        words = words.replace("a finite number", "an integer").replace("a number", "an integer")
    ok = kind_ok and validity_problem(option, cast(float, value)) is None
    _check(ok, name, value, words + (" or None" if option.optional else ""))


@dataclass(frozen=True)
class FOSIOptions:
    """``k`` largest and ``l`` smallest eigenpairs; ``alpha``: Newton step size in the
    subspace; ``momentum``: EMA factor of the subspace velocity; an ESE every ``ese_every``
    steps from step ``warmup`` on, with ``lanczos_iters`` (default 4(k + l)) Lanczos steps;
    ``clip``: bound of the base-update scale λ_max/λ_k (SGD-family bases); ``hvp``: autodiff
    route; ``seed``: of the Lanczos start vectors; ``average_gradients``: FOSI averages the
    gradients over ranks itself (False when DDP already did); ``curvature_ranks``: ranks given to
    ESE only (0: every rank does both); ``max_staleness``: steps a pipelined ESE may lag (0:
    the training ranks wait for it; more: they never wait, and take the base update alone
    while an ESE is later than that).
    ``lanczos_tol``: Lanczos stops once the k + l wanted pairs have residuals ≤ lanczos_tol ×
    max|λ| (None: all steps). ``curvature_fraction``: below 1, the closure is called as
    ``closure(curvature_fraction)`` and returns the loss of that share of its batch
    (curvature_batch.py), which the ESE's products differentiate. ``warm_start``: Lanczos
    starts from the previous ESE's V (lanczos.warm_start_vector) when this rank holds one.
    The safeguards: ``residual_tol``: a Ritz pair is kept only when
    ‖Hv − λv‖ ≤ residual_tol × max|λ|; ``ese_check``: after an ESE, the base update alone
    until the next ESE when the new subspace step raises the curvature batch's loss;
    ``nonfinite_stop``: a non-finite gradient raises at once (``NonFiniteCurvature``).
    ``adaptive_ese``: the steps between ESEs follow how far the subspace moved between the last
    two (``ese_interval.py``; not with ``curvature_ranks``). ``lanczos_dtype``: the Lanczos
    basis and Ritz vectors in float64 or in the parameters' dtype ("training").
    ``reorthogonalize``: "full" (every Lanczos step) or "partial" (only where the basis drifts
    from orthogonal: lanczos.py). ``keep_basis``: the Lanczos basis stays allocated between
    ESEs (reused, not page-faulted in anew; resident memory is the price).

    The defaults and valid ranges of the options the job has too are its option table's
    (contracts/options.py, ``LIBRARY_PARAMETERS``)."""

    k: int = _DEFAULT["k"]
    l: int = _DEFAULT["l"]  # noqa: E741 (the paper's name)
    alpha: float = _DEFAULT["alpha"]
    momentum: float = _DEFAULT["momentum"]
    ese_every: int = _DEFAULT["ese_every"]
    warmup: int = _DEFAULT["warmup"]
    lanczos_iters: int | None = _DEFAULT["lanczos_iters"]
    clip: float = _DEFAULT["clip"]
    hvp: HvpMode = _DEFAULT["hvp"]
    seed: int = _DEFAULT["seed"]
    average_gradients: bool = True
    curvature_ranks: int = _DEFAULT["curvature_ranks"]
    max_staleness: int = _DEFAULT["max_staleness"]
    lanczos_tol: float | None = _DEFAULT["lanczos_tol"]
    curvature_fraction: float = _DEFAULT["curvature_fraction"]
    warm_start: bool = _DEFAULT["warm_start"]
    residual_tol: float = _DEFAULT["residual_tol"]
    ese_check: bool = _DEFAULT["ese_check"]
    nonfinite_stop: bool = _DEFAULT["nonfinite_stop"]
    adaptive_ese: bool = _DEFAULT["adaptive_ese"]
    lanczos_dtype: str = _DEFAULT["lanczos_dtype"]
    reorthogonalize: str = _DEFAULT["reorthogonalize"]
    keep_basis: bool = _DEFAULT["keep_basis"]

    def __post_init__(self) -> None:
        for name in ("k", "l", "alpha", "momentum", "ese_every", "warmup", "lanczos_iters"):
            _check_table(name, getattr(self, name))
        # the relations between options, which no single option's range holds
        _check(self.k + self.l >= 1, "k", self.k, "k + l >= 1")
        iters = self.lanczos_iters
        _check(iters is None or iters >= self.k + self.l, "lanczos_iters", iters,
               f"None or an integer >= k + l = {self.k + self.l}")  # fmt: skip
        for name in ("clip", "hvp", "curvature_ranks", "max_staleness", "lanczos_tol",
                     "curvature_fraction", "warm_start", "residual_tol", "ese_check",
                     "nonfinite_stop", "adaptive_ese", "lanczos_dtype",
                     "reorthogonalize", "keep_basis"):  # fmt: skip
            _check_table(name, getattr(self, name))
        _check(not (self.adaptive_ese and self.curvature_ranks), "adaptive_ese",
               self.adaptive_ese, "False with curvature_ranks > 0 (the pipelined schedule is "
               "fixed)")  # fmt: skip
        # any integer seeds the Lanczos start vectors (the job's seed >= 0 is the job's bound)
        _check(_is_int(self.seed), "seed", self.seed, "an integer")
        _check(isinstance(self.average_gradients, bool), "average_gradients",
               self.average_gradients, "True or False")  # fmt: skip
        _check(self.max_staleness < self.ese_every, "max_staleness", self.max_staleness,
               "an integer in [0, ese_every)")  # fmt: skip

    @property
    def iterations(self) -> int:
        """Lanczos steps m (before capping at the parameter count)."""
        return lanczos_steps(self.k, self.l, self.lanczos_iters)
