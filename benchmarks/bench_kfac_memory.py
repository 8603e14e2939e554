"""Per-rank K-FAC memory at 4 ranks under COMM-OPT, HYBRID-OPT and MEM-OPT (CIFAR ResNet-32).

One command: ``.venv/bin/python benchmarks/bench_kfac_memory.py`` starts itself as 4 real ranks
(``mpiexec -n 4``, gloo, CPU) and, side by side in that one job:

1. memory from real allocations, ``--rounds`` rounds (3) after one discarded warm-up round
   (the process's first-use costs, e.g. gloo's and LAPACK's buffers, would otherwise count for
   whichever strategy runs first), each strategy in turn, the order rotating per round:
   ResNet-32 (batch 16 per rank = 64 global, 32x32x3 inputs) with its gradients allocated; the
   process's resident set
   (``VmRSS``) and the peak of one plain forward/backward (``VmHWM`` after a reset through
   ``/proc/self/clear_refs``) are the baseline; the preconditioner is built and runs warm-up
   steps (factors and eigendecompositions every step); then *steady state* = VmRSS after a step
   minus the baseline VmRSS (factors, second-order data, caches, process groups), and *peak* =
   VmHWM over one whole K-FAC step (forward, backward with the factor hooks, ``step()``) minus
   the plain step's peak: transient factor sums, buckets, receive buffers and decomposition
   workspaces included. glibc serves every allocation >= 128 KiB by mmap
   (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set. Per strategy: median
   (min, max) over rounds of the max over ranks, and the ratios to COMM-OPT;
   ``memory_usage()`` (the tensors the preconditioner keeps) is printed beside it;
2. times the factor reduction of the ResNet-32 factor shapes with ``FactorAllreducer``: a full
   allreduce in 25 MiB buckets and unbucketed, the upper-triangle allreduce, and a reduce of
   each factor only to its MEM-OPT inverse worker as MEM-OPT does it (triangles, owner buckets
   of 1 MiB open and 1 MiB in flight, the owner rebuilding each mean);
3. times the MEM-OPT gradient broadcast (every layer's gradient from its owner to all ranks)
   with one broadcast per layer and with ``AsyncBroadcaster``'s per-owner buckets.

Prints the ratios and writes benchmarks/results/bench_kfac_memory.json. Target: peak K-FAC
memory under MEM-OPT <= 0.3x that of COMM-OPT (max over ranks; ``--check``: exit 1 when
missed).
"""

from __future__ import annotations

import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py, beside this script
from memprobe import reset_peak as _reset_peak  # benchmarks/memprobe.py, beside this script
from memprobe import status_bytes as _status_bytes

WORLD_SIZE = 4
STRATEGIES = ("comm-opt", "hybrid-opt", "mem-opt")
PER_RANK_BATCH = 16
WARMUP_STEPS = 2
ROUNDS = 3
MIB = 1024 * 1024
REPEATS = 5
MMAP_THRESHOLD = 128 * 1024
TARGET = 0.3  # peak K-FAC memory, MEM-OPT / COMM-OPT


