"""Per-layer compute time: from a machine profile's rates, or measured on this machine.

Both sources answer the same questions (seconds, on one rank): forward and backward of the
whole model at a local batch, one layer's factor update, the factor commit (running averages
and finiteness check) over counts of tensors and elements, one eigendecomposition of size n,
one layer's preconditioning, and the optimizer's update of all parameters.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple, Protocol

import torch
from torch import nn

from kfac_hpc.optim.layers import KFACLayer, make_layer
from kfac_hpc.plan.layer_rates import factor_average_costs, finite_check_costs
from kfac_hpc.plan.layers import INPUTS, LayerShape, ModelShape, ModuleCost, build_network
from kfac_hpc.plan.profiles import MachineProfile
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.optimizers import make_optimizer

__all__ = [
    "AVERAGE_BYTES",
    "CHECK_BYTES",
    "ComputeCosts",
    "MeasuredCompute",
    "RatedCompute",
    "Tensors",
    "layer_kind",
]

# FP32 traffic per element of the factor commit: the running averages' ``lerp`` reads the
# running and the step's factor and writes the new one; the finiteness check's sum reads it
AVERAGE_BYTES, CHECK_BYTES = 3 * 4, 4


class Tensors(NamedTuple):
    """``number`` tensors of ``elements`` elements in all (means over ranks: fractional)."""

    number: float
    elements: float


class ComputeCosts(Protocol):
    """``kfac``: with the K-FAC preconditioner's hooks on the model (they capture and, on
    factor steps, reduce the layer inputs and output gradients). ``factor_commit_s``: the
    preconditioner's commit of a step's factors after their reduction, the running averages'
    update over the ``averaged`` tensors and the finiteness check over the ``checked``."""

    def forward_backward_s(self, batch: int, kfac: bool = False) -> tuple[float, float]: ...
    def factor_s(self, layer: LayerShape, batch: int) -> float: ...
    def factor_commit_s(self, averaged: Tensors, checked: Tensors) -> float: ...
    def eigh_s(self, n: int) -> float: ...
    def layer_eigh_s(self, layer: LayerShape) -> float: ...
    def precondition_s(self, layer: LayerShape) -> float: ...
    def optimizer_s(self, batch: int) -> float: ...
    def kfac_overhead_s(self, batch: int) -> float: ...


def layer_kind(layer: LayerShape) -> str:
    """``conv`` for a layer of several output positions per sample, else ``linear`` (the
    curve of a profile that prices it)."""
    return "conv" if layer.rows > 1 else "linear"


class RatedCompute:
    """FLOPs (and bytes) divided by the profile's sustained rates, plus a launch overhead per
    kernel. Backward = 2 × forward (input and weight gradients)."""

    def __init__(self, machine: MachineProfile, shape: ModelShape) -> None:
        self.machine, self.shape = machine, shape

    def forward_backward_s(self, batch: int, kfac: bool = False) -> tuple[float, float]:
        """With the profile's module fits: every module of the model priced by its kind's fit
        at its own FLOPs and elements (:meth:`_module_s`). Without: each K-FAC layer from the
        profile's measured curve of its kind, else its FLOPs at the GEMM rate (backward =
        2 × forward), plus the elementwise layers' traffic. With ``kfac``, each layer's factor
        update (:meth:`factor_s`) in the backward (the hooks compute the factors there) and
        its forward hook's measured cost in the forward."""
        m = self.machine
        if m.modules and self.shape.modules:
            forward = backward = 0.0
            for module in self.shape.modules:
                f, b = self._module_s(module, batch)
                forward, backward = forward + f, backward + b
        else:
            # elementwise layers (norms, activations) read and write every activation once
            elementwise = batch * self.shape.activations_per_sample * 8 / m.memory_bytes_per_s
            forward, backward = elementwise, 2 * elementwise
            for layer in self.shape.layers:
                f, b = self._layer_s(layer_kind(layer), batch * layer.forward_flops)
                forward, backward = forward + f, backward + b
        if kfac:
            forward += len(self.shape.layers) * m.kfac_forward_layer_s
            backward += sum(self.factor_s(layer, batch) for layer in self.shape.layers)
        return forward, backward

    def _layer_s(self, kind: str, flops: float) -> tuple[float, float]:
        """A ``kind`` layer of ``flops`` from the profile's curve, else the GEMM rate."""
        m = self.machine
        measured = m.layer_s(kind, flops)
        if measured is None:
            rated = flops / m.gemm_flops_per_s + m.kernel_overhead_s
            return rated, 2 * rated
        return measured[0], measured[1]

    def _module_s(self, module: ModuleCost, batch: int) -> tuple[float, float]:
        """One module at ``batch``: its kind's fit; a kind the profile does not fit as
        without fits (a weight layer by its curve or the GEMM rate, any other module its
        elements read or written once at the memory rate, twice in the backward)."""
        fit = self.machine.module_fit(module.kind)
        if fit is not None:
            return fit.seconds(batch * module.flops, batch * module.elements)
        if module.kind in ("conv", "linear"):
            return self._layer_s(module.kind, batch * module.flops)
        traffic = batch * module.elements * 4 / self.machine.memory_bytes_per_s
        return traffic, 2 * traffic

    def factor_s(self, layer: LayerShape, batch: int) -> float:
        """From the profile's curve of the layer's kind (its factor column), else its
        factor FLOPs at the GEMM rate plus two kernel launches."""
        measured = self.machine.layer_s(layer_kind(layer), batch * layer.forward_flops)
        if measured is not None:
            return measured[2]
        return batch * layer.factor_flops / self.machine.gemm_flops_per_s + (
            2 * self.machine.kernel_overhead_s
        )

    def factor_commit_s(self, averaged: Tensors, checked: Tensors) -> float:
        """At the profile's measured seconds per tensor and per element
        (``factor_average_*``, ``finite_check_*``), else a kernel launch per tensor and the
        elements' traffic at the memory rate."""
        m = self.machine
        average = (
            m.factor_average_tensor_s or m.kernel_overhead_s,
            m.factor_average_element_s or AVERAGE_BYTES / m.memory_bytes_per_s,
        )
        check = (
            m.finite_check_tensor_s or m.kernel_overhead_s,
            m.finite_check_element_s or CHECK_BYTES / m.memory_bytes_per_s,
        )
        return _priced(averaged, average) + _priced(checked, check)

    def eigh_s(self, n: int) -> float:
        return self.machine.eigh_s(n)

    def layer_eigh_s(self, layer: LayerShape) -> float:
        return (self.eigh_s(layer.n_a) + self.eigh_s(layer.n_g)) * layer.groups

    def precondition_s(self, layer: LayerShape) -> float:
        # Q_Gᵀ G Q_A, divide by the eigenvalue outer product, Q_G (·) Q_Aᵀ
        flops = 4.0 * layer.groups * layer.n_a * layer.n_g * (layer.n_a + layer.n_g)
        return flops / self.machine.gemm_flops_per_s + 5 * self.machine.kernel_overhead_s

    def optimizer_s(self, batch: int) -> float:
        # SGD with momentum: read weight, grad, momentum; write weight, momentum (FP32); the
        # same at every batch; + the measured cost per parameter tensor (0 when not measured)
        traffic = 5 * 4 * self.shape.params / self.machine.memory_bytes_per_s
        return traffic + self.machine.optimizer_tensor_s * self.shape.param_tensors

    def kfac_overhead_s(self, batch: int) -> float:
        """The preconditioner's host bookkeeping outside its phases: the profile's measured
        ``kfac_step_overhead_s`` (0 when not measured)."""
        return self.machine.kfac_step_overhead_s


