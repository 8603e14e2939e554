"""``kfac-hpc plan calibrate``: measure a hardware profile inside an allocation.

Started on every rank of a launch (``srun -N 2 --ntasks-per-node G kfac-hpc plan calibrate
--out site.toml``, or ``mpiexec``), over the job's own process group (NCCL on GPUs, gloo on
CPUs: the same code). It measures:

- the α-β pair inside a node: broadcasts of 4 KiB … 16 MiB between ranks 0 and 1 (the same
  node; needs 2 ranks per node), and between nodes: between rank 0 and the first rank of the
  second node (needs 2 nodes). Each size is the mean of ``ROUNDS`` timed rounds after a barrier
  of the pair, fitted to ``α + β·n`` (one hop) by least squares;
- on rank 0's device: one eigendecomposition (``torch.linalg.eigh``, the preconditioner's) at
  each size of ``eigh_sizes`` (median of 3), the sustained GEMM rate (square FP32 products),
  the elementwise rate (a copy), real layers' curves and the module kinds' fits
  (layer_rates.py; with ``model``, fitted over that model's own modules too, timed alone and
  inside its own passes, pass_timing.py: the points that price its whole passes closer kept);
- over the launch's ranks: the compute slowdown when one rank a node and every rank compute
  at once, and the wait of a collective after compute (calibrate.py's sync rounds) over
  those sets; on rank 0, the job's own overhead (overhead.py's 1-rank run on ``dataset``);

and rank 0 writes a profile ``plan --hardware site.toml`` reads. What it cannot measure it
says in the file: NICs per node (0: one per rank; edit it if ranks share NICs), the device's
memory (the device's total; on a CPU, the node's memory over its ranks).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.contracts.atomic import write_bytes_atomic
from kfac_hpc.plan.alphabeta import AlphaBeta, fit_alpha_beta
from kfac_hpc.plan.calibrate import (
    SYNC_BYTES,
    fit_wait,
    gemm_s,
    sync_reps,
    sync_rounds,
    synchronize,
)
from kfac_hpc.plan.layer_rates import (
    factor_average_costs,
    finite_check_costs,
    kfac_forward_layer_s,
    kfac_step_overhead_s,
    layer_curve,
    model_samples,
    module_fits,
    optimizer_tensor_s,
)
from kfac_hpc.plan.layers import INPUTS, build_network
from kfac_hpc.plan.overhead import (
    JobOverhead,
    job_optimizer_tensor_s,
    measure_job_overhead,
    one_process_env,
)
from kfac_hpc.plan.pass_timing import time_in_pass
from kfac_hpc.plan.placement import price_s
from kfac_hpc.plan.profiles import NetworkProfile
from kfac_hpc.runtime.process_group import init_distributed

__all__ = ["EIGH_SIZES", "MESSAGE_BYTES", "ROUNDS", "calibrate_site", "profile_text"]

MESSAGE_BYTES = (4 * 2**10, 64 * 2**10, 1 * 2**20, 16 * 2**20)
EIGH_SIZES = (64, 128, 256, 512, 1024, 2048)
ROUNDS = 20
_GEMM_N = 1024
_COPY_BYTES = 64 * 2**20
_CONCURRENCY_ROUNDS, _CONCURRENCY_REPS = 10, 10
OVERHEAD_BATCH = 64  # the batch of the 1-rank run that measures the job's own overhead
MODEL_BATCHES = (16, 64)  # the batches a planned model's own modules are timed at


def _timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``fn`` (after one warm-up call), the device synchronized."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pair_link(pair: tuple[int, int], device: torch.device) -> AlphaBeta | None:
    """α-β of one hop between the two ranks of ``pair`` (broadcasts from the first); every
    rank calls it (the pair's group is made collectively), the pair's ranks measure; None on
    the others."""
    group = dist.new_group(list(pair))
    if dist.get_rank() not in pair:
        return None
    samples = []
    for nbytes in MESSAGE_BYTES:
        buf = torch.ones(nbytes // 4, device=device)
        times = []
        for round_ in range(ROUNDS + 1):
            dist.barrier(group=group)
            synchronize(device)
            start = time.perf_counter()
            dist.broadcast(buf, pair[0], group=group)
            synchronize(device)
            if round_:
                times.append(time.perf_counter() - start)
        samples.append(("broadcast", 2, float(nbytes), statistics.fmean(times)))
    fit = fit_alpha_beta(samples)
    if fit.beta_s_per_byte > 0:
        return fit
    # noise hid the bandwidth term (the fit clamped it to 0): the largest message's time
    # beyond the latency, or all of it, bounds it
    _, _, largest, seconds = samples[-1]
    beyond = seconds - fit.alpha_s
    return AlphaBeta(fit.alpha_s, (beyond if beyond > 0 else seconds) / largest)


def _kfac_costs(device: torch.device) -> tuple[float, float]:
    """``(kfac_forward_layer_s, kfac_step_overhead_s)`` measured in a fresh process of one
    thread: the preconditioner they register builds process groups (collective over the
    launch's ranks) when one is initialized, and only rank 0 measures."""
    if not (dist.is_available() and dist.is_initialized()):
        return kfac_forward_layer_s(device), kfac_step_overhead_s(device)
    code = (
        "import torch; from kfac_hpc.plan.layer_rates import kfac_forward_layer_s, "
        "kfac_step_overhead_s; torch.set_num_threads(1); "
        f"d = torch.device({str(device)!r}); print(kfac_forward_layer_s(d), "
        "kfac_step_overhead_s(d))"
    )
    env = {**one_process_env(os.environ), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(f"timing K-FAC's hook and step failed: {out.stderr.strip()[-500:]}")
    hook, step = map(float, out.stdout.split()[-2:])
    return hook, step


def _device_rates(
    device: torch.device, sizes: Sequence[int], model: str | None = None, dataset: str = ""
) -> dict[str, object]:
    """Eigendecomposition seconds at ``sizes``, GEMM FLOP/s, elementwise bytes/s, the layer
    curves, the optimizer's cost per tensor, K-FAC's hook and step costs, the per-tensor
    and per-element costs of its factor commit and the module kinds' fits (over ``model``'s own
    modules on ``dataset``'s input too, when given)."""
    curve = []
    for n in sizes:
        m = torch.randn(n, n, device=device)
        spd = m @ m.T + n * torch.eye(n, device=device)
        curve.append([n, _timed(partial(torch.linalg.eigh, spd), device)])
    a = torch.randn(_GEMM_N, _GEMM_N, device=device)
    gemm = 2 * _GEMM_N**3 / _timed(lambda: a @ a, device, 5)
    src = torch.ones(_COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    copy = 2 * _COPY_BYTES / _timed(lambda: dst.copy_(src), device, 5)
    curves = {f"{kind}_curve": layer_curve(kind, device) for kind in ("conv", "linear")}
    optimizer = optimizer_tensor_s(device)
    hook, kfac_step = _kfac_costs(device)
    average, check = factor_average_costs(device), finite_check_costs(device)
    extra, timings = [], []
    if model is not None:
        net = build_network(model, dataset)
        extra = model_samples(net, INPUTS[dataset][0], MODEL_BATCHES)
        timings = time_in_pass(net, INPUTS[dataset][0], MODEL_BATCHES, device)
    fits = module_fits(device, extra, timings)
    modules = {kind: fit.row() for kind, fit in fits.fits.items()}
    return {
        "eigh_curve": curve,
        "gemm": gemm,
        "copy": copy,
        "optimizer": optimizer,
        "kfac_forward_layer": hook,
        "kfac_step_overhead": kfac_step,
        "factor_average_tensor": average[0],
        "factor_average_element": average[1],
        "finite_check_tensor": check[0],
        "finite_check_element": check[1],
        "modules": modules,
        "module_notes": fits.notes(),
        **curves,
    }


def _groups(world: int, per_node: int) -> list[list[int]]:
    """The rank sets the launch's concurrency is measured on: one rank per node, then every
    rank (distinct sizes >= 2; ranks are placed ``per_node`` to a node in rank order)."""
    out: list[list[int]] = []
    for members in (list(range(0, world, per_node)), list(range(world))):
        if len(members) >= 2 and all(len(members) != len(m) for m in out):
            out.append(members)
    return out


def _slowdown_curve(groups: list[list[int]], device: torch.device) -> list[list[float]]:
    """``[ranks, slowdown]`` of compute when that many ranks compute at once: identical work
    (a 32-channel convolution's forward and backward, warmed up on every rank) on each rank
    of the set, its mean over the set's ranks; the median over ``_CONCURRENCY_ROUNDS``
    rounds (the sets in turn, so that a change in the host's load meets them all) over that
    of rank 0 alone. Collective."""
    module = nn.Conv2d(32, 32, 3, padding=1).to(device)
    x = torch.randn(16, 32, 8, 8, device=device, requires_grad=True)
    grad = torch.ones(16, 32, 8, 8, device=device)

    def work() -> None:
        for _ in range(_CONCURRENCY_REPS):
            module(x).backward(grad)
        synchronize(device)

    work()
    rank, sets = dist.get_rank(), [[0], *groups]
    seconds: list[list[float]] = [[] for _ in sets]
    for _ in range(_CONCURRENCY_ROUNDS):
        for members, times in zip(sets, seconds, strict=True):
            dist.barrier()
            took = torch.zeros(1, dtype=torch.float64, device=device)
            if rank in members:
                start = time.perf_counter()
                work()
                took[0] = time.perf_counter() - start
            dist.all_reduce(took)
            times.append(float(took.item()) / len(members))
    alone, *rest = (statistics.median(times) for times in seconds)
    return [[1, 1.0], *([len(m), t / alone] for m, t in zip(groups, rest, strict=True))]


def _sync_fits(
    groups: list[list[int]],
    network: NetworkProfile,
    slowdown: list[list[float]],
    device: torch.device,
) -> list[list[float]]:
    """``[ranks, a, b]`` of the wait for the other ranks over each rank set (calibrate.py's
    sync rounds: T of GEMM work, then an allreduce of SYNC_BYTES): the round's mean minus the
    compute at the measured slowdown and minus the profile's own price of that allreduce
    (so that the model's collective plus its wait is the measured round). Collective."""
    unit = gemm_s(device) if dist.get_rank() == 0 else 0.0
    gemm = torch.tensor([unit], dtype=torch.float64, device=device)
    dist.broadcast(gemm, 0)
    reps = sync_reps(float(gemm.item()))
    factor = dict((int(p), s) for p, s in slowdown)
    fits = []
    for members in groups:
        group = dist.new_group(members)
        mine = dist.get_rank() in members
        rows = sync_rounds(len(members), reps, group, device) if mine else []
        dist.barrier()
        ranks = len(members)
        lockstep = price_s(network, "allreduce", SYNC_BYTES, range(ranks))
        if rows:
            a, b = fit_wait(rows, factor.get(ranks, 1.0), lockstep)
            fits.append([ranks, a, b])
    return fits


def _memory_bytes(device: torch.device, ranks_per_node: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / ranks_per_node


def _rows(rows: Sequence[Sequence[float]]) -> str:
    """A TOML array of numeric rows (integers kept integers)."""
    return "[" + ", ".join("[" + ", ".join(f"{v:.6g}" for v in row) + "]" for row in rows) + "]"


@dataclass(frozen=True)
class SiteHost:
    """What calibrate measures of the job on this allocation beyond rates and links: the
    compute slowdown by ranks computing at once, the waits' fits, and the job's own
    overhead (measured on ``dataset``)."""

    slowdown_curve: list[list[float]]
    sync: list[list[float]]
    job: JobOverhead
    dataset: str

    def machine_lines(self) -> list[str]:
        return [
            f"slowdown_curve = {_rows(self.slowdown_curve)}",
            f"# step_overhead_s, data_s_per_sample: a 1-rank run on {self.dataset}",
            f"step_overhead_s = {self.job.step_s:.6g}",
            f"data_s_per_sample = {self.job.data_s_per_sample:.6g}",
        ]


def profile_text(
    device_name: str,
    rates: dict[str, object],
    memory_bytes: float,
    ranks_per_node: int,
    backend: str,
    intra: AlphaBeta | None,
    inter: AlphaBeta | None,
    cores: int,
    host: SiteHost | None = None,
    model: str | None = None,
) -> str:
    """The TOML of a measured profile (a link not measured takes the other's values, said in
    a comment); the layer curves and module fits when ``rates`` has them (``model``: the
    model whose own modules the fits include); ``host``'s measurements when given."""
    intra_link = intra or inter
    inter_link = inter or intra
    assert intra_link is not None and inter_link is not None
    curve = ", ".join(f"[{n}, {t:.6g}]" for n, t in rates["eigh_curve"])  # type: ignore[attr-defined]
    n_last, t_last = rates["eigh_curve"][-1]  # type: ignore[index]
    eigh_rate = 9.0 * n_last**3 / t_last
    notes = []
    if intra is None:
        notes.append("# network.intra: not measured (one rank per node): the inter-node values")
    if inter is None:
        notes.append("# network.inter: not measured (one node): the intra-node values")
    kind = _link_kind(backend)
    lines = [
        "# Written by `kfac-hpc plan calibrate` (measured; see docs/plan.md).",
        "# nics_per_node is not measured: 0 means one NIC per rank; set it if ranks share NICs.",
        f"# network.intra.kind is assumed ({kind}).",
        *notes,
        "",
        "[machine]",
        f'device = "{device_name}"',
        f"gemm_flops_per_s = {rates['gemm']:.6g}",
        f"eigh_flops_per_s = {max(1e6, eigh_rate):.6g}",
        f"eigh_curve = [{curve}]",
        f"memory_bytes_per_s = {rates['copy']:.6g}",
        f"memory_bytes = {memory_bytes:.6g}",
        f"cores_per_node = {cores}",
        f"threads_per_rank = {min(cores, torch.get_num_threads()) if cores else 1}",
        *(
            f"{key} = {_rows(rates[key])}"  # type: ignore[arg-type]
            for key in ("conv_curve", "linear_curve")
            if key in rates
        ),
        *(
            [
                "# optimizer_tensor_s: from the 1-rank run's optimizer phase (timed back to "
                f"back: {rates['optimizer_alone']:.6g})"
            ]
            if "optimizer_alone" in rates
            else []
        ),
        *([f"optimizer_tensor_s = {rates['optimizer']:.6g}"] if "optimizer" in rates else []),
        *(
            [f"kfac_forward_layer_s = {rates['kfac_forward_layer']:.6g}"]
            if "kfac_forward_layer" in rates
            else []
        ),
        *(
            [f"kfac_step_overhead_s = {rates['kfac_step_overhead']:.6g}"]
            if "kfac_step_overhead" in rates
            else []
        ),
        *(
            f"{key}_s = {rates[key]:.6g}"
            for key in (
                "factor_average_tensor",
                "factor_average_element",
                "finite_check_tensor",
                "finite_check_element",
            )
            if key in rates
        ),
        *(host.machine_lines() if host else []),
        *_module_lines(rates.get("modules"), model, rates.get("module_notes", [])),
        "",
        "[network]",
        f"ranks_per_node = {ranks_per_node}",
        "nics_per_node = 0",
        f'backend = "{backend}"',
        *([f"sync = {_rows(host.sync)}"] if host and host.sync else []),
        "",
        "[network.intra]",
        f'kind = "{kind}"',
        f"latency_s = {intra_link.alpha_s:.6g}",
        f"bandwidth_bytes_per_s = {intra_link.bandwidth_bytes_per_s:.6g}",
        "",
        "[network.inter]",
        f"latency_s = {inter_link.alpha_s:.6g}",
        f"bandwidth_bytes_per_s = {inter_link.bandwidth_bytes_per_s:.6g}",
    ]
    return "\n".join(lines) + "\n"


def _module_lines(modules: object, model: str | None, notes: object) -> list[str]:
    """The ``[machine.modules]`` table of ``modules`` (kind -> 6 coefficients), if any, after
    the comment lines ``notes`` (which points made it)."""
    if not isinstance(modules, dict):
        return []
    over = f", {model}'s own among them" if model else ""
    return [
        "",
        "# module kinds priced by their own shape: seconds = per call + FLOPs * per FLOP +",
        "# elements * per element, forward then backward; fitted to real modules timed here",
        f"# (layer_rates.py{over})",
        *(notes if isinstance(notes, list) else []),
        "[machine.modules]",
        *(f"{kind} = {_rows([row])[1:-1]}" for kind, row in modules.items()),
    ]


def _link_kind(backend: str) -> str:
    return "nvlink" if backend == "nccl" else "shm"


def _shared_network(
    intra: AlphaBeta | None,
    inter: AlphaBeta | None,
    per_node: int,
    backend: str,
    device: torch.device,
) -> NetworkProfile:
    """The network the profile will hold, on every rank (rank 0 measured both pairs; a link
    not measured takes the other's values, as in the file). Collective."""
    links = [intra or inter, inter or intra]
    values = [v for ab in links if ab for v in (ab.alpha_s, ab.beta_s_per_byte)]
    shared = torch.tensor(values if len(values) == 4 else [0.0] * 4, dtype=torch.float64)
    shared = shared.to(device)
    dist.broadcast(shared, 0)
    a, b = AlphaBeta(*map(float, shared[:2].cpu())), AlphaBeta(*map(float, shared[2:].cpu()))
    return NetworkProfile("site", per_node, a, b, backend=backend, intra_link=_link_kind(backend))


def calibrate_site(
    out: Path,
    backend: str | None = None,
    eigh_sizes: Sequence[int] = EIGH_SIZES,
    dataset: str = "digits",
    model: str | None = None,
) -> str | None:
    """Measure and (on rank 0) write the profile to ``out``; returns its text on rank 0
    (``dataset``: the input pipeline the job's overhead is measured on; ``model``: a model
    whose own modules, on ``dataset``'s input, the module fits include).
    RuntimeError when the launch has neither 2 ranks on a node nor 2 nodes."""
    ctx = init_distributed(backend)
    world, nodes = ctx.world_size, ctx.launch.num_nodes
    per_node = world // nodes
    if per_node < 2 and nodes < 2:
        raise RuntimeError(
            "calibrate needs 2 ranks on a node or 2 nodes (srun -N 2 --ntasks-per-node G)"
        )
    intra = _pair_link((0, 1), ctx.device) if per_node >= 2 else None
    inter = _pair_link((0, per_node), ctx.device) if nodes >= 2 else None
    network = _shared_network(intra, inter, per_node, ctx.backend, ctx.device)
    groups = _groups(world, per_node)
    slowdown = _slowdown_curve(groups, ctx.device)
    sync = _sync_fits(groups, network, slowdown, ctx.device)
    text = None
    if ctx.rank == 0:
        job = measure_job_overhead(dataset, OVERHEAD_BATCH)
        host = SiteHost(slowdown, sync, job, dataset)
        rates = _device_rates(ctx.device, eigh_sizes, model, dataset)
        if job.optimizer_s > 0:  # the job's update in its own steps, not back to back
            rates["optimizer_alone"] = rates["optimizer"]
            rates["optimizer"] = job_optimizer_tensor_s(job, dataset, float(rates["copy"]))  # type: ignore[arg-type]
        name = (
            torch.cuda.get_device_name(ctx.device)
            if ctx.device.type == "cuda"
            else f"CPU ({os.cpu_count()} cores)"
        )
        cores = 0 if ctx.device.type == "cuda" else (os.cpu_count() or 1)
        memory = _memory_bytes(ctx.device, per_node)
        text = profile_text(
            name, rates, memory, per_node, ctx.backend, intra, inter, cores, host, model
        )
        write_bytes_atomic(out, text.encode("utf-8"), durable=True)
    dist.barrier()
    return text
