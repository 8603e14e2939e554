"""Per-rank K-FAC memory at 4 ranks under COMM-OPT, HYBRID-OPT and MEM-OPT (CIFAR ResNet-32).

One command: ``.venv/bin/python benchmarks/bench_kfac_memory.py`` starts itself as 4 real ranks
(``mpiexec -n 4``, gloo, CPU) and, side by side in that one job:

1. per strategy, builds ResNet-32 (batch 16 per rank = 64 global, 32x32x3 inputs), runs three
   K-FAC steps (factors and eigendecompositions every step) and reads ``memory_usage()``:
   factors and second-order bytes separately, per rank (and the K-FAC phase times per step);
2. times the factor reduction of those exact factor shapes with ``FactorAllreducer``: a full
   allreduce in 25 MiB buckets and unbucketed, the upper-triangle allreduce, and a reduce of
   each factor only to its MEM-OPT inverse worker; and counts the factor bytes each rank would
   keep if factors were reduced to their owners only (the reference library keeps every factor
   on every rank);
3. times the MEM-OPT gradient broadcast (every layer's gradient from its owner to all ranks)
   with one broadcast per layer and with ``AsyncBroadcaster``'s per-owner buckets.

Prints the ratios and writes benchmarks/results/kfac_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORLD_SIZE = 4
STRATEGIES = ("comm-opt", "hybrid-opt", "mem-opt")
PER_RANK_BATCH = 16
STEPS = 3
MIB = 1024 * 1024
REPEATS = 5


def measure_strategy(strategy: str, rank: int) -> dict[str, Any]:
    """K-FAC steps of ResNet-32 under ``strategy``: this rank's memory_usage() and the mean
    K-FAC phase seconds of the steps after the first."""
    import torch
    from torch import nn

    from kfac_hpc.optim import KFACPreconditioner
    from kfac_hpc.train.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet32", (3, 32, 32), 10)
    kfac = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=1, grad_worker_fraction=strategy
    )
    gen = torch.Generator().manual_seed(rank)
    phases: dict[str, float] = {}
    for step in range(STEPS):
        x = torch.randn(PER_RANK_BATCH, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (PER_RANK_BATCH,), generator=gen)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        kfac.step()
        if step > 0:  # the first step builds buffers and groups
            for phase, seconds in kfac.last_timings.items():
                phases[phase] = phases.get(phase, 0.0) + seconds / (STEPS - 1)
    usage = kfac.memory_usage()
    shapes = {name: [list(s) for s in layer.factor_shapes] for name, layer in kfac.layers.items()}
    return {"memory": usage, "shapes": shapes, "layers": len(kfac.layers), "phases_s": phases}


def time_reduction(
    factors: dict[str, Any], owners: dict[str, int] | None, symmetric: bool, cap_mb: float = 25.0
) -> float:
    """Median seconds of one bucketed reduction of all factors."""
    import torch.distributed as dist

    from kfac_hpc.comm import FactorAllreducer

    samples = []
    for _ in range(REPEATS):
        reducer = FactorAllreducer(cap_mb, symmetric=symmetric)
        dist.barrier()
        start = time.perf_counter()
        for name, tensor in factors.items():
            reducer.submit(name, tensor, dst=None if owners is None else owners[name])
        reducer.wait()
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
    """Factor reduction timings and owner-only factor bytes for the ResNet-32 factor shapes."""
    import torch

    from kfac_hpc.comm import KAISAAssignment

    gen = torch.Generator().manual_seed(rank)
    factors: dict[str, torch.Tensor] = {}
    for name, (a_shape, g_shape) in shapes.items():
        for key, shape in (("A", a_shape), ("G", g_shape)):
            x = torch.randn(shape[-1], shape[-1] + 8, generator=gen)
            factors[f"{name}/{key}"] = x @ x.T / x.shape[1]
    dims = {name: (a[-1], g[-1]) for name, (a, g) in shapes.items()}
    owned_bytes: dict[str, int] = {}
    for strategy in STRATEGIES:
        plan = KAISAAssignment(dims, WORLD_SIZE, strategy, "compute", colocate_factors=True)
        owned_bytes[strategy] = sum(
            t.numel() * t.element_size()
            for key, t in factors.items()
            if plan.inverse_worker(*key.rsplit("/", 1)) == rank
        )
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
        "owner_only_factor_bytes": owned_bytes,
        "grad_broadcast_unbucketed_s": time_grad_broadcast(grads, grad_owners, 0.0),
        "grad_broadcast_bucketed_s": time_grad_broadcast(grads, grad_owners, 25.0),
    }


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from kfac_hpc.runtime import init_distributed, shutdown

    ctx = init_distributed(backend="gloo", timeout_s=300)
    assert dist.get_world_size() == WORLD_SIZE, dist.get_world_size()
    torch.set_num_threads(1)
    mine: dict[str, Any] = {"rank": ctx.rank, "strategies": {}}
    for strategy in STRATEGIES:
        mine["strategies"][strategy] = measure_strategy(strategy, ctx.rank)
    shapes = mine["strategies"]["comm-opt"].pop("shapes")
    for strategy in STRATEGIES[1:]:
        mine["strategies"][strategy].pop("shapes")
    mine["factor_comm"] = factor_comm(shapes, ctx.rank)
    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, mine)
    if ctx.rank == 0:
        out.write_text(json.dumps(sorted(gathered, key=lambda r: r["rank"])))
    shutdown()


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per: dict[str, dict[str, list[int]]] = {
        s: {
            "factors_bytes": [r["strategies"][s]["memory"]["factors_bytes"] for r in ranks],
            "second_order_bytes": [
                r["strategies"][s]["memory"]["second_order_bytes"] for r in ranks
            ],
            "owner_only_factors_bytes": [
                r["factor_comm"]["owner_only_factor_bytes"][s] for r in ranks
            ],
        }
        for s in STRATEGIES
    }  # fmt: skip
    comm_second = statistics.mean(per["comm-opt"]["second_order_bytes"])
    comm_factors = statistics.mean(per["comm-opt"]["factors_bytes"])
    ratios = {
        s: {
            "second_order_mean_vs_comm_opt": statistics.mean(per[s]["second_order_bytes"])
            / comm_second,
            "second_order_max_vs_comm_opt": max(per[s]["second_order_bytes"]) / comm_second,
            "factors_mean_vs_comm_opt": statistics.mean(per[s]["factors_bytes"]) / comm_factors,
            "owner_only_factors_mean_vs_all_factors": statistics.mean(
                per[s]["owner_only_factors_bytes"]
            )
            / comm_factors,
        }
        for s in STRATEGIES
    }
    comm = ranks[0]["factor_comm"]
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
            phase: max(r["strategies"][s]["phases_s"][phase] for r in ranks)
            for phase in ranks[0]["strategies"][s]["phases_s"]
        }
        for s in STRATEGIES
    }
    return {
        "per_rank": per,
        "ratios": ratios,
        "kfac_phases_s_max_over_ranks": phases,
        "factor_comm": {
            "payload_bytes_full": comm["payload_bytes_full"],
            "payload_bytes_triangle": comm["payload_bytes_triangle"],
            **timings,
        },
    }


def report(summary: dict[str, Any]) -> None:
    print(f"K-FAC memory per rank, ResNet-32, {WORLD_SIZE} ranks (gloo, CPU), MiB")
    print(
        f"{'strategy':<11} {'rank':>4} {'factors':>9} {'2nd-order':>10} {'owner-only factors':>19}"
    )
    for s, per in summary["per_rank"].items():
        for rank in range(WORLD_SIZE):
            print(
                f"{s:<11} {rank:>4} {per['factors_bytes'][rank] / MIB:>9.2f} "
                f"{per['second_order_bytes'][rank] / MIB:>10.2f} "
                f"{per['owner_only_factors_bytes'][rank] / MIB:>19.2f}"
            )
    for s, r in summary["ratios"].items():
        print(
            f"{s}: second-order mean/COMM-OPT {r['second_order_mean_vs_comm_opt']:.3f} "
            f"(max rank {r['second_order_max_vs_comm_opt']:.3f}); factors held "
            f"{r['factors_mean_vs_comm_opt']:.3f}; if reduced to owners only "
            f"{r['owner_only_factors_mean_vs_all_factors']:.3f}"
        )
    print("K-FAC phases per step (factors and eigendecompositions every step), slowest rank, ms")
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
    mem = summary["ratios"]["mem-opt"]["second_order_mean_vs_comm_opt"]
    print(f"MEM-OPT/COMM-OPT second-order ratio: {mem:.3f} (target ~ {1 / WORLD_SIZE:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    root = Path(__file__).resolve().parent
    results = root / "results"
    results.mkdir(exist_ok=True)
    raw = results / "kfac_memory.ranks.json"
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [str(mpiexec), "-n", str(WORLD_SIZE), sys.executable, __file__, "--worker", str(raw)]
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=600, cwd=root.parent)
    summary = summarise(json.loads(raw.read_text()))
    raw.unlink()
    summary["command"] = "python benchmarks/bench_kfac_memory.py"
    summary["wall_s"] = time.perf_counter() - start
    (results / "kfac_memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    report(summary)


if __name__ == "__main__":
    main()