_WARMUP_STEPS = 3  # the job's first steps pay one-time costs (allocator growth, dispatch)
_MIN_STEPS, _MAX_STEPS = 9, 200
_MIN_TIMED_S = 3.0  # at least this long timed: one short burst on a shared host is noise


def _median_s(fn: Callable[[], object], rounds: int = 5) -> float:
    fn()  # warm-up (allocator, first-call dispatch)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


StepRecord = tuple[float, float, dict[str, float]]  # forward s, backward s, the update's timings


def _job_steps(
    net: nn.Module,
    in_shape: tuple[int, ...],
    classes: int,
    batch: int,
    update: Callable[[], dict[str, float]],
) -> list[StepRecord]:
    """Consecutive training steps as ``TrainStep`` runs them: a new batch every step, the
    forward, gradients set to None, the backward, then ``update`` (the method's step: it
    returns its own timings). The warm-up steps are dropped; at least ``_MIN_STEPS`` and
    ``_MIN_TIMED_S`` seconds are timed (medians of a longer stretch, like the job's windows)."""
    net.train()
    loss_fn = nn.CrossEntropyLoss()
    data = [(torch.randn(batch, *in_shape), torch.randint(0, classes, (batch,))) for _ in range(4)]
    records: list[StepRecord] = []
    timed_s = 0.0
    step = 0
    while step < _MAX_STEPS and (len(records) < _MIN_STEPS or timed_s < _MIN_TIMED_S):
        x, y = data[step % len(data)]
        start = time.perf_counter()
        loss = loss_fn(net(x), y)
        mid = time.perf_counter()
        net.zero_grad(set_to_none=True)
        loss.backward()
        end = time.perf_counter()
        timings = update()
        if step >= _WARMUP_STEPS:
            records.append((mid - start, end - mid, timings))
            timed_s += time.perf_counter() - start
        step += 1
    return records


