"""Memory per GPU: the bytes a rank holds at the peak of a training step, from the same
allocations the job makes.

Sizes come from the model's real layers built on the meta device (no memory, no data): its
parameters, the tensors autograd saves for the backward pass at the local batch (found with
``saved_tensors_hooks``, each storage counted once), each module's output, and the K-FAC layers
as ``kfac_hpc.optim.layers`` makes them. Where K-FAC data lives follows the preconditioner's
own :class:`~kfac_hpc.comm.assignment.KAISAAssignment` (running factors on every rank under
COMM-OPT, else on their inverse worker; eigenvectors, eigenvalues and their outer product on
the layer's grad workers). The step is walked as the job runs it (``kfac_hpc.train.step``):

- *forward end*: parameters, optimizer state, K-FAC state, last step's gradients (freed only
  after the forward pass, ``zero_grad(set_to_none=True)``), the batch and the saved tensors;
- *backward*: module by module in reverse, its saved tensors freed after it, its gradients
  allocated, the output and input gradients it holds, and on a K-FAC layer the factor work of
  its hook (the im2col or width-unfolded chunk buffer of :mod:`kfac_hpc.optim.conv_rows` /
  ``layers._moments``, the products, the pending statistics of every layer before it and,
  reduced to owners, their packed triangles);
- *after backward*: gradients, the flat gradient buffer of the allreduce (P > 1), the factor
  statistics and their allreduce buckets in flight (COMM-OPT), the eigendecomposition of the
  largest factor a rank owns, the preconditioned gradients;
- FOSI / DHO2: V, velocity, base state and the non-finite check's zeros sharded over
  coordinates, the Lanczos basis in ``fosi_lanczos_dtype`` (held between ESEs too with
  ``fosi_keep_basis``) and a Hessian-vector product's graph on the curvature batch (the leading
  ``fosi_curvature_fraction`` of the local batch) during an ESE.

A device adds its CUDA context and library workspaces (``[memory]`` table of a profile): the
bytes the process holds outside the allocator's tensors. See docs/plan.md, "Memory per GPU".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kfac_hpc.comm.assignment import KAISAAssignment
from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.contracts.textfile import read_user_text
from kfac_hpc.contracts.workload_names import BUILTIN_MODELS
from kfac_hpc.optim.factor_reduction import OWNER_BUCKET_CAP_MB, OWNER_IN_FLIGHT_MB
from kfac_hpc.optim.fosi.curvature_batch import subset_size
from kfac_hpc.optim.fosi.options import lanczos_basis_dtype, lanczos_steps
from kfac_hpc.optim.layers import Conv2dLayer, KFACLayer, make_layer
from kfac_hpc.optim.options import KFACOptions
from kfac_hpc.plan.errors import PlanInputError, shown
from kfac_hpc.plan.layers import INPUTS, build_network, check_fit
from kfac_hpc.plan.profiles import ProfileField, _value, builtin_profiles, tomllib

__all__ = [
    "MEMORY_FIELDS",
    "DeviceMemory",
    "MemoryConfig",
    "MemoryModel",
    "StepMemory",
    "basis_element_bytes",
    "device_memory",
    "factor_copies",
    "preconditioner_assignment",
]

_F32 = 4
_MIB = 2**20
# the job's CPU chunk budgets and GPU per-sample product budget (kfac_hpc/optim/layers.py)
_CPU_CHUNK_BYTES = 4 << 20
_CUDA_CHUNK_BYTES = 64 << 20

MEMORY_FIELDS: tuple[ProfileField, ...] = (
    ProfileField("memory", "capacity_bytes", "float", 2**20, 1e15, unit="B"),
    ProfileField("memory", "context_bytes", "float", 0.0, 1e12, 0.0, "B"),
    ProfileField("memory", "workspace_bytes", "float", 0.0, 1e12, 0.0, "B"),
)


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory (the ``[memory]`` table): ``capacity_bytes`` usable by the process,
    ``context_bytes`` the CUDA context takes of it, ``workspace_bytes`` the libraries'
    workspaces (cuBLAS, cuDNN, NCCL), none of which the allocator's tensors count;
    ``cuda``: the job's GPU code paths (whole-batch unfolding) instead of its CPU chunks."""

    capacity_bytes: float
    context_bytes: float = 0.0
    workspace_bytes: float = 0.0
    cuda: bool = True


