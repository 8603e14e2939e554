"""torch's huge-page allocations (``THP_MEM_ALLOC_ENABLE=1``, a user's opt-in) against plain
4 KiB pages, on FOSI's ESE and steps: whether the job should turn them on.

    .venv/bin/python benchmarks/bench_huge_pages.py [--rounds 5] [--check]

torch reads the variable once, at its first allocation, so every measurement is a fresh child
process started with it on or off (the order alternates from round to round). Each child keeps
freed host memory as the job does (``keep_freed_host_memory``), builds bench_fosi.py's MLP
(2.1 M parameters, one thread, k = 10) and FOSI with the cheapest ESE of that benchmark
(float32 basis, partial reorthogonalization, a quarter of the curvature batch, warm start),
runs the first ESE and two plain steps, then times the second ESE and 20 plain steps (the
steps between the ESEs that follow): wall seconds, CPU seconds (user + system: less moved by
other jobs on a shared host than wall time) and minor page faults. The report prints on / off
as the median of the per-round ratios with their min and max (none where off is 0).
Targets: the ESE's wall and CPU time on / off <= 1, what turning them on by default would need
(``--check`` exits 1 when one is missed). JSON in benchmarks/results/bench_huge_pages.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py, beside this script

SETTINGS = ("off", "on")
STEPS = 20
MEASURES = ("ese_wall_s", "ese_cpu_s", "ese_faults", "step_wall_s", "step_cpu_s", "step_faults")


def _usage() -> tuple[float, float, int]:
    """(wall s, CPU s, minor faults) so far."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), use.ru_utime + use.ru_stime, use.ru_minflt


def _since(start: tuple[float, float, int], count: int = 1) -> tuple[float, float, float]:
    wall, cpu, faults = _usage()
    return (wall - start[0]) / count, (cpu - start[1]) / count, (faults - start[2]) / count


def child(setting: str) -> dict[str, Any]:
    """One process's measurements; ``setting`` must match the variable it was started with."""
    from kfac_hpc.runtime import keep_freed_host_memory
    from kfac_hpc.runtime.host_memory import huge_pages_enabled

    if huge_pages_enabled() != (setting == "on"):
        raise SystemExit(f"bench_huge_pages: asked for {setting!r}, the environment differs")
    keep_freed_host_memory()
    import torch
    from bench_fosi import ESE_VARIANTS, workload
    from torch import nn

    from kfac_hpc.optim.fosi import FOSI
    from kfac_hpc.optim.fosi.curvature_batch import leading_rows

    torch.set_num_threads(1)
    model, data, backward = workload(0)
    cx, cy = data(64)

    def closure(fraction: float = 1.0) -> torch.Tensor:
        x, y = leading_rows(fraction, cx, cy)
        return nn.functional.cross_entropy(model(x), y)

    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = FOSI(model.parameters(), base, k=10, l=0, alpha=0.01, ese_every=3, warmup=0,
               model=model, **ESE_VARIANTS["f32+cheap+partial"])  # fmt: skip
    for _ in range(3):  # the first ESE and two plain steps
        backward()
        opt.step(closure)
    backward()
    start = _usage()
    opt.step(closure)  # the second ESE
    ese = _since(start)
    wall = cpu = faults = 0.0
    plain = 0
    while plain < STEPS:  # plain steps only (an ESE is due every third step)
        backward()
        if opt.ese_due():
            opt.step(closure)
            continue
        start = _usage()
        opt.step()
        taken = _since(start)
        wall, cpu, faults = wall + taken[0], cpu + taken[1], faults + taken[2]
        plain += 1
    steps = (wall / STEPS, cpu / STEPS, faults / STEPS)
    return dict(zip(MEASURES, (*ese, *steps), strict=True)) | {"ese_count": opt.ese_count}


def summarise(measured: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    on, off = measured["on"], measured["off"]
    result: dict[str, Any] = {"rounds": {"on": on, "off": off}}
    for key in MEASURES:
        a, b = [r[key] for r in on], [r[key] for r in off]
        result[key] = {
            "on": harness.stats(a),
            "off": harness.stats(b),
            "on_vs_off": harness.stats(harness.ratios(a, b)) if all(b) else None,
        }
    return result


def main() -> int:
    parser = harness.parser(__doc__, rounds=5)
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        harness.write_worker_result(args.worker, child(args.child))
        return 0
    bench = harness.Benchmark("bench_huge_pages")

    def one_child(setting: str) -> Callable[[int], dict[str, Any]]:
        env = {"THP_MEM_ALLOC_ENABLE": "1" if setting == "on" else "0", "OMP_NUM_THREADS": "1"}
        return lambda _round: dict(
            harness.launch(__file__, "--child", setting, env=env, quiet=True, timeout=600)
        )

    def show(index: int, setting: str, out: dict[str, Any]) -> None:
        print(
            f"round {index + 1}: huge pages {setting:<3} ESE {out['ese_wall_s']:.2f} s wall, "
            f"{out['ese_cpu_s']:.2f} s CPU, {out['ese_faults']:.0f} faults; step "
            f"{out['step_cpu_s'] * 1e3:.1f} ms CPU (load {harness.load_average():.2f})"
        )

    measured = harness.interleave({s: one_child(s) for s in SETTINGS}, args.rounds, on_measure=show)
    result = summarise(measured)
    print("\nmedian (min-max) over rounds; on / off: the median of the per-round ratios")
    for key in MEASURES:
        row, ratio = result[key], result[key]["on_vs_off"]
        versus = (
            ""
            if ratio is None
            else (f"on / off {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
        )
        print(f"  {key:<12} on {row['on']['median']:.4g}  off {row['off']['median']:.4g}  {versus}")
    for key, what in (("ese_wall_s", "wall"), ("ese_cpu_s", "CPU")):
        bench.target(
            f"FOSI ESE {what} time, huge pages on / off",
            result[key]["on_vs_off"]["median"],
            1.0,
            "<=",
            "×",
            f"median of {args.rounds} rounds",
        )
    return bench.finish(result, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
