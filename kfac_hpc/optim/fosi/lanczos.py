"""Extreme-spectrum estimation (ESE): Lanczos with full or partial reorthogonalization,
sharded basis.

The basis ``Q`` (m × n) is kept in float64 (or the training dtype: ``dtype``) and sharded over
coordinates like everything else
(:class:`~kfac_hpc.optim.fosi.sharding.CoordinateShard`): each rank holds ``Q[:, start:stop]``.
A dot product is a local dot product plus an allreduce of one number; reorthogonalizing against
the ``j`` vectors so far is a local ``(j × n_r) @ (n_r,)`` plus an allreduce of ``j`` numbers
after the three-term recurrence (classical Gram-Schmidt, repeated once when the pass cancelled
much of the vector: the DGKS criterion, which keeps the basis orthogonal to rounding at about
half the cost of always passing twice). The tridiagonal matrix is the same on every rank; its
eigenpairs (float64) give the Ritz values and, with the local basis, each rank's slice of the
Ritz vectors.

Reorthogonalization (``reorthogonalize``): ``"full"`` passes at every step, reading the whole
basis once or twice per step, which dominates the ESE on large models. ``"partial"`` keeps the
basis semi-orthogonal instead (every ``|q_i · q_j|`` below √ε, ε the unit roundoff of the
basis' dtype), which is enough for the tridiagonal matrix to be the projection of H to working
accuracy, so the Ritz values are as accurate as with full reorthogonalization (Simon, 1984). It
estimates the inner products of the new vector with the basis by a recurrence on the Lanczos
coefficients alone (:class:`_OrthogonalityEstimate`: O(j) numbers a step, no reads of the basis,
the same on every rank) and passes, at that step and the next, only when an estimate exceeds
√ε: a few passes in a run where the wanted pairs converge, none before.

Breakdown: when the residual is rounding noise relative to the largest ``|H q|`` seen (the
Krylov space is invariant: H has fewer distinct eigenvalues than the steps asked, or the start
vector lies in an invariant subspace), Lanczos stops and returns the Ritz pairs of the space it
has, which are exact eigenpairs then. A product ``H q`` that is not finite (NaN or inf, e.g.
parameters that diverged) raises :class:`NonFiniteCurvature` on every rank alike (the check is
on allreduced numbers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kfac_hpc.contracts.choices import REORTHOGONALIZATIONS
from kfac_hpc.optim.fosi.sharding import CoordinateShard

__all__ = [
    "ExtremeSpectrum",
    "NonFiniteCurvature",
    "converged_pairs",
    "lanczos_extremes",
    "tridiagonal_eigh",
    "warm_start_vector",
]

# A Krylov space is exhausted (invariant) when the new residual is this small relative to the
# largest |H q| so far (an estimate of |H|): the next vector would be rounding noise.
_BREAKDOWN = 1e-10
# A reorthogonalization pass that keeps more than this fraction of the norm left the vector
# orthogonal to the basis to rounding; otherwise it is repeated once.
_DGKS = 0.5**0.5
# The norm of the seeded random component of a warm start vector (the previous Ritz vectors'
# normalized sum has norm 1): enough that no eigendirection is missing from the start.
WARM_NOISE = 0.1
# Coordinates per block of a narrow-dtype squared norm (_local_norm2): each block's norm rounds
# at about ε, and the float64 sum of their squares adds nothing (measured: 1e-9 relative at
# n = 2.1 M in float32, against 5e-8 for the cascaded sum of the squares and 3e-6 for ``dot``).
_BLOCK = 1024
# The random start vector is drawn in chunks of this many coordinates, each by its own
# generator (_random_slice): a rank draws about its own slice, whatever the world size.
_CHUNK = 1 << 16
# Chunk c of seed s is drawn from seed s + c × this (mod 2⁶⁴; the golden-ratio increment of
# SplitMix64). torch's CPU generator (MT19937) keeps the seed's low 32 bits, which then differ
# for every pair (seed, chunk) with chunks below 2¹⁷ and seeds less than 12 553 apart.
_WEYL = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class ExtremeSpectrum:
    """The ``k`` largest and ``l`` smallest Ritz pairs.

    ``eigenvalues``: float64 ``(k + l,)``, largest first; ``vectors``: the basis' dtype
    ``(k + l, n_r)``, this rank's coordinates of the orthonormal eigenvectors (same order);
    ``iterations``: Lanczos steps taken (fewer than asked when the Krylov space is exhausted);
    ``basis_bytes``: bytes of this rank's Lanczos basis; ``residuals``: float64 ``(k + l,)``,
    ‖H v − λ v‖ of each pair (|β_m| times the last coordinate of its eigenvector of the
    tridiagonal matrix: exact with a fully reorthogonalized basis, no extra product); ``top``:
    how many of the pairs are of the largest (the rest are of the smallest);
    ``reorthogonalized``: the Lanczos steps whose new vector was reorthogonalized against the
    basis (every step with ``"full"``).
    """

    eigenvalues: torch.Tensor
    vectors: torch.Tensor
    iterations: int
    basis_bytes: int
    residuals: torch.Tensor
    top: int
    reorthogonalized: int


class NonFiniteCurvature(ArithmeticError):
    """A Hessian-vector product of the ESE is NaN or inf (on some rank). ``step``: the
    optimizer step of the ESE (None when unknown); ``diverged``: the parameters or the loss
    were already non-finite (training diverged), not only their curvature; ``in_gradient``: it
    was the step's gradient that was non-finite (found at that step, outside any ESE)."""

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        diverged: bool = False,
        in_gradient: bool = False,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.diverged = diverged
        self.in_gradient = in_gradient


