"""Lanczos stopped once the wanted Ritz pairs converged (``stop_tol``) gives the top-k (and
bottom-l) eigenvalues of the full run, in fewer steps.

Oracle: a quadratic on 200 coordinates with the known spectrum 50, 40, 30, 25, 20 (and -6, -5
for l) above and below a bulk in [0, 10); dense ``torch.linalg.eigh``. A Ritz value whose
residual is r is within r²/gap of its eigenvalue: with r ≤ tol·50 and every gap ≥ 1 the error
is at most (50·tol)², 0.25 for tol = 1e-2 and 2.5e-5 for tol = 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from kfac_hpc.optim.fosi.lanczos import lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard

N = 200


def matrix_and_spectrum() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    extremes = torch.tensor([50.0, 40.0, 30.0, 25.0, 20.0, -5.0, -6.0], dtype=torch.float64)
    spectrum = torch.cat([extremes, 10 * torch.rand(N - 7, generator=gen, dtype=torch.float64)])
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen, dtype=torch.float64))
    return q @ torch.diag(spectrum) @ q.T, torch.linalg.eigvalsh(q @ torch.diag(spectrum) @ q.T)


@pytest.mark.parametrize(("k", "l"), [(5, 0), (3, 2)])
@pytest.mark.parametrize("tol", [1e-2, 1e-4])
def test_early_stopped_lanczos_finds_the_extremes_of_the_full_run(k, l, tol) -> None:  # noqa: E741
    matrix, mu = matrix_and_spectrum()
    shard = CoordinateShard(N, 1, 0)
    full = lanczos_extremes(lambda v: matrix @ v, shard, k, l, 60, 0)
    early = lanczos_extremes(lambda v: matrix @ v, shard, k, l, 60, 0, stop_tol=tol)
    assert early.iterations < full.iterations == 60
    bound = (50 * tol) ** 2
    torch.testing.assert_close(early.eigenvalues, full.eigenvalues, rtol=0, atol=bound)
    index = torch.cat([torch.arange(N - 1, N - 1 - k, -1), torch.arange(l - 1, -1, -1)])
    torch.testing.assert_close(early.eigenvalues, mu[index], rtol=0, atol=bound)
    assert (early.residuals <= tol * 50.0 * (1 + 1e-9)).all()
