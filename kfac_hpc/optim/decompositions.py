"""Second-order data of a layer (eigendecompositions or damped inverses) and preconditioning.

Eigen method: A = Q_A diag(d_A) Q_Aᵀ, G = Q_G diag(d_G) Q_Gᵀ and

    V = Q_G [(Q_Gᵀ ∇W Q_A) ⊘ (d_G d_Aᵀ + λ)] Q_Aᵀ  =  (G ⊗ A + λ I)⁻¹ vec(∇W)  exactly.

Inverse method (factored, π-corrected damping):
π = sqrt((tr A / n_A) / (tr G / n_G)), λ_A = π √λ, λ_G = √λ / π and
V = (G + λ_G I)⁻¹ ∇W (A + λ_A I)⁻¹.

Decompositions are robust: ``eigh``/``inv`` in the requested dtype, then in float64, then in
float64 with a jitter of 1e-6·(tr/n)·I (×10 twice more); if all fail the caller keeps the previous
result and warns once per layer. Grouped layers carry a leading group dimension throughout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_hpc.optim.finite import all_finite

__all__ = [
    "EigenFactor",
    "InverseFactor",
    "decompose",
    "eigen_outer",
    "invert",
    "pi_split",
    "precondition_eigen",
    "precondition_inverse",
]

_JITTERS = (1e-6, 1e-5, 1e-4)


@dataclass
class EigenFactor:
    """Eigenvectors Q (n, n) and eigenvalues d (n,), clamped at 0 (factors are PSD). Q keeps
    the column-major layout ``eigh`` returns (no copy; broadcasts and checkpoints pack it)."""

    Q: Tensor
    d: Tensor

    def tensors(self) -> list[Tensor]:
        """The tensors in state order (the order of their state keys)."""
        return [self.Q, self.d]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.tensors())


@dataclass
class InverseFactor:
    """The damped inverse (F + λ_F I)⁻¹ (n, n) of one factor, in the layout ``inv`` returns."""

    inv: Tensor

    def tensors(self) -> list[Tensor]:
        """The tensors in state order (the order of their state keys)."""
        return [self.inv]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.tensors())


def _jittered(matrix: Tensor, scale: float) -> Tensor:
    n = matrix.shape[-1]
    mean_diag = matrix.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).abs().clamp_min(1e-30)
    eye = torch.eye(n, dtype=matrix.dtype, device=matrix.device)
    return matrix + (scale * mean_diag).unsqueeze(-1) * eye


def _attempts(matrix: Tensor, dtype: torch.dtype) -> Iterator[Tensor]:
    """The ladder of matrices to try: as asked, float64, float64 with growing jitter. Lazy:
    the float64 copies are made only when the try before them failed (almost never)."""
    yield matrix.to(dtype)
    wide = matrix.to(torch.float64)
    if dtype != torch.float64:
        yield wide
    for scale in _JITTERS:
        yield _jittered(wide, scale)


def decompose(matrix: Tensor, dtype: torch.dtype) -> EigenFactor | None:
    """Eigendecomposition in ``dtype`` down the fallback ladder; None when every try failed."""
    if not all_finite([matrix]):
        return None  # eigh of a non-finite matrix is undefined: it may even look fine
    for attempt in _attempts(matrix, dtype):
        try:
            d, q = torch.linalg.eigh(attempt)
        except RuntimeError:
            continue
        if all_finite([d, q]):
            return EigenFactor(q.to(dtype), d.clamp_min(0).to(dtype))
    return None


def pi_split(a: Tensor, g: Tensor, damping: float) -> tuple[Tensor, Tensor]:
    """π-corrected damping (λ_A, λ_G), shaped to broadcast over a leading group dimension."""
    tr_a = a.diagonal(dim1=-2, dim2=-1).mean(-1)
    tr_g = g.diagonal(dim1=-2, dim2=-1).mean(-1)
    pi = torch.sqrt(tr_a / tr_g)
    pi = torch.where(torch.isfinite(pi) & (pi > 0), pi, torch.ones_like(pi))
    root = damping**0.5
    return pi * root, root / pi


def invert(matrix: Tensor, damping: Tensor, dtype: torch.dtype) -> InverseFactor | None:
    """(matrix + damping·I)⁻¹ in ``dtype`` down the fallback ladder; None when all failed."""
    if not all_finite([matrix, damping]):
        return None
    eye = torch.eye(matrix.shape[-1], dtype=torch.float64, device=matrix.device)
    damped = matrix.to(torch.float64) + damping.to(torch.float64)[..., None, None] * eye
    for attempt in _attempts(damped, dtype):
        try:
            inv = torch.linalg.inv(attempt)
        except RuntimeError:
            continue
        if all_finite([inv]):
            return InverseFactor(inv.to(dtype))
    return None


def eigen_outer(d_a: Tensor, d_g: Tensor, damping: float) -> Tensor:
    """1 / (d_G d_Aᵀ + λ), shape (groups?, n_G, n_A)."""
    return (d_g.unsqueeze(-1) * d_a.unsqueeze(-2) + damping).reciprocal()


def precondition_eigen(
    grad: Tensor, a: EigenFactor, g: EigenFactor, damping: float, outer: Tensor | None
) -> Tensor:
    """(G ⊗ A + λI)⁻¹ vec(grad) via the eigenbases; ``outer`` if precomputed."""
    dtype = a.Q.dtype
    rotated = g.Q.mT @ grad.to(dtype) @ a.Q
    scale = outer if outer is not None else eigen_outer(a.d, g.d, damping)
    return (g.Q @ (rotated * scale) @ a.Q.mT).to(grad.dtype)


def precondition_inverse(grad: Tensor, a: InverseFactor, g: InverseFactor) -> Tensor:
    """(G + λ_G I)⁻¹ grad (A + λ_A I)⁻¹."""
    return (g.inv @ grad.to(a.inv.dtype) @ a.inv).to(grad.dtype)
