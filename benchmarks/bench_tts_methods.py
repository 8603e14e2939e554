"""Time to target accuracy of the training methods side by side, at 1, 2 and 4 ranks: one command.

    .venv/bin/python benchmarks/bench_tts_methods.py [--rounds 3] [--target 0.95] [--ranks 1,2,4]

Every run is the real job (``kfac-hpc train``, ``mpiexec -n P`` for P > 1, gloo on CPU): small
CNN on digits (scikit-learn's 8×8 images; MNIST-1D is not in the package yet), global batch 64
(strong scaling), constant learning rate, evaluation after every epoch (22 steps), stopped at the
target. Methods: SGD (momentum 0.9), Adam, SGD+K-FAC, FOSI with an SGD base (at P > 1 it is
DHO2: coordinates sharded over all ranks), and DHO2 with pipelined curvature
(``--curvature-ranks 1``, P > 1 only: one rank computes ESEs, the others train, so the training
batch is (P − 1)/P of the global batch).

1. Learning rate: each method's small grid is run once at P = 1; the lr with the fewest steps
   to target (deterministic; the shorter time on a tie) is kept for every P (the pipelined
   variant uses FOSI's).
2. Rounds: every (P, method) once per round, interleaved, so machine noise hits all alike.
   Reported per cell: the median, min and max over rounds of the time to target (the run's
   wall time at the first evaluation at or above the target: start-up and evaluation time
   included, torch import excluded), the steps to target, the ratio to SGD at the same P, the
   ESE share of the run, and rank 0's peak resident set.

Prints the table and writes benchmarks/results/bench_tts_methods.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results" / "bench_tts_methods.json"
COMMON = ["--model", "small_cnn", "--dataset", "digits", "--batch-size", "64", "--epochs", "20"]
COMMON += ["--lr-schedule", "constant", "--weight-decay", "0", "--stop-at-target"]
COMMON += ["--no-progress", "--log-every", "11", "--backend", "gloo"]
FOSI = ["--fosi", "--fosi-k", "10", "--lanczos-iters", "30", "--fosi-warmup", "11"]
FOSI += ["--ese-every", "44", "--fosi-alpha", "0.01"]
METHODS: dict[str, tuple[list[str], tuple[float, ...]]] = {
    "sgd": (["--no-kfac"], (0.05, 0.1)),
    "adam": (["--no-kfac", "--optimizer", "adam"], (0.001, 0.003)),
    "sgd+kfac": (["--kfac", "--inv-update-steps", "10"], (0.05, 0.1)),
    "fosi": (FOSI, (0.05, 0.1)),
    "dho2-pipelined": ([*FOSI, "--curvature-ranks", "1"], ()),
}


def run(ranks: int, method: str, lr: float, target: float, work: Path) -> dict[str, Any]:
    """One real run; its run.json figures (time to target None when not reached)."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    args = [*COMMON, *METHODS[method][0], "--lr", str(lr), "--target-accuracy", str(target)]
    cmd = [str(BIN / "kfac-hpc"), "train", "--run-dir", str(run_dir), *args]
    if ranks > 1:
        cmd = [str(BIN / "mpiexec"), "-n", str(ranks), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} P={ranks}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "run.json").read_text())
    phases = summary["phases_s"]
    step_s = sum(phases.values()) or 1.0
    return {
        "tts_s": summary["time_to_target_s"],
        "steps": summary["step_to_target"],
        "ese_share": phases.get("ese", 0.0) / step_s,
        "rss_mib": summary["peak_rss_bytes"] / 2**20,
        "world_size": summary["world_size"],
    }


def tune(target: float, work: Path) -> dict[str, float]:
    """The lr of each method's grid with the fewest steps to target at P = 1."""
    best: dict[str, float] = {}
    for method, (_, grid) in METHODS.items():
        scored = []
        for lr in grid:
            r = run(1, method, lr, target, work)
            reached = r["tts_s"] is not None
            scored.append(((not reached, r["steps"] or 0, r["tts_s"] or 0.0), lr))
            print(f"  tune {method:15s} lr={lr:<6g} steps={r['steps']} tts={r['tts_s']}")
        if grid:
            best[method] = min(scored)[1]
    best["dho2-pipelined"] = best["fosi"]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--ranks", default="1,2,4")
    args = parser.parse_args()
    ranks = [int(p) for p in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lrs = tune(args.target, work)
        cells = [(p, m) for p in ranks for m in METHODS if p > 1 or m != "dho2-pipelined"]
        results: dict[tuple[int, str], list[dict[str, Any]]] = {c: [] for c in cells}
        for round_ in range(args.rounds):
            for p, m in cells:
                r = run(p, m, lrs[m], args.target, work)
                results[(p, m)].append(r)
                print(f"  P={p} {m:15s} steps={r['steps']} tts={r['tts_s']}", flush=True)
            print(f"  round {round_ + 1}/{args.rounds} done", flush=True)
    rows = report(results, lrs, args.target)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"target": args.target, "lr": lrs, "rows": rows}, indent=1))


def report(
    results: dict[tuple[int, str], list[dict[str, Any]]], lrs: dict[str, float], target: float
) -> list[dict[str, Any]]:
    """Print the table (one line per P and method) and return its rows."""
    print(f"time to {target:.0%} test accuracy, median (min..max) over rounds")
    print(" P  method           lr      tts s, median (min..max)   steps  vs SGD  ESE share"
          "  RSS MiB")  # fmt: skip
    rows, sgd = [], {}
    for (p, m), runs in results.items():
        times = [r["tts_s"] for r in runs if r["tts_s"] is not None]
        med = statistics.median(times) if len(times) == len(runs) else None
        if m == "sgd":
            sgd[p] = med
        ratio = med / sgd[p] if med is not None and sgd.get(p) else None
        row = {
            "ranks": p,
            "method": m,
            "lr": lrs[m],
            "tts_median_s": med,
            "tts_min_s": min(times, default=None),
            "tts_max_s": max(times, default=None),
            "reached": f"{len(times)}/{len(runs)}",
            "steps_median": statistics.median(r["steps"] or 0 for r in runs),
            "vs_sgd": ratio,
            "ese_share": statistics.median(r["ese_share"] for r in runs),
            "rss_mib": max(r["rss_mib"] for r in runs),
        }
        rows.append(row)
        tts = (
            "not reached " + row["reached"]
            if med is None
            else (f"{med:6.2f} ({row['tts_min_s']:.2f}..{row['tts_max_s']:.2f})")
        )
        print(f"{p:2d}  {m:15s}  {lrs[m]:<6g}  {tts:26s}  {row['steps_median']:5g}  "
              f"{'' if ratio is None else f'{ratio:.2f}x':>6s}  {row['ese_share']:8.1%}  "
              f"{row['rss_mib']:7.0f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
