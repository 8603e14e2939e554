"""Small models and dense float64 oracles shared by the optimizer tests."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def dense_patches(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """im2col by explicit slicing (independent of F.unfold): (N, L, groups, C_in/g·kh·kw)."""
    kh, kw = conv.kernel_size
    dh, dw = conv.dilation
    sh, sw = conv.stride
    if conv.padding == "same":
        th, tw = dh * (kh - 1), dw * (kw - 1)
        pad = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    elif conv.padding == "valid":
        pad = (0, 0, 0, 0)
    else:
        ph, pw = conv.padding
        pad = (pw, pw, ph, ph)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pad, mode=mode)
    n, _, h, w = xp.shape
    out_h = (h - dh * (kh - 1) - 1) // sh + 1
    out_w = (w - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for i in range(out_h):
        for j in range(out_w):
            window = xp[
                :,
                :,
                i * sh : i * sh + dh * (kh - 1) + 1 : dh,
                j * sw : j * sw + dw * (kw - 1) + 1 : dw,
            ]
            rows.append(window.reshape(n, conv.groups, -1))
    return torch.stack(rows, 1)


def dense_factors(module: nn.Module, x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    """A = (1/M) Σ a aᵀ (bias as a column of ones), G = (1/N) Σ (N g)(N g)ᵀ, float64 loops."""
    x, grad_out = x.double(), grad_out.double()
    n = x.shape[0]
    if isinstance(module, nn.Conv2d):
        groups = module.groups
        a = dense_patches(x, module).reshape(-1, groups, dense_patches(x, module).shape[-1])
        g = grad_out.permute(0, 2, 3, 1).reshape(-1, groups, module.out_channels // groups)
    else:
        groups = 1
        a = x.reshape(-1, 1, x.shape[-1])
        g = grad_out.reshape(-1, 1, grad_out.shape[-1])
    if module.bias is not None:
        a = torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype)], -1)
    a_fac = torch.stack(
        [sum(torch.outer(r, r) for r in a[:, k]) / a.shape[0] for k in range(groups)]
    )
    g_fac = torch.stack(
        [sum(torch.outer(n * r, n * r) for r in g[:, k]) / n for k in range(groups)]
    )
    return (a_fac[0], g_fac[0]) if groups == 1 else (a_fac, g_fac)


def output_grad(module: nn.Module, x: Tensor, target_seed: int = 0) -> Tensor:
    """d(mean loss)/d(output) of a simple batch-mean loss on the module's output."""
    out = module(x)
    out.retain_grad()
    torch.manual_seed(target_seed)
    target = torch.randn_like(out)
    loss = ((out - target) ** 2).reshape(out.shape[0], -1).sum(1).mean()
    loss.backward()
    assert out.grad is not None
    return out.grad


def small_cnn(dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny CNN for 8×8 single-channel images (sklearn digits)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(32 * 16, 10),
    ).to(dtype)


def dense_eigen_step(
    a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float
) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ vec(∇W), row-major vec, per group when factors are batched."""
    if a.dim() == 3:
        return torch.stack([dense_eigen_step(a[i], g[i], grad[i], damping) for i in range(len(a))])
    kron = torch.kron(g, a) + damping * torch.eye(g.shape[0] * a.shape[0], dtype=a.dtype)
    return torch.linalg.solve(kron, grad.reshape(-1)).reshape(grad.shape)


def dense_inverse_step(
    a: torch.Tensor, g: torch.Tensor, grad: torch.Tensor, damping: float, mode: str = "pi_split"
) -> torch.Tensor:
    """(G + λ_G I)⁻¹ ∇W (A + λ_A I)⁻¹, by hand: λ_A = π√λ, λ_G = √λ/π with
    π = sqrt((tr A/n_A)/(tr G/n_G)) (``pi_split``), or λ_A = λ_G = λ (``per_factor``)."""
    if a.dim() == 3:
        return torch.stack(
            [dense_inverse_step(a[i], g[i], grad[i], damping, mode) for i in range(len(a))]
        )
    pi = math.sqrt((a.trace().item() / a.shape[0]) / (g.trace().item() / g.shape[0]))
    lam_a, lam_g = pi * math.sqrt(damping), math.sqrt(damping) / pi
    if mode == "per_factor":
        lam_a = lam_g = damping
    eye_a, eye_g = torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=g.dtype)
    return torch.linalg.inv(g + lam_g * eye_g) @ grad @ torch.linalg.inv(a + lam_a * eye_a)


def profiled_gemm_flops(run: Callable[[], object]) -> int:
    """2·b·m·k·n summed over the GEMMs torch.profiler records while ``run`` runs (a GEMM that
    runs inside another, e.g. addmm_ inside a baddbmm_ of batch 1, is the same work)."""

    def gemm(event: Any) -> str | None:
        name = event.name.removeprefix("aten::").rstrip("_")
        return name if name in ("mm", "bmm", "addmm", "baddbmm") else None

    with torch.profiler.profile(record_shapes=True) as prof:
        run()
    total = 0
    for event in prof.events():
        name = gemm(event)
        if name is None or (event.cpu_parent is not None and gemm(event.cpu_parent)):
            continue
        left, right = event.input_shapes[1:3] if name.startswith("add") else event.input_shapes[:2]
        batch = left[0] if len(left) == 3 else 1
        total += 2 * batch * left[-2] * left[-1] * right[-1]
    return total
