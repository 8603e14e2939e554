"""The ESE on a sub-sampled curvature batch (``curvature_fraction``) estimates the Hessian of
the mean loss over exactly the batch's leading ⌈f·N⌉ rows.

Oracle: a tiny tanh MLP in float64 whose Hessian is formed densely
(``torch.autograd.functional.hessian`` of the mean loss over those rows) and ``eigh``. Lanczos
runs n steps (the whole Krylov space), so its Ritz values are the Hessian's eigenvalues to
rounding: tolerance 1e-9 relative to the largest.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.fosi.curvature_batch import leading_rows, subset_size

BATCH = 16


def _problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(BATCH, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH,))
    return model, x, y


def _dense_top(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest eigenvalues (largest first) of the Hessian of the mean loss on (x, y)."""
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    sizes = [s.numel() for s in shapes]
    flat0 = torch.cat([p.detach().reshape(-1) for p in params])

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        parts = [c.view(s) for c, s in zip(flat.split(sizes), shapes, strict=True)]
        h = torch.tanh(x @ parts[0].T + parts[1])
        return F.cross_entropy(h @ parts[2].T + parts[3], y)

    hessian = torch.autograd.functional.hessian(loss_of, flat0)
    return torch.linalg.eigvalsh(hessian).flip(0)[:k]


def _ese(fraction: float, closure: Callable[..., torch.Tensor], model: nn.Module) -> FOSI:
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    base = torch.optim.SGD(params, lr=0.0)
    fosi = FOSI(params, base, k=3, ese_every=1, warmup=0, lanczos_iters=n, model=model,
                curvature_fraction=fraction, residual_tol=1.0, ese_check=False,
                hvp="double-backward")  # fmt: skip
    for p in params:
        p.grad = torch.zeros_like(p)
    fosi.step(closure)
    return fosi


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.3])
def test_the_ese_differentiates_exactly_the_leading_rows(fraction: float) -> None:
    model, x, y = _problem()
    seen: list[int] = []

    def closure(f: float = 1.0) -> torch.Tensor:
        xs, ys = leading_rows(f, x, y)
        seen.append(len(xs))
        return F.cross_entropy(model(xs), ys)

    keep = subset_size(BATCH, fraction)
    expected = _dense_top(model, x[:keep], y[:keep], 3)
    fosi = _ese(fraction, closure, model)
    assert set(seen) == {keep}  # every call of the ESE saw that subset, and only it
    scale = float(expected.abs().max())
    torch.testing.assert_close(fosi.eigenvalues, expected, rtol=0, atol=1e-9 * scale)
    # the whole batch's Hessian differs: the test can tell the subset from the batch
    whole = _dense_top(model, x, y, 3)
    assert (whole - expected).abs().max() > 1e-3 * scale


def _todays_ese() -> FOSI:
    """The ESE of a zero-argument closure (called with an argument, it would fail), the option
    at its default."""
    model, x, y = _problem()
    return _ese(1.0, lambda: F.cross_entropy(model(x), y), model)


def _fraction_one_ese() -> FOSI:
    """The ESE at fraction 1 of a closure that takes the fraction."""
    model, x, y = _problem()

    def closure(f: float = 1.0) -> torch.Tensor:
        xs, ys = leading_rows(f, x, y)
        return F.cross_entropy(model(xs), ys)

    return _ese(1.0, closure, model)


def test_fraction_one_is_todays_ese_bit_for_bit() -> None:
    today, one = _todays_ese(), _fraction_one_ese()
    assert today.vectors is not None and one.vectors is not None
    assert torch.equal(today.eigenvalues, one.eigenvalues)
    assert torch.equal(today.vectors, one.vectors)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_a_fraction_outside_0_1_is_refused_by_name(bad: float) -> None:
    model, _, _ = _problem()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"curvature_fraction=.*\(0, 1\]"):
        FOSI(model.parameters(), base, k=2, curvature_fraction=bad)


def test_subset_size_rounds_up_and_keeps_one_row() -> None:
    assert [subset_size(16, f) for f in (1.0, 0.25, 0.3, 0.01)] == [16, 4, 5, 1]
