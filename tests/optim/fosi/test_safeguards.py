"""FOSI's safeguards: Ritz pairs kept by residual, the ESE's loss check, a stop at the step
whose gradient is non-finite.

Oracle for the residual test: a quadratic ½θᵀAθ whose spectrum is 50, 20, then 40 eigenvalues
evenly spaced in [0.25, 10]: 6 or 8 Lanczos steps resolve 50 and 20 but not the spread below
them (the third Ritz value is 9.2 at 6 steps, 9.7 at 8, for a true 10).
``torch.linalg.eigh`` of A (float64) gives the true pairs and the dense residuals ‖Av − λv‖.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kfac_hpc.optim.fosi import FOSI, NonFiniteCurvature
from kfac_hpc.optim.fosi.lanczos import converged_pairs, lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard

N = 42
TOL = 0.01  # the default residual_tol


def spread_quadratic() -> tuple[torch.Tensor, torch.Tensor]:
    spectrum = torch.cat([torch.tensor([50.0, 20.0]), torch.linspace(10.0, 0.25, N - 2)])
    gen = torch.Generator().manual_seed(7)
    q, _ = torch.linalg.qr(torch.randn(N, N, generator=gen, dtype=torch.float64))
    return q @ torch.diag(spectrum.double()) @ q.T, spectrum.double()


def test_unconverged_ritz_pairs_are_dropped_and_the_converged_kept() -> None:
    matrix, spectrum = spread_quadratic()
    full = lanczos_extremes(lambda v: matrix @ v, CoordinateShard(N, 1, 0), 5, 0, 6, 0)
    dense_residual = (full.vectors @ matrix - full.eigenvalues[:, None] * full.vectors).norm(dim=1)
    torch.testing.assert_close(full.residuals, dense_residual, rtol=1e-6, atol=1e-9)
    kept = converged_pairs(full, TOL)
    unconverged = dense_residual > TOL * 50.0
    assert unconverged.any() and not unconverged.all()  # the test means something
    assert kept.eigenvalues.numel() == int((~unconverged).sum()) == kept.top
    # the kept pairs are the true top eigenpairs (λ to ~r²/gap); the dropped are far from theirs
    torch.testing.assert_close(kept.eigenvalues, spectrum[: kept.top], rtol=1e-4, atol=0)
    assert ((full.eigenvalues - spectrum[:5]).abs()[unconverged] > 0.1).all()


def test_the_step_is_the_dense_formula_on_the_kept_pairs() -> None:
    matrix, _ = spread_quadratic()
    theta = nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(8)).double())
    lr, alpha, momentum = 0.01, 0.1, 0.9
    base = torch.optim.SGD([theta], lr=lr)
    opt = FOSI([theta], base, k=5, alpha=alpha, warmup=0, lanczos_iters=8, momentum=momentum,
               ese_check=False)  # fmt: skip
    start = theta.detach().clone()
    g = matrix @ start
    theta.grad = g.clone()
    opt.step(lambda: 0.5 * theta @ matrix @ theta)
    assert opt.pairs_kept == [2] and opt.top == 2  # of 5 Ritz pairs
    mu, q = torch.linalg.eigh(matrix)
    lam, V = mu.flip(0)[:2], q.flip(1)[:, :2].T  # the dense top 2
    g1 = V.T @ (V @ g)
    d1 = -alpha * (V.T @ ((1 - momentum) * (V @ g) / lam))
    d2 = -lr * (g - g1)
    d2 = d2 - V.T @ (V @ d2)
    scale = min(max(float(lam[0] / lam[1]), 1.0), 3.0, max(1.0 / (lr * float(lam[1])), 1.0))
    # the kept Ritz vectors are the eigenvectors to ~r/gap (1.5e-4 here)
    expected = scale * d2 + d1
    torch.testing.assert_close(
        theta.detach() - start, expected, rtol=0, atol=1e-3 * expected.norm()
    )


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize("nan_step", [3, 7])
def test_a_nan_loss_stops_fosi_at_its_step(nan_step: int) -> None:
    torch.manual_seed(0)
    model = Linear()
    opt = FOSI(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), k=2,
               ese_every=20, warmup=2, model=model)  # fmt: skip
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    for step in range(10):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        (loss * (math.nan if step == nan_step else 1.0)).backward()
        if step < nan_step:
            opt.step(lambda: nn.functional.cross_entropy(model(x), y))
            continue
        with pytest.raises(NonFiniteCurvature, match=f"at step {nan_step}") as caught:
            opt.step(lambda: nn.functional.cross_entropy(model(x), y))
        assert caught.value.step == nan_step and caught.value.in_gradient
        assert all(torch.isfinite(p).all() for p in model.parameters())  # nothing applied
        return
    raise AssertionError("not reached")


def test_an_ese_whose_subspace_step_raises_the_loss_is_rejected() -> None:
    """alpha = 3: the Newton step along the top eigenvector goes from x to −2x, and raises the
    loss; the ESE's pairs are dropped, the step is the base's and the step is recorded."""
    diagonal = torch.tensor([4.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    theta = nn.Parameter(torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    base = torch.optim.SGD([theta], lr=0.01)
    opt = FOSI([theta], base, k=1, alpha=3.0, momentum=0.0, warmup=0, lanczos_iters=4)
    theta.grad = diagonal * theta.detach()
    start = theta.detach().clone()
    opt.step(lambda: 0.5 * (diagonal * theta * theta).sum())
    assert opt.rejected_at == [0] and opt.vectors is None and opt.eigenvalues.numel() == 0
    torch.testing.assert_close(theta.detach(), start - 0.01 * diagonal * start)
