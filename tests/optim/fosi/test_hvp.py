"""HVPs (forward-over-reverse and double backward) equal the dense Hessian times v.

Oracle: the full Hessian of the loss as a function of the flat float64 parameter vector, built
by ``torch.autograd.functional.hessian`` (n × n, one reverse pass per row), times v.
Tolerance: 1e-12 relative (float64; observed about 1e-16).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from kfac_hpc.optim.fosi.hvp import HessianVectorProduct

Loss = Callable[[torch.Tensor], torch.Tensor]


def _model(batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(5))
    return nn.Sequential(*layers).double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (8,), generator=gen)


def dense_hessian(model: nn.Module, x: torch.Tensor, loss_of: Loss) -> torch.Tensor:
    """d²L/dθ² over the flat parameters (n × n), by functional_call of the unflattened vector."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(theta: torch.Tensor) -> torch.Tensor:
        parts = theta.split([s.numel() for s in shapes])
        values = {n: t.view(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return loss_of(torch.func.functional_call(model, values, (x,)))

    hessian = torch.autograd.functional.hessian(loss, flat)
    assert isinstance(hessian, torch.Tensor)
    return hessian


def _check(hvp: HessianVectorProduct, hessian: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        v = torch.randn(hessian.shape[0], generator=gen, dtype=torch.float64)
        got, want = hvp(v), hessian @ v
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())


@pytest.mark.parametrize(
    ("mode", "loss_name", "used"),
    [
        ("forward-over-reverse", "cross_entropy", "forward-over-reverse"),
        ("double-backward", "cross_entropy", "double-backward"),
        ("auto", "cross_entropy", "double-backward"),
        ("double-backward", "mse", "double-backward"),
        # torch's forward-mode formula of mse_loss's backward fails (the pitfall FOSI reports
        # for JAX): auto (double backward) is not affected, forward-over-reverse raises
        ("auto", "mse", "double-backward"),
        ("forward-over-reverse", "mse", None),
    ],
)
def test_hvp_equals_dense_hessian_times_v(mode: str, loss_name: str, used: str | None) -> None:
    model = _model()
    x, y = _data()
    target = nn.functional.one_hot(y, 3).double()

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        if loss_name == "mse":  # a reported pitfall of forward-mode AD
            return nn.functional.mse_loss(out, target)
        return nn.functional.cross_entropy(out, y)

    hessian = dense_hessian(model, x, loss_of)
    hvp = HessianVectorProduct(list(model.parameters()), lambda: loss_of(model(x)), model, mode)  # type: ignore[arg-type]
    if used is None:
        with pytest.raises(RuntimeError):
            _check(hvp, hessian)
        return
    _check(hvp, hessian)
    assert hvp.mode_used == used


def test_auto_handles_batchnorm_in_training_mode() -> None:
    """torch.func refuses BatchNorm's in-place running-statistic update in training mode;
    auto's double backward does not need it."""
    model = _model(batchnorm=True)
    x, y = _data()

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    hessian = dense_hessian(model, x, loss_of)
    hvp = HessianVectorProduct(list(model.parameters()), lambda: loss_of(model(x)), model, "auto")
    _check(hvp, hessian)
    assert hvp.mode_used == "double-backward"


def test_forward_over_reverse_needs_the_module() -> None:
    model = _model()
    with pytest.raises(ValueError, match="needs model="):
        HessianVectorProduct(list(model.parameters()), lambda: model(torch.zeros(1, 4)).sum(),
                             None, "forward-over-reverse")  # fmt: skip


def test_fosi_auto_route_matches_the_dense_hessian_and_is_recorded() -> None:
    """FOSI with ``hvp="auto"`` and ``model=``: its ESE on a 43-parameter model, Lanczos run to
    n steps (the Krylov space is the whole space), gives the dense Hessian's 3 largest
    eigenvalues (1e-8 relative: Lanczos in float64 over 43 steps, observed about 1e-13), and
    records the route that ran, double backward, in ``hvp_mode_used`` and its state."""
    from kfac_hpc.optim.fosi import FOSI

    model = _model()
    x, y = _data()

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    want = torch.linalg.eigvalsh(dense_hessian(model, x, loss_of)).flip(0)[:3]
    n = sum(p.numel() for p in model.parameters())
    base = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = FOSI(model.parameters(), base, k=3, warmup=0, lanczos_iters=n, model=model,
               residual_tol=1.0, ese_check=False)  # fmt: skip
    loss_of(model(x)).backward()
    opt.step(lambda: loss_of(model(x)))
    torch.testing.assert_close(opt.eigenvalues, want, rtol=1e-8, atol=1e-8 * want[0].item())
    assert opt.hvp_mode_used == "double-backward"
    assert opt.state_dict()["hvp_mode_used"] == "double-backward"
