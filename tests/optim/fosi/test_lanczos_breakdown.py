"""ESE where it used to fail: an exhausted Krylov space, tiny curvature, a non-finite HVP, and
a tridiagonal eigenproblem LAPACK does not solve.

Oracle: dense float64 ``torch.linalg.eigh`` of the matrix itself. With repeated eigenvalues the
eigenvectors are not unique, so a pair is checked by its residual ‖A v − λ v‖ (≤ 1e-10 · ‖A‖)
and the vectors by orthonormality (1e-12); eigenvalues agree to 1e-10 relative.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc.optim.fosi import FOSI, NonFiniteCurvature
from kfac_hpc.optim.fosi.lanczos import lanczos_extremes, tridiagonal_eigh
from kfac_hpc.optim.fosi.sharding import CoordinateShard

N = 80


def with_spectrum(spectrum: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen, dtype=torch.float64))
    return q @ torch.diag(spectrum) @ q.T


def check_extremes(values: torch.Tensor, vectors: torch.Tensor, matrix: torch.Tensor, k: int,
                   l: int) -> None:  # noqa: E741  # fmt: skip
    mu = torch.linalg.eigvalsh(matrix)  # ascending, the independent computation
    expected = torch.cat([mu.flip(0)[:k], mu[:l].flip(0)])
    torch.testing.assert_close(values, expected, rtol=1e-10, atol=0)
    norm = mu.abs().max()
    residual = (vectors @ matrix - values[:, None] * vectors).norm(dim=1)
    assert residual.max() <= 1e-10 * norm, residual
    gram = vectors @ vectors.T
    torch.testing.assert_close(gram, torch.eye(k + l, dtype=torch.float64), rtol=0, atol=1e-12)


def test_breakdown_with_fewer_distinct_eigenvalues_than_steps() -> None:
    """Four distinct eigenvalues, three of them repeated: the Krylov space is exhausted after
    4 of the 20 steps asked; Lanczos stops there and its Ritz pairs are the exact extremes."""
    spectrum = torch.tensor([9.0] + [2.0] * 39 + [-1.0] * 39 + [-6.0], dtype=torch.float64)
    matrix = with_spectrum(spectrum)
    result = lanczos_extremes(lambda v: matrix @ v, CoordinateShard(N, 1, 0), 2, 2, 20, 0)
    assert result.iterations == 4
    check_extremes(result.eigenvalues, result.vectors, matrix, 2, 2)


def test_breakdown_is_relative_to_the_operator_scale() -> None:
    """A Hessian of scale 1e-12 is not mistaken for an exhausted Krylov space."""
    gen = torch.Generator().manual_seed(8)
    bulk = torch.rand(N - 3, generator=gen, dtype=torch.float64)
    spectrum = 1e-12 * torch.cat([torch.tensor([40.0, 20.0, -10.0], dtype=torch.float64), bulk])
    matrix = with_spectrum(spectrum)
    result = lanczos_extremes(lambda v: matrix @ v, CoordinateShard(N, 1, 0), 2, 1, 12, 0)
    assert result.iterations == 12
    torch.testing.assert_close(result.eigenvalues, spectrum[[0, 1, 2]], rtol=1e-7, atol=0)


def test_zero_hessian_gives_zero_eigenvalues() -> None:
    result = lanczos_extremes(torch.zeros_like, CoordinateShard(N, 1, 0), 2, 0, 8, 0)
    assert result.iterations == 1
    assert torch.equal(result.eigenvalues, torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_hvp_raises_a_named_error(bad: float) -> None:
    matrix = with_spectrum(torch.linspace(-1, 1, N, dtype=torch.float64))
    calls = []

    def hvp(v: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        out = matrix @ v
        if len(calls) == 3:
            out[5] = bad
        return out

    with pytest.raises(NonFiniteCurvature, match=r"Lanczos step 3: .* not finite"):
        lanczos_extremes(hvp, CoordinateShard(N, 1, 0), 2, 0, 8, 0)


def test_fosi_names_divergence_instead_of_a_linalg_error() -> None:
    """Parameters that went NaN (training diverged) make the ESE's HVPs NaN: FOSI raises
    NonFiniteCurvature naming the step and the cause, not LinAlgError from eigh (with the
    gradient check off: it would stop the step first, test_safeguards.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = FOSI(model.parameters(), base, k=2, warmup=1, nonfinite_stop=False)

    def closure() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    closure().backward()
    opt.step(closure)  # step 0: no ESE yet
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    model.zero_grad()
    closure().backward()
    with pytest.raises(NonFiniteCurvature, match=r"ESE at step 1: .*training diverged"):
        opt.step(closure)


def test_tridiagonal_fallback_when_lapack_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SVD path gives the pairs dense eigh gives (distinct and repeated eigenvalues)."""
    gen = torch.Generator().manual_seed(9)
    diagonal = torch.randn(12, generator=gen, dtype=torch.float64)
    off = torch.randn(11, generator=gen, dtype=torch.float64)
    diagonal[6:], off[6:], off[5] = diagonal[:6], off[:5], 0.0  # two equal blocks:
    # every eigenvalue twice
    dense = torch.diag(diagonal) + torch.diag(off, 1) + torch.diag(off, -1)
    expected = torch.linalg.eigvalsh(dense)
    torch.testing.assert_close(expected[0::2], expected[1::2], rtol=0, atol=1e-12)

    def failing(*args: object, **kwargs: object) -> None:
        raise torch.linalg.LinAlgError("linalg.eigh: failed to converge (error code: 19)")

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    values, vectors = tridiagonal_eigh(diagonal, off)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(dense @ vectors, vectors * values, rtol=0, atol=1e-12)
    torch.testing.assert_close(vectors.T @ vectors, torch.eye(12, dtype=torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip
