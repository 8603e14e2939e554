"""Lanczos warm-started from the previous ESE's Ritz vectors and stopped early (``stop_tol``)
gives the top-k (and bottom-l) eigenvalues of the full run, in fewer steps than from a random
start.

Oracle: the known spectrum of test_lanczos_early_stop (extremes 50, 40, 30, 25, 20 and -5, -6
around a bulk in [0, 10)), its Ritz vectors from a first run, then the matrix moved by a
symmetric perturbation (the Hessian of the next ESE); dense ``eigvalsh`` of the moved matrix.
A Ritz value with residual r ≤ tol · 50 is within r²/gap ≤ (50 · tol)² of its eigenvalue once the
perturbation leaves every gap ≥ 1 (it moves eigenvalues by at most its norm, < 0.1 · 15 here).
"""

from __future__ import annotations

import pytest
import torch

from kfac_hpc.optim.fosi.lanczos import lanczos_extremes, warm_start_vector
from kfac_hpc.optim.fosi.sharding import CoordinateShard
from tests.optim.fosi.test_lanczos_early_stop import N, matrix_and_spectrum


@pytest.mark.parametrize(("k", "l"), [(5, 0), (3, 2)])
@pytest.mark.parametrize("move", [0.0, 0.01, 0.1])
@pytest.mark.parametrize("tol", [1e-2, 1e-4])
def test_warm_started_lanczos_converges_to_the_full_runs_extremes_sooner(
    k: int,
    l: int,  # noqa: E741
    move: float,
    tol: float,
) -> None:
    matrix, _ = matrix_and_spectrum()
    shard = CoordinateShard(N, 1, 0)
    previous = lanczos_extremes(lambda v: matrix @ v, shard, k, l, 60, 0)
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(N, N, generator=gen, dtype=torch.float64)
    moved = matrix + move * (noise + noise.T) / 2
    mu = torch.linalg.eigvalsh(moved)

    def hvp(v: torch.Tensor) -> torch.Tensor:
        return moved @ v

    full = lanczos_extremes(hvp, shard, k, l, 60, 1)
    cold = lanczos_extremes(hvp, shard, k, l, 60, 1, stop_tol=tol)
    start = warm_start_vector(shard, previous.vectors, 1)
    warm = lanczos_extremes(hvp, shard, k, l, 60, 1, stop_tol=tol, start=start)
    assert warm.iterations < cold.iterations < full.iterations == 60
    bound = (50 * tol) ** 2
    torch.testing.assert_close(warm.eigenvalues, full.eigenvalues, rtol=0, atol=bound)
    index = torch.cat([torch.arange(N - 1, N - 1 - k, -1), torch.arange(l - 1, -1, -1)])
    torch.testing.assert_close(warm.eigenvalues, mu[index], rtol=0, atol=bound)


def test_the_warm_start_is_a_unit_vector_with_every_direction_present() -> None:
    shard = CoordinateShard(N, 1, 0)
    previous = torch.linalg.qr(torch.randn(N, 3, dtype=torch.float64))[0].T
    start = warm_start_vector(shard, previous, 0)
    assert abs(float(start.norm()) - 1.0) < 1e-12
    # mostly along the previous vectors, but not only: its part outside their span is the
    # random component (norm about 0.1 before normalizing)
    inside = previous.T @ (previous @ start)
    assert 0.05 < float((start - inside).norm()) < 0.2
    assert float(inside.norm()) > 0.95
