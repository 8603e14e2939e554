"""A model's modules timed inside its own forward and backward passes.

Modules timed alone in a tight loop run faster than inside the model's pass (their inputs,
weights and code are hot in the caches; the pass interleaves other modules, the loss and the
autograd engine). Here the model runs whole passes at a batch, after warm-up, with hooks on
every leaf module: a forward pre- and post-hook around each call in one pass, a full
backward pre-hook and hook around each call's gradient in the next. Each module's seconds
per call (median over passes, the backward less the hooks' share) is one point (FLOPs,
elements, forward s, backward s) for the kind fits (module_fits.py).

The hooks cost time of their own, so each hooked pass is paired with a pass without hooks:
the whole pass both ways and the sum of the modules' times tell how much the hooks add and how
much of the pass lies outside the modules (the loss, functional calls, the engine). The
forward hooks' cost falls outside the timed calls (on a CPU the modules' forward times sum to
the pass without hooks); the full backward hooks add autograd nodes inside each module's
backward interval, so what they add to the whole backward (with hooks minus without), spread
evenly over the calls, is taken off each call's backward.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kfac_hpc.plan.calibrate import synchronize
from kfac_hpc.plan.layers import module_kind, weight_flops
from kfac_hpc.plan.module_fits import ModuleFit, ModulePoint

__all__ = ["PassTiming", "pass_error", "points_by_kind", "time_in_pass"]

_WARMUP, _PASSES = 3, 21
_MIN_S = 1e-7  # a point's seconds must be > 0 for the relative fit


@dataclass(frozen=True)
class PassTiming:
    """One batch's in-pass measurements (medians over passes, seconds): ``points`` one per
    call of each leaf module ``(kind, (FLOPs, elements, forward s, backward s))`` (a module
    called several times: its mean call, repeated); the whole pass
    without hooks (``plain``), with hooks (``hooked``), and the sum of the modules' times
    (``modules``), each as (forward, backward)."""

    batch: int
    points: tuple[tuple[str, ModulePoint], ...]
    plain: tuple[float, float]
    hooked: tuple[float, float]
    modules: tuple[float, float]


class _Recorder:
    """Per-module seconds of one hooked pass, and each module's FLOPs and elements per call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.forward: dict[nn.Module, float] = defaultdict(float)
        self.backward: dict[nn.Module, float] = defaultdict(float)
        self.calls: dict[nn.Module, int] = defaultdict(int)
        self.size: dict[nn.Module, tuple[float, float]] = {}
        self._start: dict[nn.Module, float] = {}
        self._grad_start: dict[nn.Module, float] = {}
        self._open: nn.Module | None = None  # a backward whose end is the next event

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def close(self, now: float) -> None:
        """End the backward of a module whose input needs no gradient: its full backward hook
        fires before its weight gradient is computed, so it ends at the next event."""
        if self._open is not None:
            self.backward[self._open] += now - self._grad_start.pop(self._open)
            self._open = None

    def pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self._start[module] = self.now()

    def post(self, module: nn.Module, args: tuple[object, ...], out: object) -> None:
        self.forward[module] += self.now() - self._start.pop(module)
        self.calls[module] += 1
        if module not in self.size and isinstance(out, torch.Tensor):
            read = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
            flops = out.shape[0] * weight_flops(module, out[0])
            self.size[module] = (flops, float(read + out.numel()))

    def grad_pre(self, module: nn.Module, grad_out: object) -> None:
        now = self.now()
        self.close(now)
        self._grad_start[module] = now

    def grad_post(self, module: nn.Module, grad_in: tuple[object, ...], grad_out: object) -> None:
        now = self.now()
        self.close(now)
        if all(g is None for g in grad_in):
            self._open = module
        else:
            self.backward[module] += now - self._grad_start.pop(module)


def _leaves(net: nn.Module) -> list[nn.Module]:
    return [m for m in net.modules() if not list(m.children())]