def device_memory(name_or_path: str) -> DeviceMemory | None:
    """The ``[memory]`` table of a profile (shipped name or TOML path), or None when it has
    none. PlanInputError (field ``profile``) naming the file and the key when one is bad."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        text = read_user_text(Path(name_or_path), "hardware", error=PlanInputError)
    elif name_or_path in builtin_profiles():
        text = (resources.files("kfac_hpc.plan") / "profiles" / f"{name_or_path}.toml").read_text()
    else:
        raise PlanInputError("hardware", f"{name_or_path!r} is not a shipped profile")
    try:
        table = tomllib.loads(text).get("memory")
    except (tomllib.TOMLDecodeError, RecursionError):
        raise PlanInputError("hardware", f"{shown(name_or_path)} is not valid TOML") from None
    if table is None:
        return None
    try:
        if not isinstance(table, dict):
            raise PlanInputError("memory", "must be a table")
        known = {f.key for f in MEMORY_FIELDS}
        for key in table:
            if key not in known:
                raise PlanInputError(f"memory.{key}", f"unknown key; valid: {', '.join(known)}")
        capacity, context, workspace = (_value(table, f) for f in MEMORY_FIELDS)
        return DeviceMemory(capacity, context, workspace)
    except PlanInputError as exc:
        raise PlanInputError(
            "hardware", f"{shown(name_or_path)}: {exc.field}: {exc.reason}"
        ) from None


@dataclass(frozen=True)
class MemoryConfig:
    """One point: ``method`` (sgd, kfac-comm-opt, kfac-hybrid-opt, kfac-mem-opt, fosi) at
    ``ranks`` ranks with ``local_batch`` samples per rank; the rest as ``kfac-hpc train``."""

    method: str
    ranks: int
    local_batch: int
    optimizer: str = str(OPTIONS["optimizer"].default)
    momentum: float = float(OPTIONS["momentum"].default)
    fosi_k: int = int(OPTIONS["fosi_k"].default)
    fosi_l: int = int(OPTIONS["fosi_l"].default)
    lanczos_iters: int | None = OPTIONS["lanczos_iters"].default
    grad_worker_fraction: float | None = None  # None: the strategy's (comm-opt 1, ...)
    fosi_keep_basis: bool = bool(OPTIONS["fosi_keep_basis"].default)
    fosi_lanczos_dtype: str = str(OPTIONS["fosi_lanczos_dtype"].default)
    fosi_curvature_fraction: float = float(OPTIONS["fosi_curvature_fraction"].default)

    @property
    def strategy(self) -> str | None:
        return self.method[len("kfac-") :] if self.method.startswith("kfac-") else None

    @property
    def curvature_batch(self) -> int:
        """The samples an ESE's products differentiate: the leading ⌈f · local batch⌉."""
        return subset_size(self.local_batch, self.fosi_curvature_fraction)


@dataclass(frozen=True)
class StepMemory:
    """The fullest rank's bytes at each moment of the step (``moments``), its peak, and the
    persistent parts by name (``parts``); ``device`` adds context and workspaces."""

    config: MemoryConfig
    rank: int
    moments: dict[str, float]
    parts: dict[str, float]
    device_bytes: float = 0.0

    @property
    def peak_bytes(self) -> float:
        return max(self.moments.values()) + self.device_bytes