def measure_strategy(strategy: str, rank: int) -> dict[str, Any]:
    """Steady-state and peak bytes K-FAC adds on this rank under ``strategy`` (see above),
    its ``memory_usage()`` and the mean K-FAC phase seconds of the measured step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from kfac_hpc.optim import KFACPreconditioner
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.workloads import build_model

    torch.manual_seed(0)
    model = build_model(TrainConfig(model="resnet32"), (3, 32, 32), 10)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(PER_RANK_BATCH, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (PER_RANK_BATCH,), generator=gen)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()

    forward_backward()  # gradients allocated
    dist.barrier()
    _reset_peak()
    forward_backward()
    plain_peak = _status_bytes("VmHWM")
    gc.collect()
    base_rss = _status_bytes("VmRSS")
    kfac = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=1, grad_worker_fraction=strategy
    )
    for _ in range(WARMUP_STEPS):
        forward_backward()
        kfac.step()
    dist.barrier()
    _reset_peak()
    forward_backward()
    kfac.step()
    peak = _status_bytes("VmHWM")
    gc.collect()
    steady = _status_bytes("VmRSS")
    result = {
        "peak_bytes": peak - plain_peak,
        "steady_bytes": steady - base_rss,
        "memory_usage": kfac.memory_usage(),
        "phases_s": dict(kfac.last_timings),
        "shapes": {n: [list(t) for t in layer.factor_shapes] for n, layer in kfac.layers.items()},
    }
    kfac.remove_hooks()
    del kfac
    gc.collect()
    return result


def time_reduction(
    factors: dict[str, Any], owners: dict[str, int] | None, symmetric: bool, cap_mb: float = 25.0
) -> float:
    """Median seconds of one bucketed reduction of all factors; to ``owners`` (if given) as
    MEM-OPT reduces them: owner buckets bounded open and in flight, the owner rebuilding the
    whole mean from its packed triangle."""
    import torch.distributed as dist

    from kfac_hpc.comm import FactorAllreducer
    from kfac_hpc.optim.factor_reduction import OWNER_BUCKET_CAP_MB, OWNER_IN_FLIGHT_MB

    samples = []
    for _ in range(REPEATS):
        reducer = FactorAllreducer(cap_mb, None, symmetric, OWNER_BUCKET_CAP_MB, OWNER_IN_FLIGHT_MB)
        dist.barrier()
        start = time.perf_counter()
        for name, tensor in factors.items():
            if owners is None:
                reducer.submit(name, tensor)
            else:
                reducer.submit(name, tensor, dst=owners[name], write_back=False)
        reducer.wait()
        for name in reducer.arrived:
            reducer.take(name)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_grad_broadcast(grads: dict[str, Any], owners: dict[str, int], cap_mb: float) -> float:
    """Median seconds to broadcast every layer's gradient from its MEM-OPT owner to all."""
    import torch.distributed as dist

    from kfac_hpc.comm import AsyncBroadcaster

    samples = []
    for _ in range(REPEATS):
        broadcaster = AsyncBroadcaster(bucket_cap_mb=cap_mb)
        dist.barrier()
        start = time.perf_counter()
        for name, grad in grads.items():
            broadcaster.broadcast(grad, owners[name])
        broadcaster.wait()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def factor_comm(shapes: dict[str, list[list[int]]], rank: int) -> dict[str, Any]:
    """Factor reduction and gradient broadcast timings for the ResNet-32 factor shapes."""
    import torch

    from kfac_hpc.comm import KAISAAssignment

    gen = torch.Generator().manual_seed(rank)
    factors: dict[str, torch.Tensor] = {}
    for name, (a_shape, g_shape) in shapes.items():
        for key, shape in (("A", a_shape), ("G", g_shape)):
            x = torch.randn(shape[-1], shape[-1] + 8, generator=gen)
            factors[f"{name}/{key}"] = x @ x.T / x.shape[1]
    dims = {name: (a[-1], g[-1]) for name, (a, g) in shapes.items()}
    mem_plan = KAISAAssignment(dims, WORLD_SIZE, "mem-opt", "compute")
    owners = {key: mem_plan.inverse_worker(*key.rsplit("/", 1)) for key in factors}
    grads = {name: torch.randn(g[-1], a[-1], generator=gen) for name, (a, g) in shapes.items()}
    grad_owners = {name: mem_plan.grad_source(name, 0) for name in shapes}
    full = sum(t.numel() * 4 for t in factors.values())
    triangle = sum(t.shape[0] * (t.shape[0] + 1) // 2 * 4 for t in factors.values())
    return {
        "payload_bytes_full": full,
        "payload_bytes_triangle": triangle,
        "allreduce_full_s": time_reduction(factors, None, symmetric=False),
        "allreduce_unbucketed_s": time_reduction(factors, None, symmetric=False, cap_mb=0.0),
        "allreduce_triangle_s": time_reduction(factors, None, symmetric=True),
        "reduce_to_owner_triangle_s": time_reduction(factors, owners, symmetric=True),
        "grad_broadcast_unbucketed_s": time_grad_broadcast(grads, grad_owners, 0.0),
        "grad_broadcast_bucketed_s": time_grad_broadcast(grads, grad_owners, 25.0),
    }


def worker(out: Path, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from kfac_hpc.runtime import init_distributed, shutdown

    ctx = init_distributed(backend="gloo", timeout_s=300)
    assert dist.get_world_size() == WORLD_SIZE, dist.get_world_size()
    torch.set_num_threads(1)
    measured = harness.interleave(
        {s: functools.partial(_measure, s, ctx.rank) for s in STRATEGIES}, rounds, warmup=1
    )  # the same rotation on every rank; the warm-up round is discarded
    per_round: list[dict[str, Any]] = [
        {s: measured[s][i] for s in STRATEGIES} for i in range(rounds)
    ]
    shapes = per_round[0]["comm-opt"]["shapes"]
    for one in per_round:
        for result in one.values():
            result.pop("shapes")
    mine = {"rank": ctx.rank, "rounds": per_round, "factor_comm": factor_comm(shapes, ctx.rank)}
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, mine)
    if ctx.rank == 0:
        harness.write_worker_result(out, sorted(gathered, key=lambda r: r["rank"]))
    shutdown()


def _measure(strategy: str, rank: int, _round: int) -> dict[str, Any]:
    return measure_strategy(strategy, rank)


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per strategy and figure: the max over ranks in each round, then median/min/max over
    rounds; ratios to COMM-OPT per round (then median/min/max)."""
    figures = ("peak_bytes", "steady_bytes")
    rounds = range(len(ranks[0]["rounds"]))
    per_round = {
        s: {f: [max(r["rounds"][i][s][f] for r in ranks) for i in rounds] for f in figures}
        for s in STRATEGIES
    }
    memory = {s: {f: harness.stats(v) for f, v in per_round[s].items()} for s in STRATEGIES}
    ratios = {
        s: {
            f: harness.stats(harness.ratios(per_round[s][f], per_round["comm-opt"][f]))
            for f in figures
        }
        for s in STRATEGIES
    }
    usage = {
        s: {
            key: max(r["rounds"][0][s]["memory_usage"][key] for r in ranks)
            for key in ("factors_bytes", "second_order_bytes", "total_bytes")
        }
        for s in STRATEGIES
    }
    per_rank_peak = {
        s: [statistics.median(r["rounds"][i][s]["peak_bytes"] for i in rounds)
            for r in ranks]
        for s in STRATEGIES
    }  # fmt: skip
    timings = {
        key: max(r["factor_comm"][key] for r in ranks)
        for key in (
            "allreduce_full_s",
            "allreduce_unbucketed_s",
            "allreduce_triangle_s",
            "reduce_to_owner_triangle_s",
            "grad_broadcast_unbucketed_s",
            "grad_broadcast_bucketed_s",
        )
    }
    phases = {
        s: {
            phase: statistics.median(
                max(r["rounds"][i][s]["phases_s"][phase] for r in ranks) for i in rounds
            )
            for phase in ranks[0]["rounds"][0][s]["phases_s"]
        }
        for s in STRATEGIES
    }
    comm = ranks[0]["factor_comm"]
    return {
        "rounds": len(rounds),
        "memory_max_over_ranks": memory,
        "ratios_to_comm_opt": ratios,
        "peak_bytes_per_rank_median": per_rank_peak,
        "memory_usage_max_over_ranks": usage,
        "kfac_phases_s_max_over_ranks": phases,
        "factor_comm": {
            "payload_bytes_full": comm["payload_bytes_full"],
            "payload_bytes_triangle": comm["payload_bytes_triangle"],
            **timings,
        },
    }


def _mib(spread: dict[str, float]) -> str:
    return f"{spread['median'] / MIB:7.2f} ({spread['min'] / MIB:.2f}-{spread['max'] / MIB:.2f})"


def _ratio(spread: dict[str, float]) -> str:
    return f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"


def report(summary: dict[str, Any]) -> None:
    print(
        f"K-FAC memory from real allocations, ResNet-32, {WORLD_SIZE} ranks (gloo, CPU), "
        f"max over ranks, median (min-max) of {summary['rounds']} rounds, MiB"
    )
    print(f"{'strategy':<11} {'peak':>22} {'steady state':>22} {'peak/COMM':>22} "
          f"{'steady/COMM':>22} {'kept tensors':>12}")  # fmt: skip
    for s in STRATEGIES:
        mem, ratio = summary["memory_max_over_ranks"][s], summary["ratios_to_comm_opt"][s]
        kept = summary["memory_usage_max_over_ranks"][s]["total_bytes"] / MIB
        print(
            f"{s:<11} {_mib(mem['peak_bytes']):>22} {_mib(mem['steady_bytes']):>22} "
            f"{_ratio(ratio['peak_bytes']):>22} {_ratio(ratio['steady_bytes']):>22} "
            f"{kept:>12.2f}"
        )
    for s, per in summary["peak_bytes_per_rank_median"].items():
        print(f"{s:<11} peak per rank: " + "  ".join(f"{b / MIB:.2f}" for b in per))
    print("K-FAC phases of the measured step (factors and eigendecompositions), slowest rank, ms")
    for s, phases in summary["kfac_phases_s_max_over_ranks"].items():
        print(f"{s:<11} " + "  ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items()))
    fc = summary["factor_comm"]
    full, tri = fc["allreduce_full_s"], fc["allreduce_triangle_s"]
    print(
        f"factor reduction ({fc['payload_bytes_full'] / MIB:.2f} MiB full, "
        f"{fc['payload_bytes_triangle'] / MIB:.2f} MiB upper triangle): "
        f"allreduce {full * 1e3:.1f} ms (one tensor per collective: "
        f"{fc['allreduce_unbucketed_s'] * 1e3:.1f} ms), "
        f"triangle {tri * 1e3:.1f} ms ({tri / full:.2f}x), reduce-to-owner triangle "
        f"{fc['reduce_to_owner_triangle_s'] * 1e3:.1f} ms "
        f"({fc['reduce_to_owner_triangle_s'] / full:.2f}x)"
    )
    bucketed, single = fc["grad_broadcast_bucketed_s"], fc["grad_broadcast_unbucketed_s"]
    print(
        f"MEM-OPT gradient broadcast of all layers from their owners: one broadcast per layer "
        f"{single * 1e3:.1f} ms, bucketed per owner {bucketed * 1e3:.1f} ms "
        f"({single / bucketed:.1f}x faster)"
    )


def main() -> int:
    args = harness.parser(__doc__, rounds=ROUNDS).parse_args()
    if args.worker is not None:
        worker(args.worker, args.rounds)
        return 0
    bench = harness.Benchmark("bench_kfac_memory")
    env = {
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),  # freed tensors leave the resident set
    }
    ranks = harness.launch(
        __file__, "--rounds", str(args.rounds), ranks=WORLD_SIZE, env=env, timeout=600
    )
    summary = summarise(ranks)
    report(summary)
    ratio = summary["ratios_to_comm_opt"]["mem-opt"]["peak_bytes"]
    bench.target(
        "MEM-OPT / COMM-OPT peak K-FAC memory",
        ratio["median"],
        TARGET,
        "<=",
        "×",
        f"max over {WORLD_SIZE} ranks, median of {args.rounds} rounds",
    )
    return bench.finish(summary, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
