"""The FOSI step: the base optimizer bit for bit before the first ESE, the dense formula after.

Oracle of the formula: plain float64 matrices. With V (K × n, orthonormal rows), λ, the
velocity v0 = 0, momentum β, step α, base SGD(lr, momentum, weight decay wd) at its first step
(momentum buffer = its gradient) and P = VᵀV:
    g_obj = g + wd θ,  g1 = P g_obj,  v = (1 − β) g1,  d1 = −α Vᵀ diag(|λ|⁻¹) V v,
    d2 = (I − P)(−lr (g − g1 + wd θ)),  θ' = θ + s d2 + d1,
    s = min(clip(λ1 / λk, 1, c), max(1, 1/(η λk))), η = max over groups of lr/(1 − momentum);
for Adam, d2 = (I − P)(−lr ĝ/(|ĝ| + ε)), Adam's first step on ĝ = g − g1 + wd θ, and s = 1.
Tolerance 1e-12 relative (observed about 1e-16).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import kfac_hpc
from kfac_hpc.optim.fosi import FOSI


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Linear(9, 4)).to(dtype)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    return [{"params": model[0].parameters()},
            {"params": model[2].parameters(), "lr": 0.03, "weight_decay": 0.01}]  # fmt: skip


BASES: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.1),
    "heavy_ball": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "nesterov": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda g: torch.optim.Adam(g, lr=1e-3, weight_decay=1e-3),
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-3),
}


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 7, generator=gen, dtype=dtype)
    y = torch.randint(0, 4, (16,), generator=gen)
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("base_name", sorted(BASES))
def test_before_the_first_ese_fosi_is_its_base_bit_for_bit(base_name: str) -> None:
    plain, wrapped = _model(), _model()
    base = BASES[base_name](_groups(plain))
    opt = FOSI(wrapped.parameters(), BASES[base_name](_groups(wrapped)), warmup=10, model=wrapped)
    schedule = torch.optim.lr_scheduler.StepLR(base, 2, gamma=0.5)
    fosi_schedule = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)  # acts on base's groups
    for step in range(6):
        for model, optimizer in ((plain, base), (wrapped, opt)):
            optimizer.zero_grad()
            _loss(model, step).backward()
            optimizer.step()
        schedule.step()
        fosi_schedule.step()
        for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
            assert torch.equal(a, b), f"{base_name}: differs at step {step}"
    assert opt.eigenvalues.numel() == 0 and opt.memory_usage()["eigenvectors_bytes"] == 0


def _orthonormal(k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(9)
    q, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))
    return q.T.contiguous()


@pytest.mark.parametrize("base_name", ["sgd", "heavy_ball", "adam"])  # s = 2 or 3, 1, 1
@pytest.mark.parametrize("eigenvalues", [[4.0, 2.0, -0.5], [40.0, 2.0, 1.0]])
def test_one_step_with_given_spectrum_equals_the_dense_formula(
    base_name: str, eigenvalues: list[float]
) -> None:
    model = _model(torch.float64)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    opt = FOSI(params, BASES[base_name](_groups(model)), k=2, l=1, alpha=0.05, warmup=10,
               clip=3.0, model=model)  # fmt: skip
    V, lam = _orthonormal(3, n), torch.tensor(eigenvalues, dtype=torch.float64)
    opt.set_spectrum(lam, V)
    model.zero_grad()
    _loss(model, 0).backward()
    theta = torch.cat([p.detach().reshape(-1) for p in params])
    g = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    wd = torch.cat([torch.full((p.numel(),), group.get("weight_decay", 0.0), dtype=torch.float64)
                    for group in opt.base.param_groups for p in group["params"]])  # fmt: skip
    P = V.T @ V
    g1 = P @ (g + wd * theta)
    velocity = 0.1 * g1  # β = 0.9, v0 = 0
    d1 = -0.05 * V.T @ torch.diag(1 / lam.abs()) @ V @ velocity
    lrs = torch.cat([torch.full((p.numel(),), group["lr"], dtype=torch.float64)
                     for group in opt.base.param_groups for p in group["params"]])  # fmt: skip
    grad = g - g1 + wd * theta  # what the base sees, its own (coupled) weight decay included
    if base_name == "adam":  # Adam's first step: lr · ĝ / (|ĝ| + ε) per coordinate
        d2 = -lrs * grad / (grad.abs() + 1e-8)
        scale = 1.0
    else:
        d2 = -lrs * grad
        eta = max(g["lr"] / (1 - g["momentum"]) for g in opt.base.param_groups)
        newton = max(1.0, 1.0 / (eta * eigenvalues[1]))
        scale = min(max(eigenvalues[0] / eigenvalues[1], 1.0), 3.0, newton)
    d2 = d2 - P @ d2
    want = theta + scale * d2 + d1
    opt.step()
    got = torch.cat([p.detach().reshape(-1) for p in params])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())


def test_an_ese_without_closure_is_an_error_naming_the_fix() -> None:
    model = _model()
    opt = FOSI(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), warmup=0)
    _loss(model, 0).backward()
    with pytest.raises(ValueError, match="pass closure="):
        opt.step()
    assert opt.step_count == 0


@pytest.mark.parametrize(
    ("option", "value"),
    [("k", -1), ("alpha", 0.0), ("ese_every", 0), ("clip", 0.5), ("hvp", "magic"),
     ("lanczos_iters", 3), ("max_staleness", 100), ("curvature_ranks", 1)],
)  # fmt: skip
def test_bad_options_name_the_option(option: str, value: object) -> None:
    model = _model()
    with pytest.raises(ValueError, match=option):
        options: dict[str, Any] = {"k": 2, "l": 2, option: value}
        FOSI(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), **options)


def test_params_must_be_the_base_optimizers() -> None:
    model, other = _model(), _model()
    with pytest.raises(ValueError, match="params"):
        FOSI(other.parameters(), torch.optim.SGD(model.parameters(), lr=0.1))


def test_exported_from_the_package() -> None:
    assert kfac_hpc.FOSI is FOSI