def _job_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    """The job's optimizer under its default options (SGD with momentum and L2)."""
    return make_optimizer(TrainConfig(), net)


def _fb_medians(records: list[StepRecord]) -> tuple[float, float]:
    return statistics.median(r[0] for r in records), statistics.median(r[1] for r in records)


class MeasuredCompute:
    """Times the real operations of the real model on this machine's CPU with
    ``threads`` threads per rank (what ``OMP_NUM_THREADS`` gives each rank).

    Per-layer operations are timed one by one (eigh, preconditioning), then scaled so that
    their sums equal the phase totals the real ``KFACPreconditioner`` reports over a few steps
    of the real model: the split over layers comes from the micro-timings, the level from the
    real code (its bookkeeping included). Likewise the factor commit, from its per-element
    costs, to the real ``factor_compute`` phase. A layer's factor update (from captured
    tensors) is its own timing: with the factors computed in the backward hooks the real
    phase holds no factor GEMMs to scale it to.
    """

    def __init__(self, shape: ModelShape, threads: int = 1, seed: int = 0) -> None:
        self.shape, self.threads = shape, threads
        self._shapes = shape.layers
        torch.manual_seed(seed)
        in_shape, classes = INPUTS[shape.dataset]
        self.net = build_network(shape.model, shape.dataset)
        self.in_shape, self.classes = in_shape, classes
        self.kfac: dict[str, KFACLayer] = {}
        for name, module in self.net.named_modules():
            layer = make_layer(name or type(module).__name__, module)
            if layer is not None:
                self.kfac[layer.name] = layer
        self._fb: dict[tuple[int, bool], tuple[float, float]] = {}
        self._kfac_totals: dict[int, dict[str, float]] = {}
        self._factor: dict[tuple[str, int], float] = {}
        self._eigh: dict[int, float] = {}
        self._precondition: dict[str, float] = {}
        self._optimizer: dict[int, float] = {}  # the update after a step at each batch
        # (s per tensor, s per element) of the running averages' update, of the check
        self._commit: tuple[tuple[float, float], tuple[float, float]] | None = None

    def _threads(self) -> _Threads:
        return _Threads(self.threads)

    def forward_backward_s(self, batch: int, kfac: bool = False) -> tuple[float, float]:
        if (batch, kfac) not in self._fb:
            with self._threads():
                if kfac:
                    self._fb[(batch, True)] = self._measure_kfac(batch)
                else:
                    self._fb[(batch, False)] = self._measure_batch(batch)
        return self._fb[(batch, kfac)]

    def _measure_kfac(self, batch: int) -> tuple[float, float]:
        """Steps of the real model with the real preconditioner (factor and inverse updates
        every step): forward/backward with its hooks, and its own phase timings."""
        from kfac_hpc.optim.preconditioner import KFACPreconditioner

        net = copy.deepcopy(self.net)
        pre = KFACPreconditioner(net, factor_update_steps=1, inv_update_steps=1)
        opt = _job_optimizer(net)

        def update() -> dict[str, float]:
            start = time.perf_counter()
            pre.step()
            timings = dict(pre.last_timings)
            timings["untimed"] = time.perf_counter() - start - sum(pre.last_timings.values())
            opt.step()
            return timings

        records = _job_steps(net, self.in_shape, self.classes, batch, update)
        pre.remove_hooks()
        self._kfac_totals[batch] = {
            k: statistics.median(r[2][k] for r in records)
            for k in ("factor_compute", "inverse_compute", "precondition", "untimed")
        }
        return _fb_medians(records)

    def _scale(self, batch: int, phase: str, micro: list[float]) -> float:
        """Real phase total / sum of the micro-timings (1 before K-FAC was measured)."""
        self.forward_backward_s(batch, kfac=True)
        total = sum(micro)
        return self._kfac_totals[batch][phase] / total if total > 0 else 1.0

    def _measure_batch(self, batch: int) -> tuple[float, float]:
        net = copy.deepcopy(self.net)
        opt = _job_optimizer(net)

        def update() -> dict[str, float]:
            start = time.perf_counter()
            opt.step()
            return {"optimizer": time.perf_counter() - start}

        records = _job_steps(net, self.in_shape, self.classes, batch, update)
        self._optimizer[batch] = statistics.median(r[2]["optimizer"] for r in records)
        x = torch.randn(batch, *self.in_shape)
        y = torch.randint(0, self.classes, (batch,))
        captured = self._capture(x, y, nn.CrossEntropyLoss())
        for name, (a, g) in captured.items():
            layer = self.kfac[name]
            self._factor[(name, batch)] = _median_s(partial(_factors, layer, a, g))
        return _fb_medians(records)

    def _capture(
        self, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every K-FAC layer's input and output gradient of one training pass."""
        inputs: dict[str, torch.Tensor] = {}
        grads: dict[str, torch.Tensor] = {}

        def hook(
            module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, key: str
        ) -> None:
            inputs[key] = args[0].detach()
            out.register_hook(lambda g: grads.__setitem__(key, g.detach()))

        handles = [
            layer.module.register_forward_hook(lambda m, a, o, k=name: hook(m, a, o, k))
            for name, layer in self.kfac.items()
        ]
        self.net.zero_grad()
        loss_fn(self.net(x), y).backward()
        for handle in handles:
            handle.remove()
        return {k: (inputs[k], grads[k]) for k in inputs}

    def factor_s(self, layer: LayerShape, batch: int) -> float:
        self.forward_backward_s(batch)
        return self._factor[(layer.name, batch)]

    def factor_commit_s(self, averaged: Tensors, checked: Tensors) -> float:
        """The per-tensor and per-element costs timed here (layer_rates.py), scaled to the
        real phase: the real preconditioner on one rank averages every factor and checks
        every factor and gradient."""
        if self._commit is None:
            with self._threads():
                cpu = torch.device("cpu")
                self._commit = factor_average_costs(cpu), finite_check_costs(cpu)
        average, check = self._commit
        factors = Tensors(2 * len(self._shapes), sum(k.factor_elements for k in self._shapes))
        every = Tensors(factors.number + self.shape.param_tensors,
                        factors.elements + self.shape.params)  # fmt: skip
        whole = _priced(factors, average) + _priced(every, check)
        scale = self._scale(self._reference_batch(), "factor_compute", [whole])
        return (_priced(averaged, average) + _priced(checked, check)) * scale

    def _reference_batch(self) -> int:
        """A batch at which the real preconditioner was measured (for batch-free phases)."""
        return min(self._kfac_totals) if self._kfac_totals else 1

    def layer_eigh_s(self, layer: LayerShape) -> float:
        shapes = [(k.n_a, k.n_g, k.groups) for k in self.kfac.values()]
        micro = [(self.eigh_s(a) + self.eigh_s(g)) * n for a, g, n in shapes]
        own = (self.eigh_s(layer.n_a) + self.eigh_s(layer.n_g)) * layer.groups
        return own * self._scale(self._reference_batch(), "inverse_compute", micro)

    def eigh_s(self, n: int) -> float:
        if n not in self._eigh:
            with self._threads():
                m = torch.randn(n, n)
                spd = m @ m.T + n * torch.eye(n)
                self._eigh[n] = _median_s(lambda: torch.linalg.eigh(spd))
        return self._eigh[n]

    def _precondition_micro(self, layer: LayerShape) -> float:
        if layer.name not in self._precondition:
            with self._threads():
                qa, qg = torch.randn(layer.n_a, layer.n_a), torch.randn(layer.n_g, layer.n_g)
                grad = torch.randn(layer.n_g, layer.n_a)
                outer = torch.rand(layer.n_g, layer.n_a) + 1

                def apply() -> torch.Tensor:
                    return qg @ ((qg.T @ grad @ qa) / outer) @ qa.T

                self._precondition[layer.name] = _median_s(apply)
        return self._precondition[layer.name]

    def precondition_s(self, layer: LayerShape) -> float:
        micro = [self._precondition_micro(k) for k in self._shapes]
        scale = self._scale(self._reference_batch(), "precondition", micro)
        return self._precondition_micro(layer) * scale

    def kfac_overhead_s(self, batch: int) -> float:
        """The real preconditioner's step minus the phases it reports (its bookkeeping)."""
        self.forward_backward_s(batch, kfac=True)
        return max(0.0, self._kfac_totals[batch]["untimed"])

    def optimizer_s(self, batch: int) -> float:
        """The job's optimizer update right after a job-like step at ``batch`` (timed in the
        consecutive steps of :meth:`forward_backward_s`): the caches then hold the step's
        activations, not the optimizer's state, as in the job. Timed back to back on the same
        gradients instead, the small CNN's update read 0.08 ms against 0.2 ms in the job."""
        self.forward_backward_s(batch)
        return self._optimizer[batch]


def _priced(tensors: Tensors, costs: tuple[float, float]) -> float:
    """Seconds of ``tensors`` at ``costs`` (s per tensor, s per element)."""
    return tensors.number * costs[0] + tensors.elements * costs[1]


def _factors(layer: KFACLayer, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One factor update of ``layer`` from its captured input and output gradient."""
    return layer.a_factor(a, torch.float32), layer.g_factor(g, 1.0, torch.float32)


class _Threads:
    """Run a block with ``n`` intra-op threads, restoring the previous count after."""

    def __init__(self, n: int) -> None:
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(max(1, min(self.n, os.cpu_count() or 1)))

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)