def _local_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """This rank's part of ⟨a, b⟩, float64: BLAS ``dot`` in float64 (one pass, no temporary);
    in a narrower dtype the product's cascaded sum, which rounds less than a narrow ``dot``
    (whose error grows with n: 50 ε of ⟨q, Hq⟩ at n = 2.1 M when q is near an eigenvector)."""
    return torch.dot(a, b) if a.dtype == torch.float64 else (a * b).sum().to(torch.float64)


def _local_norm2(a: torch.Tensor) -> torch.Tensor:
    """This rank's part of ‖a‖², float64, in one read of ``a`` and no n-sized temporary: BLAS
    ``dot`` in float64; in a narrower dtype the norms of blocks of :data:`_BLOCK` coordinates
    (short enough to round at ε), their squares summed in float64."""
    if a.dtype == torch.float64:
        return torch.dot(a, a)
    head = a.numel() - a.numel() % _BLOCK
    blocks = torch.linalg.vector_norm(a[:head].view(-1, _BLOCK), dim=1).to(torch.float64)
    tail = a[head:].to(torch.float64)
    return torch.dot(blocks, blocks) + torch.dot(tail, tail)


def _norm(shard: CoordinateShard, a: torch.Tensor) -> torch.Tensor:
    """‖a‖ over all coordinates (float64; one allreduced number)."""
    return shard.allreduce(_local_norm2(a).reshape(1))[0].sqrt()


