"""The named choices of the library's options, defined once: the enums the K-FAC code works
with (``KFACPreconditioner(compute_method=...)``) are the allowed values of the job's options
(``kfac-hpc train --compute-method``), which the option table lists from them.

Torch-free: the K-FAC code (optim/, comm/) imports these, never the reverse.
"""

from __future__ import annotations

import enum

__all__ = [
    "HVP_MODES",
    "LANCZOS_DTYPES",
    "REORTHOGONALIZATIONS",
    "AssignmentStrategy",
    "ComputeMethod",
    "DampingMode",
    "DistributionStrategy",
    "KFACApprox",
    "values",
]


class ComputeMethod(enum.Enum):
    """How the second-order data of a layer is computed."""

    EIGEN = "eigen"
    INVERSE = "inverse"


class DampingMode(enum.Enum):
    """How the inverse method damps A and G: ``pi_split`` (λ_A = π√λ, λ_G = √λ/π, the
    Martens & Grosse π correction) or ``per_factor`` (λ added to each factor, the reference
    library's convention)."""

    PI_SPLIT = "pi_split"
    PER_FACTOR = "per_factor"


class KFACApprox(enum.Enum):
    """How weight sharing (convolutions, Linear layers with extra leading dimensions) enters
    the factors: every location a row (expand), or one row per sample (reduce)."""

    EXPAND = "expand"
    REDUCE = "reduce"


class AssignmentStrategy(enum.Enum):
    """What the LPT schedule balances: eigen/inverse time (n³) or memory held (n²)."""

    COMPUTE = "compute"
    MEMORY = "memory"

    def cost(self, n: int) -> float:
        """Cost of the second-order work on one n×n factor."""
        return float(n) ** 3 if self is AssignmentStrategy.COMPUTE else float(n) ** 2


class DistributionStrategy(enum.Enum):
    """The KAISA strategy a grad-worker fraction amounts to; the values are the strategy names
    ``grad_worker_fraction`` accepts."""

    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    HYBRID_OPT = "hybrid-opt"


# FOSI's Hessian-vector-product routes (a string option of FOSI: optim/fosi/hvp.py).
HVP_MODES: tuple[str, ...] = ("auto", "forward-over-reverse", "double-backward")
# The dtype of FOSI's Lanczos basis and Ritz vectors: float64, or the parameters' own ("training";
# the tridiagonal matrix and its eigenproblem stay float64 either way: optim/fosi/lanczos.py).
LANCZOS_DTYPES: tuple[str, ...] = ("float64", "training")
# How FOSI's Lanczos keeps its basis orthogonal: at every step, or only where an estimate of the
# basis' inner products says it is needed (optim/fosi/lanczos.py).
REORTHOGONALIZATIONS: tuple[str, ...] = ("full", "partial")


def values(choices: type[enum.Enum]) -> tuple[str, ...]:
    """The allowed values of an option whose choices are ``choices``, in definition order."""
    return tuple(str(member.value) for member in choices)