@dataclass(frozen=True)
class _Module:
    """One leaf module of the forward pass, in forward order: its parameters' bytes, the saved
    bytes freed after its backward, its output's and input's bytes, and its K-FAC layer."""

    param_bytes: int
    freed_bytes: int
    out_bytes: int
    in_bytes: int
    layer: KFACLayer | None = None
    input_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Trace:
    modules: tuple[_Module, ...]
    batch_bytes: int  # inputs and labels not saved by any module
    other_saved: int  # saved tensors of no module (the loss)
    param_bytes: int
    layers: tuple[KFACLayer, ...] = field(default=())

    @property
    def saved_bytes(self) -> int:
        """Every tensor autograd saves for the backward pass, each storage once."""
        return sum(m.freed_bytes for m in self.modules) + self.other_saved


class MemoryModel:
    """Predicted memory per rank of ``model`` on ``dataset``'s input shape."""

    def __init__(self, model: str, dataset: str) -> None:
        if model in BUILTIN_MODELS:  # others are checked when built (build_network)
            check_fit(model, dataset)
        self.model, self.dataset = model, dataset

    def trace(self, batch: int) -> _Trace:
        return _trace(self.model, self.dataset, batch)

    def predict(self, cfg: MemoryConfig, device: DeviceMemory | None = None) -> StepMemory:
        """The fullest rank's memory for ``cfg`` (``device``: the GPU code paths, context and
        workspaces; None: this machine's CPU)."""
        cuda = device.cuda if device is not None else False
        trace = self.trace(cfg.local_batch)
        curvature = self.trace(cfg.curvature_batch) if cfg.method == "fosi" else trace
        extra = device.context_bytes + device.workspace_bytes if device is not None else 0.0
        best: StepMemory | None = None
        ranks = [0]
        assignment = None
        if cfg.strategy is not None:
            assignment = _assignment(trace, cfg)
            # ranks differ only in the K-FAC data they hold and the largest factor they
            # decompose: the fullest rank is one of those holding the most of either
            state = [_kfac_state(trace, assignment, r) for r in range(cfg.ranks)]
            ranks = sorted(
                {
                    max(range(cfg.ranks), key=lambda r: state[r][0] + state[r][1]),
                    max(range(cfg.ranks), key=lambda r: state[r][2]),
                }
            )
        for rank in ranks:
            step = _step(trace, curvature, cfg, rank, assignment, cuda, extra)
            if best is None or step.peak_bytes > best.peak_bytes:
                best = step
        assert best is not None
        return best


def _assignment(trace: _Trace, cfg: MemoryConfig) -> KAISAAssignment:
    fraction = cfg.strategy if cfg.grad_worker_fraction is None else cfg.grad_worker_fraction
    layers = {k.name: (k.n_a, k.n_g, k.groups) for k in trace.layers}
    return preconditioner_assignment(layers, cfg.ranks, fraction or "comm-opt")


def preconditioner_assignment(
    layers: Mapping[str, tuple[int, int, int]], ranks: int, fraction: str | float
) -> KAISAAssignment:
    """The KAISA assignment the preconditioner makes of ``layers`` (name: n_A, n_G, groups,
    in registration order) at ``ranks`` and grad-worker ``fraction``, under its default
    assignment options."""
    defaults = KFACOptions()
    return KAISAAssignment(
        layers, ranks, fraction, defaults.assignment_strategy, defaults.colocate_factors
    )


def _optimizer_bytes(cfg: MemoryConfig, params: float) -> float:
    """SGD: one momentum buffer (none without momentum); Adam/AdamW: two moments."""
    if cfg.optimizer in ("adam", "adamw"):
        return 2 * params
    return params if cfg.momentum > 0 else 0.0


def factor_copies(assignment: KAISAAssignment) -> int:
    """The ranks that keep each running factor: every rank when the factors are allreduced
    to all (COMM-OPT), else its decomposing worker alone (eigen method, the default)."""
    allreduced = assignment.grad_worker_count == assignment.world_size
    return assignment.world_size if allreduced else 1


