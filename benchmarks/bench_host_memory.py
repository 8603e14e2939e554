"""Keeping freed host memory (the job's default) against glibc's default, from real steps.

    .venv/bin/python benchmarks/bench_host_memory.py [--rounds 5]

``kfac_hpc.runtime.keep_freed_host_memory()`` changes process-wide malloc settings that cannot
be undone, so every measurement is a fresh child process. A round runs one child per setting
(the order alternates from round to round); each child builds the trainers of
bench_kfac_floor.py (CIFAR ResNet-32 shapes, batch 64, 2 threads, SGD with momentum, eigen
method) and runs, one after the other, consecutive steps of plain SGD, of SGD+K-FAC with
factors every 10 steps and eigendecompositions every 100 (110 steps: 11 factor steps and one
eigendecomposition step), and with both every step; step 0 of each is the warm-up. It reports
each configuration's mean step and minor page faults per step, and its own peak resident set.
The report prints kept / default per configuration as the median of the per-round ratios with
their min and max, the page faults and the peak resident sets. JSON in
benchmarks/results/bench_host_memory.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kfac import THREADS, Trainer
from bench_kfac_floor import EVERY, SPARSE
from memprobe import status_bytes

from kfac_hpc.contracts import HostMemory
from kfac_hpc.runtime import keep_freed_host_memory

RESULTS = Path(__file__).resolve().parent / "results" / "bench_host_memory.json"
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


def _run_child(setting: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", setting], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench_host_memory: the {setting} child failed:\n{proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration: kept / default step ratios and both settings' steps and faults."""
    result: dict[str, Any] = {"rounds": len(rounds)}
    for name in CONFIGS:
        ratios = [r["kept"][name]["step_s"] / r["default"][name]["step_s"] for r in rounds]
        result[name] = {"kept_vs_default": _summary(ratios)}
        for setting in SETTINGS:
            result[name][setting] = {
                key: _summary([r[setting][name][key] for r in rounds])
                for key in ("step_s", "faults_per_step")
            }
    result["peak_rss_bytes"] = {
        s: _summary([float(r[s]["peak_rss_bytes"]) for r in rounds]) for s in SETTINGS
    }
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (one child per setting)")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    if args.rounds < 1:
        raise SystemExit("bench_host_memory: --rounds must be >= 1")
    rounds = []
    for index in range(args.rounds):
        load = Path("/proc/loadavg").read_text().split()[0]
        order = SETTINGS if index % 2 == 0 else SETTINGS[::-1]
        measured = {setting: _run_child(setting) for setting in order}
        rounds.append(measured)
        ratio = measured["kept"]["kfac_1_1"]["step_s"] / measured["default"]["kfac_1_1"]["step_s"]
        print(f"round {index + 1} (load {load}): kept / default at 1/1 {ratio:.3f}", flush=True)
    result = summarise(rounds)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    _print(result)


if __name__ == "__main__":
    main()
