"""ESE recovers the extreme eigenpairs; it sees weight decay; it leaves BatchNorm alone.

Oracle: quadratics ½θᵀAθ with A = Q diag(μ) Qᵀ built from a known spectrum μ and a random
orthogonal Q (float64), and ``torch.linalg.eigh`` of A. Eigenvalues agree to 1e-7 relative,
eigenvectors to 1e-4 (|⟨v, q⟩| = 1 up to the sign; the error of a Ritz vector is about the
square root of its Ritz value's), orthonormal to 1e-12; the extremes are separated from the
bulk so that 4(k + l) Lanczos steps converge (worst observed: 5e-9 for k = l = 1, m = 8).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.fosi.lanczos import lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard

N = 60


def quadratic(spectrum: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen, dtype=torch.float64))
    return q @ torch.diag(spectrum) @ q.T


def known_spectrum() -> torch.Tensor:
    gen = torch.Generator().manual_seed(4)
    bulk = torch.rand(N - 5, generator=gen, dtype=torch.float64)  # in [0, 1)
    return torch.cat([torch.tensor([50.0, 20.0, 10.0, -4.0, -8.0], dtype=torch.float64), bulk])


def check_pairs(values: torch.Tensor, vectors: torch.Tensor, matrix: torch.Tensor, k: int,
                l: int) -> None:  # noqa: E741  # fmt: skip
    mu, q = torch.linalg.eigh(matrix)  # ascending
    index = torch.cat([torch.arange(N - 1, N - 1 - k, -1), torch.arange(l - 1, -1, -1)])
    torch.testing.assert_close(values, mu[index], rtol=1e-7, atol=0)
    overlap = (vectors @ q[:, index]).diagonal().abs()
    torch.testing.assert_close(overlap, torch.ones(k + l, dtype=torch.float64), rtol=0, atol=1e-4)
    gram = vectors @ vectors.T
    torch.testing.assert_close(gram, torch.eye(k + l, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("k", "l"), [(3, 0), (3, 2), (1, 1)])
def test_lanczos_recovers_k_largest_and_l_smallest(k: int, l: int) -> None:  # noqa: E741
    matrix = quadratic(known_spectrum())
    result = lanczos_extremes(lambda v: matrix @ v, CoordinateShard(N, 1, 0), k, l, 4 * (k + l), 0)
    check_pairs(result.eigenvalues, result.vectors, matrix, k, l)
    assert result.basis_bytes == 4 * (k + l) * N * 8


def test_lanczos_stops_when_the_krylov_space_is_exhausted() -> None:
    spectrum = torch.tensor([5.0, 3.0, 1.0] + [0.0] * (N - 3), dtype=torch.float64)
    matrix = quadratic(spectrum)
    result = lanczos_extremes(lambda v: matrix @ v, CoordinateShard(N, 1, 0), 2, 0, 12, 0)
    assert result.iterations <= 4
    torch.testing.assert_close(result.eigenvalues, spectrum[:2], rtol=1e-9, atol=0)


class Quadratic(nn.Module):
    """loss = ½θᵀAθ of its one parameter θ (the HVP is A v)."""

    def __init__(self, matrix: torch.Tensor) -> None:
        super().__init__()
        self.matrix = matrix
        gen = torch.Generator().manual_seed(5)
        self.theta = nn.Parameter(torch.randn(N, generator=gen, dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return 0.5 * self.theta @ self.matrix @ self.theta


@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
def test_fosi_ese_finds_the_spectrum_of_the_objective(weight_decay: float) -> None:
    """With weight decay wd in the base, ESE sees loss + wd/2·|θ|²: every eigenvalue + wd."""
    matrix = quadratic(known_spectrum())
    model = Quadratic(matrix)
    base = torch.optim.SGD(model.parameters(), lr=0.01, weight_decay=weight_decay)
    opt = FOSI(model.parameters(), base, k=3, l=2, warmup=0, model=model)
    assert opt.eigenvalues.numel() == 0
    model.zero_grad()
    model().backward()
    opt.step(model)
    shifted = matrix + weight_decay * torch.eye(N, dtype=torch.float64)
    assert opt.vectors is not None
    check_pairs(opt.eigenvalues, opt.vectors, shifted, 3, 2)
    assert opt.hvp_mode_used == "double-backward"  # auto's route


def test_ese_leaves_batchnorm_running_statistics_unchanged() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(16, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (16,))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = FOSI(model.parameters(), base, k=2, warmup=0, lanczos_iters=16,
               model=model)  # fmt: skip
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()  # the training forward updates them
    before = {n: b.clone() for n, b in model.named_buffers()}
    opt.step(lambda: nn.functional.cross_entropy(model(x * 2 + 1), y))
    assert opt.eigenvalues.numel() == 2 and opt.hvp_mode_used == "double-backward"
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