def _kfac_state(trace: _Trace, assignment: KAISAAssignment, rank: int) -> tuple[float, float, int]:
    """(running factors, second-order data, the n of the largest factor this rank
    decomposes) on ``rank``: eigen method, eigenvalue outer product on (the defaults)."""
    allreduced = factor_copies(assignment) == assignment.world_size
    factors = second = 0.0
    owned: list[int] = []
    for layer in trace.layers:
        plan = assignment.plan(layer.name)
        g, n_a, n_g = layer.groups, layer.n_a, layer.n_g
        if allreduced or plan.a_worker == rank:
            factors += g * n_a * n_a * _F32
        if allreduced or plan.g_worker == rank:
            factors += g * n_g * n_g * _F32
        if rank in plan.grad_workers:
            second += g * (n_a * n_a + n_a + n_g * n_g + n_g + n_a * n_g) * _F32
        owned += [n_a] * g if plan.a_worker == rank else []
        owned += [n_g] * g if plan.g_worker == rank else []
    return factors, second, max(owned, default=0)


def _factor_work(module: _Module, batch: int, cuda: bool) -> float:
    """Bytes the hook's factor computation of one layer holds at once (A, then G)."""
    layer = module.layer
    assert layer is not None
    n_a, n_g, groups = layer.n_a, layer.n_g, layer.groups
    n_in = n_a - (1 if layer.bias is not None else 0)
    result_a = groups * (n_in * n_in + n_a * n_a) * _F32  # the moments, then A with its bias
    if isinstance(layer, Conv2dLayer):
        x, pad = _one_sample(layer, module.input_shape)
        if layer._row_shifted():
            geometry = layer._rows(x, pad)
            sample = geometry.sample_elements() * _F32
            chunk = batch if cuda else min(batch, max(1, _CPU_CHUNK_BYTES // sample))
            slots = sum(1 for _ in _slots(geometry))
            work_a = chunk * sample + slots * groups * geometry.row_width**2 * _F32
        else:
            p, q = layer._out_size(x, pad)
            sample = groups * n_in * p * q * _F32
            chunk = batch if cuda else min(batch, max(1, _CPU_CHUNK_BYTES // sample))
            work_a = chunk * sample
        per_sample = groups * n_g * n_g * _F32
        budget = _CUDA_CHUNK_BYTES if cuda else _CPU_CHUNK_BYTES
        work_g = min(batch, max(1, budget // per_sample)) * per_sample
    else:
        work_a = work_g = 0
    return max(work_a + result_a, work_g + 2 * groups * n_g * n_g * _F32)


def _one_sample(
    layer: Conv2dLayer, input_shape: tuple[int, ...]
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """A meta sample of the layer's input as its factor code sees it (Conv1d: height 1),
    padded as that code pads it."""
    return layer._padded(layer.as_batch(torch.empty(1, *input_shape, device="meta")))


def _im2col_bytes(module: _Module) -> int:
    """Bytes per sample of a convolution's im2col matrix (0 for other modules)."""
    layer = module.layer
    if not isinstance(layer, Conv2dLayer):
        return 0
    x, pad = _one_sample(layer, module.input_shape)
    p, q = layer._out_size(x, pad)
    return layer.groups * (layer.n_a - (layer.bias is not None)) * p * q * _F32


def _slots(geometry: Any) -> set[tuple[int, int]]:
    """The sums the row-shifted product keeps (one per lag and per cut kernel row)."""
    return {(lag, i) for lag, i, _, _ in geometry.products()}


def _kfac_moments(
    trace: _Trace,
    cfg: MemoryConfig,
    held: float,
    parts: dict[str, float],
    owned_n: int,
    allreduced: bool,
) -> dict[str, float]:
    """The moments of ``step()`` after the backward pass: the statistics reduced (COMM-OPT:
    every layer's; else this rank's own, rebuilt whole
    from their triangles) next to the new running factors made from them; one
    eigendecomposition (its input copied into the eigenvector output and LAPACK's syevd
    workspace, 1 + 6n + 2n² floats); the gradient matrix and
    the preconditioned gradient of every layer (they meet in the KL clip)."""
    factor_total = sum(k.groups * (k.n_a**2 + k.n_g**2) * _F32 for k in trace.layers)
    if allreduced:
        statistics = float(factor_total)  # the buckets were written back and freed in wait()
    else:
        triangles = factor_total / 2
        statistics = parts["kfac_factors"] + min(
            triangles, (OWNER_BUCKET_CAP_MB + OWNER_IN_FLIGHT_MB) * _MIB
        )
    n = owned_n
    preconditioned = sum(k.groups * k.n_a * k.n_g * _F32 for k in trace.layers)
    return {
        "factor_commit": held + statistics + parts["kfac_factors"],
        "eigendecomposition": held + (3 * n * n + 7 * n + 1) * _F32,
        "precondition": held + 2 * preconditioned,
    }


def basis_element_bytes(lanczos_dtype: str) -> int:
    """Bytes of one coordinate of the Lanczos basis in ``lanczos_dtype`` (float64: 8;
    training: the parameters' float32, 4)."""
    return lanczos_basis_dtype(lanczos_dtype, torch.float32).itemsize


def _basis_bytes(cfg: MemoryConfig, shard: int) -> float:
    """This rank's Lanczos basis: m rows of its ``shard`` coordinates in the basis' dtype."""
    steps = lanczos_steps(cfg.fosi_k, cfg.fosi_l, cfg.lanczos_iters)
    return float(steps * shard * basis_element_bytes(cfg.fosi_lanczos_dtype))


def _step(
    trace: _Trace,
    curvature: _Trace,
    cfg: MemoryConfig,
    rank: int,
    assignment: KAISAAssignment | None,
    cuda: bool,
    device_bytes: float,
) -> StepMemory:
    params = float(trace.param_bytes)
    grads = params
    optimizer = _optimizer_bytes(cfg, params)
    parts: dict[str, float] = {"parameters": params, "gradients": grads, "optimizer": optimizer}
    kfac = assignment is not None
    owned_n = 0
    if kfac:
        assert assignment is not None
        factors, second, owned_n = _kfac_state(trace, assignment, rank)
        parts["kfac_factors"], parts["kfac_second_order"] = factors, second
    if cfg.method == "fosi":
        n = params / _F32
        shard = math.ceil(n / cfg.ranks)
        pairs = cfg.fosi_k + cfg.fosi_l
        parts["optimizer"] = _optimizer_bytes(cfg, shard * _F32)
        parts["fosi_vectors"] = pairs * shard * _F32
        parts["fosi_velocity"] = shard * _F32
        parts["fosi_finite_probe"] = shard * _F32  # the zeros of the non-finite check
        if cfg.fosi_keep_basis:  # the Lanczos basis, resident between ESEs
            parts["fosi_lanczos_basis"] = _basis_bytes(cfg, shard)
    held = sum(parts.values())
    saved = trace.saved_bytes
    moments = {"forward_end": held + trace.batch_bytes + saved}
    # backward: module by module in reverse; the previous step's gradients are gone
    base = held - grads + trace.batch_bytes
    live_saved = float(saved - trace.other_saved)
    grads_done = 0.0
    pending = 0.0
    allreduced = kfac and assignment is not None and assignment.grad_worker_count == cfg.ranks
    backward = 0.0
    for module in reversed(trace.modules):
        grads_done += module.param_bytes
        work = float(module.out_bytes + module.in_bytes)
        stats = 0
        if kfac and module.layer is not None:
            work += _factor_work(module, cfg.local_batch, cuda)
            layer = module.layer
            stats = layer.groups * (layer.n_a**2 + layer.n_g**2) * _F32
        backward = max(backward, base + live_saved + grads_done + pending + work)
        # COMM-OPT keeps every pending sum (and, over ranks, its bucket in flight); toward an
        # owner only packed triangles travel, at most the owner buckets at a time
        pending += stats * (2 if cfg.ranks > 1 else 1) if allreduced else 0.0
        live_saved -= module.freed_bytes
    moments["backward"] = backward
    if kfac:
        moments.update(_kfac_moments(trace, cfg, held, parts, owned_n, allreduced))
    if cfg.ranks > 1 and cfg.method != "fosi":
        moments["grad_allreduce"] = held + params
    if cfg.method == "fosi":
        shard = math.ceil(params / _F32 / cfg.ranks)
        basis = 0.0 if cfg.fosi_keep_basis else _basis_bytes(cfg, shard)
        # an ESE: the Lanczos basis (already held with fosi_keep_basis); the double-backward
        # Hessian-vector product (the default route) on the curvature batch holds its forward's
        # saved tensors and the gradient's graph (2 × saved) and full-length vectors (the
        # gradient, the gathered Lanczos vector, the product and the rest: 6 × the parameters'
        # bytes). Whole counts read from measured ESEs of the MLP, resnet20 and the small CNN
        # (docs/plan.md), not line by line from the code; the forward-over-reverse route (not
        # modelled) read 3 × saved and 7 × the parameters.
        # On a CPU the product's convolutions unfold their input (PyTorch's slow_conv2d keeps
        # an im2col buffer): the largest convolution's adds n_in x output positions per sample.
        unfold = 0 if cuda else max((_im2col_bytes(m) for m in trace.modules), default=0)
        graph = 2 * curvature.saved_bytes
        moments["ese"] = held + basis + graph + 6 * params + unfold * cfg.curvature_batch
    return StepMemory(cfg, rank, moments, parts, device_bytes)


@lru_cache(maxsize=32)
def _trace(model: str, dataset: str, batch: int) -> _Trace:
    """One forward pass of ``model`` on the meta device at ``batch``: per leaf module its
    parameters, the saved tensors freed after its backward (each storage once, with the
    module that saved it first in forward order: the last to use it in backward), its
    output and input bytes and K-FAC layer."""
    shape = INPUTS[dataset][0]
    with torch.device("meta"):
        net = build_network(model, dataset)
    leaves = [(n, m) for n, m in net.named_modules() if not list(m.children())]
    current = [-1]
    owner: dict[int, tuple[int, int]] = {}  # id(base) -> (module index, bytes)
    keep: list[torch.Tensor] = []
    outs: dict[int, tuple[int, int, tuple[int, ...]]] = {}

    params = {id(p) for p in net.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t
        while base._base is not None:
            base = base._base
        if id(base) not in owner and id(base) not in params:  # weights are counted once
            keep.append(base)
            owner[id(base)] = (current[0], base.numel() * base.element_size())
        return t

    def pre(index: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        current[0] = index

    def post(index: int, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        size = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
        outs[index] = (size, 0 if x is None else x.numel() * x.element_size(),
                       () if x is None else tuple(x.shape[1:]))  # fmt: skip
        current[0] = -1

    handles = []
    for index, (_, module) in enumerate(leaves):
        handles.append(module.register_forward_pre_hook(lambda m, a, i=index: pre(i, m, a)))
        handles.append(module.register_forward_hook(lambda m, a, o, i=index: post(i, m, a, o)))
    x = torch.empty(batch, *shape, device="meta")
    y = torch.empty(batch, dtype=torch.long, device="meta")
    net.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nn.functional.cross_entropy(net(x), y)
    for handle in handles:
        handle.remove()
    freed = [0] * len(leaves)
    other = 0
    for index, size in owner.values():
        if index < 0:
            other += size
        else:
            freed[index] += size
    batch_bytes = sum(t.numel() * t.element_size() for t in (x, y) if id(t) not in owner)
    modules = []
    layers = []
    for index, (name, module) in enumerate(leaves):
        layer = make_layer(name or type(module).__name__, module)
        if layer is not None:
            layers.append(layer)
        out_bytes, in_bytes, in_shape = outs.get(index, (0, 0, ()))
        params = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        modules.append(_Module(params, freed[index], out_bytes, in_bytes, layer, in_shape))
    total = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    return _Trace(tuple(modules), batch_bytes, other, total, tuple(layers))
