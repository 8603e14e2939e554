"""Real layers timed on a device: the rate curves a calibrated profile prices layers with.

A convolution (3×3, ``c → c`` channels on 8×8 positions, batch 16) and a linear layer
(``n → n``, batch 32) at sizes from a few hundred FLOPs to about a GFLOP: each point is the
layer's forward FLOPs (as :attr:`kfac_hpc.plan.layers.LayerShape.forward_flops` counts them)
with its forward seconds, its backward seconds (input and weight gradients) and the seconds of
its K-FAC factor update from the captured input and output gradient (the code the
preconditioner's hooks run: ``KFACLayer.a_factor`` and ``g_factor``). Small layers run far
below a large GEMM's rate (launch and dispatch costs, short loops), which one GEMM rate
cannot say. And every kind of module a profile prices by its own shape
(module_fits.py): modules of each kind at shapes chosen to vary the call count, the FLOPs and
the elements apart (thin first-layer convolutions among them), each timed in its forward and
its backward, for ``plan calibrate`` to fit (with a planned model, also its modules timed in
its own passes: pass_timing.py). Also the job's optimizer update per parameter
tensor (``optimizer_tensor_s``): on a CPU its update loops over the tensors, and a small
model's update is mostly that loop. And what the K-FAC preconditioner's forward hook adds to
a forward per layer (``kfac_forward_layer_s``), and what its ``step()`` takes beyond the
phases it times (``kfac_step_overhead_s``). And the per-element costs of what its
``factor_compute`` phase runs after the factor reduction (``factor_average_element_s``: the
running averages' update; ``finite_check_element_s``: the finiteness check; each with its
cost per tensor, ``..._tensor_s``).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.optim.factors import LayerFactors
from kfac_hpc.optim.finite import all_finite
from kfac_hpc.optim.layers import make_layer
from kfac_hpc.optim.preconditioner import KFACPreconditioner
from kfac_hpc.plan.calibrate import synchronize
from kfac_hpc.plan.layers import module_kind, weight_flops
from kfac_hpc.plan.module_fits import MODULE_KINDS, ModuleFit, ModulePoint, fit_module
from kfac_hpc.plan.pass_timing import PassTiming, pass_error, points_by_kind
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.optimizers import make_optimizer

__all__ = [
    "COMMIT_SETS",
    "CONV_CHANNELS",
    "LINEAR_WIDTHS",
    "MODULE_SAMPLES",
    "ModuleFits",
    "factor_average_costs",
    "finite_check_costs",
    "kfac_forward_layer_s",
    "kfac_step_overhead_s",
    "layer_curve",
    "model_samples",
    "module_fits",
    "module_points",
    "optimizer_tensor_s",
    "per_call_s",
]

CONV_CHANNELS = (4, 8, 16, 32, 64, 128, 256)
LINEAR_WIDTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
_CONV_BATCH, _CONV_SIDE, _LINEAR_BATCH = 16, 8, 32
_BLOCK_S, _BLOCKS = 5e-3, 5  # each point: the median of 5 blocks of at least 5 ms
_TENSORS, _TENSOR_ELEMENTS = 64, 64  # the optimizer's many-small-tensors update

Point = tuple[float, float, float, float]  # forward FLOPs, forward s, backward s, factor s


def per_call_s(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call of ``fn``: the median over blocks of at least ``_BLOCK_S`` seconds
    (after one warm-up call), the device synchronized around each block."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    calls = max(1, math.ceil(_BLOCK_S / max(time.perf_counter() - start, 1e-9)))
    times = []
    for _ in range(_BLOCKS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
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


_HOOK_LAYERS, _HOOK_WIDTH, _HOOK_BATCH, _HOOK_ROUNDS = 8, 16, 16, 100


def kfac_forward_layer_s(device: torch.device) -> float:
    """Seconds the K-FAC preconditioner's forward hook adds per layer to a forward on a
    factor step (it keeps the layer's input and registers a hook on its output: Python work a
    layer, whatever its size): a chain of small linear layers' forward with the
    preconditioner registered minus without it (medians over interleaved passes, each
    followed by its backward and step), over the layers (>= 0)."""

    def chain() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(_HOOK_WIDTH, _HOOK_WIDTH) for _ in range(_HOOK_LAYERS)]
        return nn.Sequential(*layers).to(device)

    plain, hooked = chain(), chain()
    preconditioner = KFACPreconditioner(
        hooked, factor_update_steps=1, inv_update_steps=_HOOK_ROUNDS + 2
    )  # factors every step (the hook captures), one inverse
    x = torch.randn(_HOOK_BATCH, _HOOK_WIDTH, device=device)
    times: dict[int, list[float]] = {0: [], 1: []}
    for round_ in range(_HOOK_ROUNDS + 2):
        for index, net in enumerate((plain, hooked)):
            synchronize(device)
            start = time.perf_counter()
            out = net(x)
            synchronize(device)
            if round_ >= 2:  # the first passes warm up
                times[index].append(time.perf_counter() - start)
            out.sum().backward()
            if index:
                preconditioner.step()  # ends the factor step (untimed)
    added = statistics.median(times[1]) - statistics.median(times[0])
    return max(0.0, added / _HOOK_LAYERS)


_OVERHEAD_WARMUP, _OVERHEAD_STEPS, _OVERHEAD_INVERSE_EVERY = 20, 200, 10


def kfac_step_overhead_s(device: torch.device) -> float:
    """Seconds per step the K-FAC preconditioner's ``step()`` takes beyond the phases it
    times (the job's ``other`` under K-FAC: its bookkeeping between the timed blocks): job-like
    steps of the hook's chain of small linear layers (forward, backward, the preconditioner's
    step, the job's optimizer), factors every step and inverses every 10; the mean over steps
    (the job's phases are means: its occasional slow step counts) of ``step()`` minus its
    ``last_timings`` (>= 0). A process of its own ranks: no collective runs."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(_HOOK_WIDTH, _HOOK_WIDTH) for _ in range(_HOOK_LAYERS)))
    net = net.to(device)
    preconditioner = KFACPreconditioner(
        net, factor_update_steps=1, inv_update_steps=_OVERHEAD_INVERSE_EVERY
    )
    optimizer = make_optimizer(TrainConfig(), net)
    x = torch.randn(_HOOK_BATCH, _HOOK_WIDTH, device=device)
    outside = []
    for step in range(_OVERHEAD_WARMUP + _OVERHEAD_STEPS):
        out = net(x)
        optimizer.zero_grad(set_to_none=True)
        out.sum().backward()
        synchronize(device)
        start = time.perf_counter()
        preconditioner.step()
        synchronize(device)
        took = time.perf_counter() - start
        if step >= _OVERHEAD_WARMUP:
            outside.append(took - sum(preconditioner.last_timings.values()))
        optimizer.step()
    return max(0.0, statistics.fmean(outside))


# (tensors, side) of the factor sets the commit is timed on: many small factors to one large
# one, so that the cost of a tensor and that of an element come apart
COMMIT_SETS = ((32, 8), (16, 32), (8, 64), (4, 256), (1, 1024))


def _factors(count: int, side: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` symmetric factors of ``side`` (the batch statistics a step folds in)."""
    generator = torch.Generator().manual_seed(side)
    out = []
    for _ in range(count):
        m = torch.randn(side, side, generator=generator).to(device)
        out.append(m @ m.T / side)
    return out


def _commit_s(steps: list[torch.Tensor], device: torch.device) -> float:
    """Seconds of the preconditioner's commit of ``steps`` into running averages, factor after
    factor (``LayerFactors.commit``: ``lerp`` toward the step's factor, into a new tensor, with
    the job's decay)."""
    decay = float(OPTIONS["factor_decay"].default)
    running = [LayerFactors() for _ in steps]
    for factors, step in zip(running, steps, strict=True):  # the first commit starts them
        factors.set_pending("A", step.clone(), 1)
        factors.commit(decay, keep_g=False)

    def commit() -> None:
        for factors, step in zip(running, steps, strict=True):
            factors.set_pending("A", step, 1)
            factors.commit(decay, keep_g=False)

    return per_call_s(commit, device)


def _check_s(tensors: list[torch.Tensor], device: torch.device) -> float:
    """Seconds of the preconditioner's finiteness check of ``tensors`` (``all_finite``: a
    summing pass a tensor, one host sync)."""
    return per_call_s(partial(all_finite, tensors), device)


def _tensor_costs(
    seconds: Callable[[list[torch.Tensor], torch.device], float], device: torch.device
) -> tuple[float, float]:
    """(seconds per tensor, seconds per element) of ``seconds`` over the sets of COMMIT_SETS:
    each set's time per tensor fitted as ``tensor + elements · element`` (module_fits.py's
    non-negative least squares of the relative error)."""
    points = []
    for count, side in COMMIT_SETS:
        each = seconds(_factors(count, side, device), device) / count
        points.append((0.0, float(side * side), each, each))
    tensor, _, element = fit_module(points).forward
    return tensor, element


def factor_average_costs(device: torch.device) -> tuple[float, float]:
    """(s per tensor, s per element) of the running averages' update as the preconditioner
    commits a step's factors."""
    return _tensor_costs(_commit_s, device)


def finite_check_costs(device: torch.device) -> tuple[float, float]:
    """(s per tensor, s per element) of the preconditioner's finiteness check of a step's
    factors and gradients."""
    return _tensor_costs(_check_s, device)


Sample = tuple[Callable[[], nn.Module], tuple[int, ...]]  # a module's factory, its input shape
# per kind: modules and inputs (batch first) whose FLOPs and elements vary apart
MODULE_SAMPLES: dict[str, tuple[Sample, ...]] = {
    "conv": tuple(
        (partial(nn.Conv2d, cin, cout, 3, padding=1), (batch, cin, side, side))
        for cin, cout, side, batch in (
            (1, 16, 8, 16),
            (1, 16, 8, 128),
            (3, 16, 32, 16),
            (16, 32, 8, 16),
            (16, 32, 8, 128),
            (32, 32, 8, 64),
            (32, 64, 16, 16),
            (64, 64, 8, 32),
            (64, 128, 16, 16),
            (128, 128, 8, 16),
            (256, 256, 8, 16),
        )
    ),
    "linear": tuple(
        (partial(nn.Linear, n_in, n_out), (batch, n_in))
        for n_in, n_out, batch in (
            (16, 16, 32),
            (64, 10, 128),
            (512, 64, 128),
            (128, 128, 32),
            (256, 256, 64),
            (512, 512, 32),
            (1024, 1024, 32),
            (2048, 2048, 32),
        )
    ),
    "batchnorm": tuple(
        (partial(nn.BatchNorm2d, c), (batch, c, side, side))
        for batch, c, side in ((16, 16, 8), (128, 32, 8), (16, 64, 16), (64, 64, 32))
    ),
    "layernorm": tuple(
        (partial(nn.LayerNorm, d), (batch, d))
        for batch, d in ((32, 64), (256, 256), (512, 512), (2048, 1024))
    ),
    "activation": tuple(
        (nn.ReLU, (batch, c, side, side))
        for batch, c, side in ((16, 16, 8), (128, 32, 8), (64, 64, 16), (64, 64, 32))
    ),
    "pool": tuple(
        (partial(nn.MaxPool2d, 3, 2, 1), (batch, c, side, side))
        for batch, c, side in ((16, 16, 8), (128, 32, 8), (64, 64, 16), (32, 64, 56))
    ),
    "adaptive_pool": tuple(
        (partial(nn.AdaptiveAvgPool2d, out), (batch, c, side, side))
        for out, batch, c, side in (
            (4, 16, 32, 8),
            (4, 128, 32, 8),
            (1, 64, 64, 16),
            (1, 16, 256, 8),
            (4, 64, 16, 32),
        )
    ),
    "view": tuple(
        (nn.Flatten, (batch, c, side, side))
        for batch, c, side in ((16, 32, 4), (128, 32, 4), (64, 64, 8))
    ),
}


def _module_point(module: nn.Module, x: torch.Tensor) -> ModulePoint:
    """(FLOPs, elements, forward s, backward s) of ``module`` on ``x`` in training mode."""
    device = x.device
    module.train()
    x = x.requires_grad_(True)
    with torch.no_grad():
        out = module(x)
    grad = torch.randn_like(out)
    forward = per_call_s(lambda: module(x), device)
    both = per_call_s(lambda: module(x).backward(grad), device)
    flops = x.shape[0] * weight_flops(module, out[0])
    elements = x.numel() + out.numel()
    # the backward is the difference of two medians: noise can make it tiny, never <= 0
    return flops, float(elements), forward, max(both - forward, 0.05 * forward)


def module_points(samples: Sequence[Sample], device: torch.device) -> list[ModulePoint]:
    """The measured points of ``samples`` on ``device``."""
    points = []
    for make, shape in samples:
        module = make().to(device)
        points.append(_module_point(module, torch.randn(*shape, device=device)))
    return points


def _copy_of(module: nn.Module) -> nn.Module:
    """A copy of ``module`` that does not work in place (its input is a leaf)."""
    out = copy.deepcopy(module)
    if hasattr(out, "inplace"):
        setattr(out, "inplace", False)  # noqa: B010 (a module attribute torch types as a tensor)
    return out


def model_samples(
    net: nn.Module, shape: tuple[int, ...], batches: Sequence[int]
) -> list[tuple[str, Sample]]:
    """Every leaf module of ``net`` (its input ``shape``, batch excluded) by kind, with the
    input it gets, at each of ``batches`` (modules of a non-floating input left out)."""
    found: list[tuple[nn.Module, tuple[int, ...]]] = []
    handles = []
    for module in net.modules():
        if not list(module.children()):

            def hook(mod: nn.Module, args: tuple[object, ...], out: object) -> None:
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    found.append((mod, tuple(x.shape[1:])))

            handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        net(torch.zeros(1, *shape))
    for handle in handles:
        handle.remove()
    return [(module_kind(m), (partial(_copy_of, m), (b, *s))) for b in batches for m, s in found]


@dataclass(frozen=True)
class ModuleFits:
    """The kind fits a profile gets (``fits``), which points made them (``source``: ``alone``,
    each module timed by itself in a tight loop; ``in-pass``, the model's modules timed in its
    own passes, the kinds it lacks from the alone points), each source's error on the model's
    whole passes (:func:`~kfac_hpc.plan.pass_timing.pass_error`), the passes timed, and the
    other source's fits (for comparison)."""

    fits: dict[str, ModuleFit]
    source: str
    errors: dict[str, float]
    timings: tuple[PassTiming, ...] = ()
    other: dict[str, ModuleFit] = field(default_factory=dict)  # the source not kept

    def notes(self) -> list[str]:
        """Comment lines for a profile: the source kept, each source's error, and per batch
        the whole pass without and with hooks and the modules' sum (ms, forward/backward)."""
        if not self.errors:
            return ["# points: each module alone in a tight loop"]
        scores = ", ".join(f"{name} {error:.3f}" for name, error in self.errors.items())
        lines = [
            f"# points: {self.source} (mean |log(priced / measured)| of the model's whole passes:"
            f" {scores})"
        ]
        for t in self.timings:
            ms = [f"{a * 1e3:.3g}/{b * 1e3:.3g}" for a, b in (t.plain, t.hooked, t.modules)]
            lines.append(
                f"# batch {t.batch}: pass {ms[0]} ms without hooks, {ms[1]} with, modules {ms[2]}"
            )
        name = next(n for n in self.errors if n != self.source)
        for kind, fit in self.other.items():
            row = ", ".join(f"{v:.6g}" for v in fit.row())
            lines.append(f"# {name}: {kind} = [{row}]")
        return lines


def module_fits(
    device: torch.device,
    extra: Sequence[tuple[str, Sample]] = (),
    timings: Sequence[PassTiming] = (),
) -> ModuleFits:
    """Every kind of MODULE_KINDS fitted to its points of MODULE_SAMPLES and of ``extra``
    (``(kind, sample)``: a planned model's own modules) measured alone on ``device``; with
    ``timings`` (the model's passes, :func:`~kfac_hpc.plan.pass_timing.time_in_pass`) also
    fitted to the in-pass points, and the source that prices the whole passes closer kept."""
    alone = {}
    for kind in MODULE_KINDS:
        own = [sample for k, sample in extra if k == kind]
        alone[kind] = fit_module(module_points([*MODULE_SAMPLES[kind], *own], device))
    if not timings:
        return ModuleFits(alone, "alone", {})
    in_pass_points = points_by_kind(timings)
    in_pass = {
        kind: fit_module(in_pass_points[kind]) if kind in in_pass_points else alone[kind]
        for kind in MODULE_KINDS
    }
    candidates = {"alone": alone, "in-pass": in_pass}
    errors = {name: pass_error(fits, timings) for name, fits in candidates.items()}
    source = min(errors, key=lambda name: errors[name])
    other = candidates["in-pass" if source == "alone" else "alone"]
    return ModuleFits(candidates[source], source, errors, tuple(timings), other)
