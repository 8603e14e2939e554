"""Lanczos with its basis in the training dtype (``lanczos_dtype="training"``: float32 basis,
products and Ritz vectors; float64 coefficients, tridiagonal matrix and eigenproblem) finds the
same extreme eigenvalues as the float64 basis.

Oracle: the known spectrum of test_lanczos_early_stop (extremes 50, 40, 30, 25, 20 and -5, -6
around a bulk in [0, 10); dense float64 ``eigvalsh``). Tolerance: float32 rounding of the
products and the basis (unit roundoff 6e-8, |H| = 50) perturbs a well-separated Ritz value by a
few eps · |H| (measured: 1.9e-6 absolute); we ask 1e-6 of the largest (5e-5 absolute) for every
wanted value, against both the float64 run and the dense oracle.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.fosi.lanczos import _local_norm2, lanczos_extremes, warm_start_vector
from kfac_hpc.optim.fosi.sharding import CoordinateShard
from tests.optim.fosi.test_lanczos_early_stop import N, matrix_and_spectrum

TOL = 1e-6 * 50  # absolute: 1e-6 of the largest eigenvalue


@pytest.mark.parametrize(("k", "l"), [(5, 0), (3, 2)])
def test_a_float32_basis_gives_the_float64_extremes(k: int, l: int) -> None:  # noqa: E741
    matrix, mu = matrix_and_spectrum()
    single = matrix.float()
    shard = CoordinateShard(N, 1, 0)
    exact = lanczos_extremes(lambda v: matrix @ v, shard, k, l, 60, 0)
    low = lanczos_extremes(lambda v: single @ v, shard, k, l, 60, 0, dtype=torch.float32)
    assert low.vectors.dtype == torch.float32 and low.eigenvalues.dtype == torch.float64
    assert low.basis_bytes * 2 == exact.basis_bytes
    index = torch.cat([torch.arange(N - 1, N - 1 - k, -1), torch.arange(l - 1, -1, -1)])
    torch.testing.assert_close(low.eigenvalues, exact.eigenvalues, rtol=0, atol=TOL)
    torch.testing.assert_close(low.eigenvalues, mu[index], rtol=0, atol=TOL)
    # the Ritz vectors are eigenvectors to float32 accuracy: orthonormal, small residuals
    v = low.vectors.double()
    torch.testing.assert_close(v @ v.T, torch.eye(k + l, dtype=torch.float64), rtol=0, atol=1e-5)
    residual = matrix @ v.T - v.T * low.eigenvalues
    assert float(residual.norm(dim=0).max()) < 1e-3 * 50


def test_fosi_with_the_training_dtype_basis_estimates_the_same_spectrum() -> None:
    """A float32 MLP: the ESE's eigenvalues with a float32 basis equal those with a float64
    basis (both over the same float32 Hessian-vector products) to 1e-5 of the largest, and the
    basis takes half the bytes."""
    found = {}
    for dtype in ("float64", "training"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
        x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))

        def loss(model: nn.Module = model, x: torch.Tensor = x, y: torch.Tensor = y) -> Tensor:
            return nn.functional.cross_entropy(model(x), y)

        base = torch.optim.SGD(model.parameters(), lr=0.0)
        opt = FOSI(model.parameters(), base, k=4, warmup=0, lanczos_iters=40, model=model,
                   hvp="double-backward", residual_tol=1.0, ese_check=False,
                   lanczos_dtype=dtype)  # fmt: skip
        loss().backward()
        opt.step(loss)
        found[dtype] = (opt.eigenvalues.clone(), opt.lanczos_basis_bytes)
    (wide, wide_bytes), (narrow, narrow_bytes) = found["float64"], found["training"]
    assert narrow.numel() == wide.numel() == 4 and narrow_bytes * 2 == wide_bytes
    torch.testing.assert_close(narrow, wide, rtol=0, atol=1e-5 * float(wide[0]))


def test_an_unknown_lanczos_dtype_is_refused_by_name() -> None:
    model = nn.Linear(2, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"lanczos_dtype='float16'.*float64, training"):
        FOSI(model.parameters(), base, k=1, lanczos_dtype="float16")


@pytest.mark.parametrize("n", [700, 2_109_450])  # under one block; the bench MLP's 2.1 M
def test_a_float32_squared_norm_rounds_at_float32s_unit_roundoff_at_any_length(n: int) -> None:
    """Lanczos' squared norms of float32 vectors (|H q|², β²) against the float64 dot of the
    exact float64 casts (products exact, sum rounding ~1e-16): within 2 ε = 1.2e-7 relative
    (measured 1e-9) at both lengths, where a float32 ``dot`` of 2.1 M same-signed squares is
    off by about 3e-6."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, generator=gen) * (1 + torch.rand(n, generator=gen))
    exact = float(torch.dot(a.double(), a.double()))
    found = _local_norm2(a)
    assert found.dtype == torch.float64
    assert abs(float(found) - exact) <= 2 * torch.finfo(torch.float32).eps / 2 * exact


def test_a_warm_start_from_float32_vectors_is_the_float64_one_to_float32_rounding() -> None:
    """Oracle: the warm start computed from the same Ritz vectors cast to float64 first."""
    shard = CoordinateShard(N, 1, 0)
    previous = torch.linalg.qr(torch.randn(N, 3, dtype=torch.float64))[0].T
    narrow = warm_start_vector(shard, previous.float(), 0)
    wide = warm_start_vector(shard, previous.float().double(), 0)
    assert narrow.dtype == torch.float64
    torch.testing.assert_close(narrow, wide, rtol=0, atol=1e-6)