def _random_slice(shard: CoordinateShard, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's coordinates of one standard normal vector of ``n`` coordinates in ``dtype``,
    the same for every world size: the vector is cut into chunks of :data:`_CHUNK` coordinates,
    chunk ``c`` drawn whole by its own generator seeded ``seed + c`` × :data:`_WEYL` (mod
    2⁶⁴), so a rank draws only the chunks its slice meets. Chunk 0's seed is ``seed``: a vector
    of at most :data:`_CHUNK` coordinates is ``torch.randn(n)`` of that seed."""
    start, stop = shard.start, shard.stop
    pieces = []
    for chunk in range(start // _CHUNK, -(-stop // _CHUNK)):
        low, high = chunk * _CHUNK, min((chunk + 1) * _CHUNK, shard.n)
        gen = torch.Generator().manual_seed((seed + chunk * _WEYL) % 2**64)
        drawn = torch.randn(high - low, generator=gen, dtype=dtype)
        pieces.append(drawn[max(start, low) - low : min(stop, high) - low])
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)


def _start_vector(shard: CoordinateShard, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slice of one random unit vector of ``n`` coordinates in ``dtype``, the same
    for every world size (:func:`_random_slice`, normalized by its allreduced norm)."""
    drawn = _random_slice(shard, seed, dtype)
    return drawn.div_(_norm(shard, drawn).to(dtype))


def warm_start_vector(
    shard: CoordinateShard,
    previous: torch.Tensor,
    seed: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """This rank's slice (in ``dtype``, the basis') of the unit vector along the normalized sum
    of the rows of ``previous`` (the last ESE's Ritz vectors, ``(K, n_r)``) plus
    :data:`WARM_NOISE` times the seeded random start vector, so that no direction is deficient."""
    total = previous.sum(dim=0).to(dtype)  # summed in V's dtype: one n-vector cast
    total.div_(_norm(shard, total).to(dtype))
    q = total.add_(_start_vector(shard, seed, dtype), alpha=WARM_NOISE)
    return q.div_(_norm(shard, q).to(dtype))


def tridiagonal_eigh(
    diagonal: torch.Tensor, off: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (ascending, float64 ``(s,)``) and orthonormal eigenvectors (columns,
    ``(s, s)``) of the symmetric tridiagonal matrix with this ``diagonal`` and ``off``-diagonal.

    ``torch.linalg.eigh`` in float64; should LAPACK's divide and conquer not converge, the same
    pairs from the SVD of the matrix shifted to positive definite (T + c I, c = 1 + the
    Gershgorin bound: its singular values are λ + c, its singular vectors T's eigenvectors).
    """
    tri = torch.diag(diagonal.to(torch.float64))
    off = off.to(torch.float64)
    tri += torch.diag(off, 1) + torch.diag(off, -1)
    try:
        values, vectors = torch.linalg.eigh(tri)
    except torch.linalg.LinAlgError:
        shift = 1.0 + float(tri.abs().sum(dim=1).max())
        eye = torch.eye(len(tri), dtype=tri.dtype)
        left, singular, _ = torch.linalg.svd(tri + shift * eye)
        values, vectors = (singular - shift).flip(0), left.flip(1)
    return values, vectors


def _extreme_index(steps: int, k: int, l: int) -> tuple[torch.Tensor, int]:  # noqa: E741
    """Indices of the k largest (largest first) and l smallest (largest first) of ``steps``
    ascending Ritz values, and how many of them are of the largest."""
    take = min(k, steps)
    low = min(l, steps - take)
    top = torch.arange(steps - 1, steps - 1 - take, -1)
    return torch.cat([top, torch.arange(low - 1, -1, -1)]), take


def _converged(
    diagonal: torch.Tensor,
    off: torch.Tensor,
    beta: float,
    k: int,
    l: int,  # noqa: E741 (the paper's name)
    tol: float,
) -> bool:
    """Whether the k largest and l smallest Ritz pairs of this tridiagonal matrix, with β the
    norm of the next residual, all have ‖Hv − λv‖ ≤ tol × max |λ|."""
    ritz, rotation = tridiagonal_eigh(diagonal, off)
    index, _ = _extreme_index(len(diagonal), k, l)
    residuals = beta * rotation[-1, index].abs()
    return bool((residuals <= tol * float(ritz.abs().max())).all())


class _OrthogonalityEstimate:
    """Estimates ω_{j+1,i} ≈ q_{j+1} · q_i of the next Lanczos vector against the basis, from
    the coefficients alone (Simon's recurrence, from H q_i = β_i q_{i+1} + α_i q_i +
    β_{i-1} q_{i-1} written for i and j and the symmetry of H):

        β_j ω_{j+1,i} = β_i ω_{j,i+1} + (α_i − α_j) ω_{j,i} + β_{i-1} ω_{j,i-1} − β_{j-1} ω_{j-1,i}

    plus, with the sign of the sum, the rounding a step adds (2 ε ‖H‖, ‖H‖ estimated by the
    largest ``|H q|`` so far); ``ω_{j+1,j}`` is the three-term recurrence's own rounding,
    ε ‖H‖ / β_j, and ``ω_{j,j} = 1``. Float64 numbers, identical on every rank."""

    def __init__(self, steps: int, unit_roundoff: float) -> None:
        self.eps = unit_roundoff
        self.previous = torch.zeros(steps + 1, dtype=torch.float64)  # ω_{j-1, ·}
        self.current = torch.zeros(steps + 1, dtype=torch.float64)  # ω_{j, ·}
        self.current[0] = 1.0

    def advance(self, j: int, alphas: torch.Tensor, betas: torch.Tensor, beta: float,
                scale: float) -> float:  # fmt: skip
        """ω_{j+1, 0..j} from step ``j``'s coefficients (``betas[:j]`` and the new ``beta``
        = β_j); returns the largest |ω_{j+1,i}| for i < j (i = j is local, always small)."""
        new = torch.zeros_like(self.current)
        if j > 0:
            lower = torch.cat([torch.zeros(1, dtype=torch.float64), betas[: j - 1]])  # β_{i-1}
            left = torch.cat([torch.zeros(1, dtype=torch.float64), self.current[: j - 1]])
            total = (
                betas[:j] * self.current[1 : j + 1]
                + (alphas[:j] - alphas[j]) * self.current[:j]
                + lower * left
                - betas[j - 1] * self.previous[:j]
            )
            noise = 2 * self.eps * scale
            new[:j] = (total + torch.where(total >= 0, noise, -noise)) / beta
        new[j] = self.eps * scale / beta
        new[j + 1] = 1.0
        self.previous, self.current = self.current, new
        return float(new[:j].abs().max()) if j > 0 else 0.0

    def reset(self, j: int) -> None:
        """The vector ``q_{j+1}`` was just reorthogonalized: orthogonal to rounding."""
        self.current[: j + 1] = self.eps


def _reorthogonalize(shard: CoordinateShard, basis: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w`` made orthogonal to the rows of ``basis`` (in place; classical Gram-Schmidt,
    repeated once when the pass removed much: DGKS); returns its new norm."""
    norm = _norm(shard, w)
    for _ in range(2):
        coeffs = shard.allreduce(basis @ w)
        w -= coeffs @ basis
        beta = _norm(shard, w)
        if beta > _DGKS * norm:  # Daniel-Gragg-Kaufman-Stewart: orthogonal to rounding
            break
        norm = beta
    return beta


def lanczos_extremes(
    hvp: Callable[[torch.Tensor], torch.Tensor],
    shard: CoordinateShard,
    k: int,
    l: int,  # noqa: E741 (the paper's name)
    iterations: int,
    seed: int,
    stop_tol: float | None = None,
    start: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    reorthogonalize: str = "full",
    product_dtype: torch.dtype | None = None,
    basis: torch.Tensor | None = None,
) -> ExtremeSpectrum:
    """Lanczos on the symmetric operator ``hvp`` (local float64 ``(n_r,)`` slice in, the same
    slice of ``H v`` out; it may communicate) for ``iterations`` steps, or fewer with
    ``stop_tol``: stopped at the first step where all k + l wanted Ritz pairs have residuals
    ‖Hv − λv‖ ≤ ``stop_tol`` × max |λ| (checked on the tridiagonal matrix, the same on every
    rank). ``start``: this rank's slice of a unit start vector (:func:`warm_start_vector`);
    None: the random one of ``seed``. ``dtype``: of the basis, the vectors ``hvp`` takes and
    returns, and the Ritz vectors (float32 halves the bytes the reorthogonalization reads); the
    recurrence's coefficients, the tridiagonal matrix and its eigenproblem are float64 always.
    ``reorthogonalize``: ``"full"`` or ``"partial"`` (module docstring); ``product_dtype``: the
    dtype ``hvp`` computes in, when narrower than the basis (its rounding is what the partial
    scheme's estimates must follow; None: the basis' dtype). ``basis``: an ``(iterations,
    n_r)`` tensor of ``dtype`` to hold the basis (its rows are overwritten), which a caller
    keeps between runs so that its pages are not touched for the first time at every run (a
    fresh basis of hundreds of MB is page-faulted in row by row); None: a new one.

    Needs ``k + l <= iterations <= n``. Raises :class:`NonFiniteCurvature` when a product is
    not finite.
    """
    if reorthogonalize not in REORTHOGONALIZATIONS:
        raise ValueError(
            f"reorthogonalize={reorthogonalize!r} is invalid: use one of "
            + ", ".join(REORTHOGONALIZATIONS)
        )
    m = iterations
    if basis is None:
        basis = torch.empty(m, shard.size, dtype=dtype)  # a row is written before it is read
    elif basis.shape != (m, shard.size) or basis.dtype != dtype:
        raise ValueError(
            f"basis of shape {tuple(basis.shape)} and {basis.dtype} is invalid: use "
            f"({m}, {shard.size}) and {dtype}"
        )
    alphas = torch.zeros(m, dtype=torch.float64)
    betas = torch.zeros(m, dtype=torch.float64)
    basis[0] = _start_vector(shard, seed, dtype) if start is None else start
    eps = torch.finfo(dtype).eps / 2  # unit roundoff
    # a residual below this fraction of |H| is rounding noise of the basis' dtype
    breakdown = max(_BREAKDOWN, 200 * eps)
    # the basis loses orthogonality at the rounding of the products or of the basis, the larger
    rounding = max(eps, torch.finfo(product_dtype or dtype).eps / 2)
    estimate = _OrthogonalityEstimate(m, rounding) if reorthogonalize == "partial" else None
    steps = m
    last_beta = 0.0  # β_m: the norm of the residual left after the last step
    scale = 0.0  # the largest |H q| so far
    passes = 0  # steps whose new vector was reorthogonalized
    again = False  # partial: the previous step passed, so this one does too
    for j in range(m):
        q = basis[j]
        w = hvp(q)
        if w.data_ptr() == q.data_ptr():  # an operator may hand back its input
            w = w.clone()
        sums = shard.allreduce(torch.stack([_local_dot(w, q), _local_norm2(w)]))  # ⟨Hq,q⟩, |Hq|²
        alphas[j] = sums[0]
        length = sums[1].sqrt().item()
        if not (alphas[j].isfinite().item() and math.isfinite(length)):
            raise NonFiniteCurvature(
                f"Lanczos step {j + 1}: the Hessian-vector product is not finite (NaN or inf)"
            )
        scale = max(scale, length)
        w.add_(q, alpha=-alphas[j].item())  # the three-term recurrence first (O(n)) ...
        if j > 0:
            w.add_(basis[j - 1], alpha=-betas[j - 1].item())
        if estimate is None:  # ... then full reorthogonalization ...
            beta = _reorthogonalize(shard, basis[: j + 1], w)
            passes += 1
        else:  # ... or only where the estimates say the basis is losing orthogonality
            beta = _norm(shard, w)
            lost = beta.item() > 0 and (
                estimate.advance(j, alphas, betas, beta.item(), scale) > math.sqrt(rounding)
            )
            if again or lost:
                beta = _reorthogonalize(shard, basis[: j + 1], w)
                estimate.reset(j)
                passes += 1
            again = lost
        converged = False
        if stop_tol is not None and j + 1 >= k + l:
            mine = _converged(alphas[: j + 1], betas[:j], float(beta), k, l, stop_tol)
            # one decision for every rank (allreduced numbers need not agree to the last bit)
            converged = bool(shard.allreduce(torch.tensor([float(mine)], dtype=torch.float64)))
        if j == m - 1 or converged or beta.item() <= breakdown * scale:
            steps = j + 1
            last_beta = float(beta) if beta.item() > breakdown * scale else 0.0
            break
        betas[j] = beta
        torch.div(w, beta, out=basis[j + 1])
    ritz, rotation = tridiagonal_eigh(alphas[:steps], betas[: steps - 1])
    index, take = _extreme_index(steps, k, l)
    vectors = rotation[:, index].T.to(dtype) @ basis[:steps]
    residuals = last_beta * rotation[steps - 1, index].abs()
    return ExtremeSpectrum(
        ritz[index].clone(),
        vectors,
        steps,
        basis.element_size() * basis.numel(),
        residuals,
        take,
        passes,
    )


def converged_pairs(spectrum: ExtremeSpectrum, tol: float) -> ExtremeSpectrum:
    """The pairs of ``spectrum`` whose residual ‖H v − λ v‖ is at most ``tol`` × max |λ| (the
    others have not converged: their λ is not an eigenvalue of H to that accuracy, nor their
    v an eigenvector), in the same order."""
    values = spectrum.eigenvalues
    bound = tol * float(values.abs().max()) if values.numel() else 0.0
    keep = spectrum.residuals <= bound
    return ExtremeSpectrum(
        values[keep].clone(),
        spectrum.vectors[keep].contiguous(),
        spectrum.iterations,
        spectrum.basis_bytes,
        spectrum.residuals[keep].clone(),
        int(keep[: spectrum.top].sum()),
        spectrum.reorthogonalized,
    )
