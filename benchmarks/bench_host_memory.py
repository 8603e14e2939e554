"""Keeping freed host memory (the job's default) against glibc's default, from real steps.

    .venv/bin/python benchmarks/bench_host_memory.py [--rounds 5] [--check]

``kfac_hpc.runtime.keep_freed_host_memory()`` changes process-wide malloc settings that cannot
be undone, so every measurement is a fresh child process. A round runs one child per setting
(the order alternates from round to round); each child builds the trainers of
bench_kfac_floor.py (CIFAR ResNet-32 shapes, batch 64, 2 threads, SGD with momentum, eigen
method) and runs, one after the other, consecutive steps of plain SGD, of SGD+K-FAC with
factors every 10 steps and eigendecompositions every 100 (110 steps: 11 factor steps and one
eigendecomposition step), and with both every step; step 0 of each is the warm-up. It reports
each configuration's mean step and minor page faults per step, and its own peak resident set.
The report prints kept / default per configuration as the median of the per-round ratios with
their min and max, the page faults and the peak resident sets. Targets: faster steps (kept /
default <= 1 in every configuration) and the same peak (kept / default <= 1.05); ``--check``
exits 1 when one is missed. JSON in benchmarks/results/bench_host_memory.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # benchmarks/harness.py, beside this script
from bench_kfac import THREADS, Trainer
from bench_kfac_floor import EVERY, SPARSE
from memprobe import status_bytes

from kfac_hpc.contracts import HostMemory
from kfac_hpc.runtime import keep_freed_host_memory

PEAK_SAME = 1.05  # "the same peak": kept / default within 5 %
SETTINGS = (str(HostMemory.DEFAULT), str(HostMemory.KEPT))
# configuration: (K-FAC options, consecutive steps after the warm-up)
CONFIGS: dict[str, tuple[dict[str, int], int]] = {
    "sgd": ({}, 30),
    "kfac_10_100": (SPARSE, 110),
    "kfac_1_1": (EVERY, 20),
}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def child(setting: str) -> dict[str, Any]:
    """One process's measurements under ``setting``."""
    kept = setting == HostMemory.KEPT
    state = str(keep_freed_host_memory() if kept else HostMemory.DEFAULT)
    if state != setting:
        raise SystemExit(f"bench_host_memory: asked for {setting!r}, the process is {state!r}")
    torch.set_num_threads(THREADS)
    out: dict[str, Any] = {"setting": setting}
    for name, (options, steps) in CONFIGS.items():
        trainer = Trainer(**options)
        trainer.step()  # warm-up: the first factors and decompositions
        faults, start = _faults(), time.perf_counter()
        for _ in range(steps):
            trainer.step()
        out[name] = {
            "step_s": (time.perf_counter() - start) / steps,
            "faults_per_step": (_faults() - faults) / steps,
        }
    out["peak_rss_bytes"] = status_bytes("VmHWM")
    return out


def summarise(measured: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: kept / default step ratios per round and both settings' steps and
    faults; the peak resident sets and their ratio per round."""
    kept, default = measured[str(HostMemory.KEPT)], measured[str(HostMemory.DEFAULT)]
    result: dict[str, Any] = {"rounds": len(kept)}
    for name in CONFIGS:
        ratios = harness.ratios(
            [r[name]["step_s"] for r in kept], [r[name]["step_s"] for r in default]
        )
        result[name] = {"kept_vs_default": harness.stats(ratios)}
        for setting in SETTINGS:
            result[name][setting] = {
                key: harness.stats(r[name][key] for r in measured[setting])
                for key in ("step_s", "faults_per_step")
            }
    result["peak_rss_bytes"] = {
        s: harness.stats(float(r["peak_rss_bytes"]) for r in measured[s]) for s in SETTINGS
    }
    peaks = [[float(r["peak_rss_bytes"]) for r in runs] for runs in (kept, default)]
    result["peak_kept_vs_default"] = harness.stats(harness.ratios(*peaks))
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"\n{result['rounds']} rounds; median [min-max]; kept / default per round:")
    for name in CONFIGS:
        r = result[name]
        ratio = r["kept_vs_default"]
        steps = "  ".join(
            f"{s} {r[s]['step_s']['median'] * 1e3:6.1f} ms, "
            f"{r[s]['faults_per_step']['median']:7.0f} faults/step"
            for s in SETTINGS
        )
        print(
            f"  {name:<12} {ratio['median']:.3f} [{ratio['min']:.3f}-{ratio['max']:.3f}]  {steps}"
        )
    peak = result["peak_rss_bytes"]
    print(
        "  peak resident set: "
        + ", ".join(f"{s} {peak[s]['median'] / 2**20:.0f} MiB" for s in SETTINGS)
    )


def main() -> int:
    parser = harness.parser(__doc__, rounds=5)
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        harness.write_worker_result(args.worker, child(args.child))
        return 0
    bench = harness.Benchmark("bench_host_memory")

    def one_child(setting: str) -> Callable[[int], dict[str, Any]]:
        return lambda _round: dict(harness.launch(__file__, "--child", setting, quiet=True))

    def show(index: int, setting: str, out: dict[str, Any]) -> None:
        step_ms = out["kfac_1_1"]["step_s"] * 1e3
        load = harness.load_average()
        print(f"round {index + 1}: {setting:<7} 1/1 step {step_ms:.1f} ms (load {load:.2f})")

    measured = harness.interleave({s: one_child(s) for s in SETTINGS}, args.rounds, on_measure=show)
    result = summarise(measured)
    _print(result)
    for name in CONFIGS:
        ratio = result[name]["kept_vs_default"]["median"]
        bench.target(f"{name} step, kept / default", ratio, 1.0, "<=", "×", "faster steps")
    bench.target(
        "peak resident set, kept / default",
        result["peak_kept_vs_default"]["median"],
        PEAK_SAME,
        "<=",
        "×",
        "the same peak",
    )
    return bench.finish(result, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
