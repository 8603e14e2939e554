"""Real layers timed on a device: the rate curves a calibrated profile prices layers with.

A convolution (3×3, ``c → c`` channels on 8×8 positions, batch 16) and a linear layer
(``n → n``, batch 32) at sizes from a few hundred FLOPs to about a GFLOP: each point is the
layer's forward FLOPs (as :attr:`kfac_hpc.plan.layers.LayerShape.forward_flops` counts them)
with its forward seconds, its backward seconds (input and weight gradients) and the seconds of
its K-FAC factor update from the captured input and output gradient (the code the
preconditioner's hooks run: ``KFACLayer.a_factor`` and ``g_factor``). Small layers run far
below a large GEMM's rate (launch and dispatch costs, short loops), which one GEMM rate
cannot say. Also the job's optimizer update per parameter tensor (``optimizer_tensor_s``): on a
CPU its update loops over the tensors, and a small model's update is mostly that loop.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from kfac_hpc.optim.layers import make_layer
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.optimizers import make_optimizer

__all__ = ["CONV_CHANNELS", "LINEAR_WIDTHS", "layer_curve", "optimizer_tensor_s", "per_call_s"]

CONV_CHANNELS = (4, 8, 16, 32, 64, 128, 256)
LINEAR_WIDTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
_CONV_BATCH, _CONV_SIDE, _LINEAR_BATCH = 16, 8, 32
_BLOCK_S, _BLOCKS = 5e-3, 5  # each point: the median of 5 blocks of at least 5 ms
_TENSORS, _TENSOR_ELEMENTS = 64, 64  # the optimizer's many-small-tensors update

Point = tuple[float, float, float, float]  # forward FLOPs, forward s, backward s, factor s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call of ``fn``: the median over blocks of at least ``_BLOCK_S`` seconds
    (after one warm-up call), the device synchronized around each block."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    calls = max(1, math.ceil(_BLOCK_S / max(time.perf_counter() - start, 1e-9)))
    times = []
    for _ in range(_BLOCKS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _layer_point(module: nn.Module, x: torch.Tensor, flops: float) -> Point:
    device = x.device
    x = x.requires_grad_(True)
    with torch.no_grad():
        grad = torch.randn_like(module(x))
    forward = per_call_s(lambda: module(x), device)
    both = per_call_s(lambda: module(x).backward(grad), device)
    kfac = make_layer("layer", module)
    assert kfac is not None
    inputs = x.detach()

    def factors() -> None:
        with torch.no_grad():
            kfac.a_factor(inputs, torch.float32)
            kfac.g_factor(grad, 1.0, torch.float32)

    factor = per_call_s(factors, device)
    # the backward is the difference of two medians: noise can make it tiny, never <= 0
    return flops, forward, max(both - forward, 0.05 * forward), factor


def layer_curve(kind: str, device: torch.device) -> list[Point]:
    """The measured points of ``kind`` (``conv`` or ``linear``), FLOPs ascending."""
    points = []
    if kind == "conv":
        for c in CONV_CHANNELS:
            conv = nn.Conv2d(c, c, 3, padding=1).to(device)
            x = torch.randn(_CONV_BATCH, c, _CONV_SIDE, _CONV_SIDE, device=device)
            flops = 2.0 * _CONV_BATCH * _CONV_SIDE**2 * 9 * c * c
            points.append(_layer_point(conv, x, flops))
    else:
        for n in LINEAR_WIDTHS:
            linear = nn.Linear(n, n).to(device)
            x = torch.randn(_LINEAR_BATCH, n, device=device)
            points.append(_layer_point(linear, x, 2.0 * _LINEAR_BATCH * n * n))
    return points


def _update_s(shapes: list[tuple[int, ...]], device: torch.device) -> float:
    """Seconds of one update of the job's default optimizer over parameters of ``shapes``."""
    params = nn.ParameterList(nn.Parameter(torch.randn(*s, device=device)) for s in shapes)
    for p in params:
        p.grad = torch.randn_like(p)
    return per_call_s(make_optimizer(TrainConfig(), params).step, device)


def optimizer_tensor_s(device: torch.device) -> float:
    """Seconds per parameter tensor of the job's optimizer update (its defaults: SGD with
    momentum and L2): an update of 64 tensors of 64 elements minus that of one tensor of
    the same 4,096 elements, over the 63 tensors more (>= 0)."""
    many = _update_s([(_TENSOR_ELEMENTS,)] * _TENSORS, device)
    one = _update_s([(_TENSORS * _TENSOR_ELEMENTS,)], device)
    return max(0.0, (many - one) / (_TENSORS - 1))
