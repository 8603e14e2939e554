"""Extreme-spectrum estimation (ESE): Lanczos with full reorthogonalization, sharded basis.

The basis ``Q`` (m × n) is kept in float64 and sharded over coordinates like everything else
(:class:`~kfac_hpc.optim.fosi.sharding.CoordinateShard`): each rank holds ``Q[:, start:stop]``.
A dot product is a local dot product plus an allreduce of one number; reorthogonalizing against
the ``j`` vectors so far is a local ``(j × n_r) @ (n_r,)`` plus an allreduce of ``j`` numbers
after the three-term recurrence (classical Gram-Schmidt, repeated once when the pass cancelled
much of the vector: the DGKS criterion, which keeps the basis orthogonal to rounding at about
half the cost of always passing twice). The tridiagonal matrix is the same on every rank; its
eigenpairs give the Ritz values and, with the local basis, each rank's slice of the Ritz
vectors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kfac_hpc.optim.fosi.sharding import CoordinateShard

__all__ = ["ExtremeSpectrum", "lanczos_extremes"]

# A Krylov space is exhausted (invariant) when the new residual is this small relative to the
# largest Ritz value so far: the next vector would be rounding noise.
_BREAKDOWN = 1e-10
# A reorthogonalization pass that keeps more than this fraction of the norm left the vector
# orthogonal to the basis to rounding; otherwise it is repeated once.
_DGKS = 0.5**0.5


@dataclass(frozen=True)
class ExtremeSpectrum:
    """The ``k`` largest and ``l`` smallest Ritz pairs.

    ``eigenvalues``: float64 ``(k + l,)``, largest first; ``vectors``: float64
    ``(k + l, n_r)``, this rank's coordinates of the orthonormal eigenvectors (same order);
    ``iterations``: Lanczos steps taken (fewer than asked when the Krylov space is exhausted);
    ``basis_bytes``: bytes of this rank's Lanczos basis.
    """

    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    iterations: int
    basis_bytes: int


def _dot(shard: CoordinateShard, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """⟨a, b⟩ over all coordinates (one allreduced number)."""
    return shard.allreduce((a * b).sum().reshape(1))[0]


def _start_vector(shard: CoordinateShard, seed: int) -> torch.Tensor:
    """This rank's slice of one random unit vector of ``n`` coordinates, the same for every
    world size (drawn whole from ``seed``, then sliced)."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shard.n, generator=gen, dtype=torch.float64)
    return shard.local(full / full.norm()).clone()


def lanczos_extremes(
    hvp: Callable[[torch.Tensor], torch.Tensor],
    shard: CoordinateShard,
    k: int,
    l: int,  # noqa: E741 (the paper's name)
    iterations: int,
    seed: int,
) -> ExtremeSpectrum:
    """Lanczos on the symmetric operator ``hvp`` (local float64 ``(n_r,)`` slice in, the same
    slice of ``H v`` out; it may communicate) for ``iterations`` steps.

    Needs ``k + l <= iterations <= n``.
    """
    m = iterations
    basis = torch.zeros(m, shard.size, dtype=torch.float64)
    alphas = torch.zeros(m, dtype=torch.float64)
    betas = torch.zeros(m, dtype=torch.float64)
    q = _start_vector(shard, seed)
    steps = m
    for j in range(m):
        basis[j] = q
        w = hvp(q)
        alphas[j] = _dot(shard, w, q)
        w -= alphas[j] * q  # the three-term recurrence first (O(n) per rank) ...
        if j > 0:
            w -= betas[j - 1] * basis[j - 1]
        norm = _dot(shard, w, w).sqrt()
        for _ in range(2):  # ... then full reorthogonalization, repeated when it removed much
            coeffs = shard.allreduce(basis[: j + 1] @ w)
            w -= coeffs @ basis[: j + 1]
            beta = _dot(shard, w, w).sqrt()
            if beta > _DGKS * norm:  # Daniel-Gragg-Kaufman-Stewart: orthogonal to rounding
                break
            norm = beta
        scale = max(alphas[: j + 1].abs().max().item(), 1.0)
        if j == m - 1 or beta.item() <= _BREAKDOWN * scale:
            steps = j + 1
            break
        betas[j] = beta
        q = w / beta
    tri = torch.diag(alphas[:steps])
    off = betas[: steps - 1]
    tri += torch.diag(off, 1) + torch.diag(off, -1)
    ritz, rotation = torch.linalg.eigh(tri)  # ascending
    take = min(k, steps)
    low = min(l, steps - take)
    index = torch.cat(
        [torch.arange(steps - 1, steps - 1 - take, -1), torch.arange(low - 1, -1, -1)]
    )
    vectors = rotation[:, index].T @ basis[:steps]
    return ExtremeSpectrum(
        ritz[index].clone(), vectors, steps, basis.element_size() * basis.numel()
    )