def _pass(net: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """(forward s, backward s) of one pass of ``net`` on ``x``."""
    device = x.device
    synchronize(device)
    start = time.perf_counter()
    out = net(x)
    synchronize(device)
    middle = time.perf_counter()
    with warnings.catch_warnings():  # the first module's input needs no gradient
        warnings.simplefilter("ignore", UserWarning)
        out.backward(grad)
    synchronize(device)
    end = time.perf_counter()
    net.zero_grad(set_to_none=True)
    return middle - start, end - middle


def _hooked_pass(
    net: nn.Module, x: torch.Tensor, grad: torch.Tensor, recorder: _Recorder, backward: bool
) -> tuple[float, float]:
    """One pass with the forward hooks, or with the backward hooks (``backward``): a full
    backward hook wraps the module's input and output in autograd functions during the
    forward, which would count in the forward's times."""
    handles = []
    for module in _leaves(net):
        if backward:
            handles += [
                module.register_full_backward_pre_hook(recorder.grad_pre),
                module.register_full_backward_hook(recorder.grad_post),
            ]
        else:
            handles += [
                module.register_forward_pre_hook(recorder.pre),
                module.register_forward_hook(recorder.post),
            ]
    try:
        seconds = _pass(net, x, grad)
        recorder.close(recorder.now())
    finally:
        for handle in handles:
            handle.remove()
    return seconds


def _not_inplace(net: nn.Module) -> nn.Module:
    """A copy of ``net`` whose modules do not work in place (full backward hooks need it)."""
    out = copy.deepcopy(net)
    for module in out.modules():
        if hasattr(module, "inplace"):
            setattr(module, "inplace", False)  # noqa: B010 (a module attribute)
    return out


def time_in_pass(
    net: nn.Module,
    shape: tuple[int, ...],
    batches: Sequence[int],
    device: torch.device,
    passes: int = _PASSES,
) -> list[PassTiming]:
    """``net``'s leaf modules timed in its own passes on inputs of ``shape`` (batch
    excluded) at each of ``batches``, on ``device``, in training mode: ``passes`` pairs of a
    pass without hooks and one with them, after ``_WARMUP`` passes."""
    net = _not_inplace(net).to(device).train()
    leaves = _leaves(net)
    out = []
    for batch in batches:
        x = torch.randn(batch, *shape, device=device)
        with torch.no_grad():
            grad = torch.randn_like(net(x))
        for _ in range(_WARMUP):
            _pass(net, x, grad)
        plain, hooked, records = [], [], []
        for _ in range(passes):
            plain.append(_pass(net, x, grad))
            recorder = _Recorder(device)
            forward = _hooked_pass(net, x, grad, recorder, backward=False)[0]
            backward = _hooked_pass(net, x, grad, recorder, backward=True)[1]
            hooked.append((forward, backward))
            records.append(recorder)
        timed = [m for m in leaves if m in records[0].size]  # called, on a tensor
        total_calls = sum(records[0].calls[m] for m in timed)
        plain_s, hooked_s = _median2(plain), _median2(hooked)
        hook_s = max(0.0, hooked_s[1] - plain_s[1]) / max(total_calls, 1)
        points = []
        for module in timed:
            calls = records[0].calls[module]
            flops, elements = records[0].size[module]
            forward = statistics.median(r.forward[module] for r in records) / calls
            backward = statistics.median(r.backward[module] for r in records) / calls - hook_s
            point = (flops, elements, max(forward, _MIN_S), max(backward, _MIN_S))
            points += [(module_kind(module), point)] * calls  # the pass's calls, each one
        sums = [(sum(r.forward.values()), sum(r.backward.values())) for r in records]
        out.append(PassTiming(batch, tuple(points), plain_s, hooked_s, _median2(sums)))
    return out


def _median2(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def points_by_kind(timings: Sequence[PassTiming]) -> dict[str, list[ModulePoint]]:
    """Every in-pass point of ``timings``, by module kind."""
    out: dict[str, list[ModulePoint]] = defaultdict(list)
    for timing in timings:
        for kind, point in timing.points:
            out[kind].append(point)
    return dict(out)


def pass_error(fits: dict[str, ModuleFit], timings: Sequence[PassTiming]) -> float:
    """How far ``fits`` price the whole passes of ``timings`` from the passes timed without
    hooks: the mean over batches, forward and backward, of |log(priced / measured)| (0: exact;
    0.18: about 20 % off). A kind without a fit prices 0."""
    errors = []
    for timing in timings:
        priced = [0.0, 0.0]
        for kind, (flops, elements, _, _) in timing.points:
            if kind in fits:
                forward, backward = fits[kind].seconds(flops, elements)
                priced[0], priced[1] = priced[0] + forward, priced[1] + backward
        for got, measured in zip(priced, timing.plain, strict=True):
            errors.append(abs(math.log(max(got, _MIN_S) / measured)))
    return statistics.fmean(errors)
