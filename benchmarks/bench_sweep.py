"""Validate + render + submit a 4-node-count × 3-repeat sweep (12 points) to the local Slurm
cluster; the issue's budget is 2 s, excluding the jobs' own run time (they are cancelled).

Side by side, 3 rounds each: the library calls in this process (split into validate, render
and submit), and the ``kfac-hpc sweep`` command as a user runs it (Python start-up included).

    SLURM_CONF=.work/slurm/etc/slurm.conf .venv/bin/python benchmarks/bench_sweep.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kfac_hpc.sweep import slurm
from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.spec import load_spec
from kfac_hpc.sweep.submit import prepare_sweep, submit_sweep

BUDGET_S = 2.0
ROUNDS = 3
FIELDS = {
    "nodes": "1,2,3,4",
    "repeats": 3,
    "steps": 10,
    "name": "bench",
    "kfac": "true",
    "time": "00:02:00",
}
CLI_ARGS = [
    "--nodes",
    "1,2,3,4",
    "--repeats",
    "3",
    "--steps",
    "10",
    "--name",
    "bench",
    "--kfac",
    "true",
    "--time",
    "00:02:00",
]


def _cancel(sweep_dir: Path) -> None:
    slurm.scancel(a.submissions[-1]["array_job_id"] for a in read_manifest(sweep_dir).arrays)


def library_round(root: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    spec = load_spec(None, FIELDS)
    t1 = time.perf_counter()
    prepared = prepare_sweep(spec, root / "lib", "slurm")
    t2 = time.perf_counter()
    manifest = submit_sweep(prepared)
    t3 = time.perf_counter()
    assert len(manifest.points) == 12 and len(manifest.arrays) == 4
    _cancel(root / "lib")
    return {"validate_s": t1 - t0, "render_s": t2 - t1, "submit_s": t3 - t2, "total_s": t3 - t0}


def cli_round(root: Path) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "kfac_hpc", "sweep", *CLI_ARGS, "--sweep-dir", str(root / "cli")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"kfac-hpc sweep failed: {out.stderr}")
    _cancel(root / "cli")
    return elapsed


def main() -> None:
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("set SLURM_CONF (bash slurm/cluster.sh env) and start the cluster first")
    lib: list[dict[str, float]] = []
    cli: list[float] = []
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory() as tmp:
            lib.append(library_round(Path(tmp)))
            cli.append(cli_round(Path(tmp)))
    med = {k: statistics.median(r[k] for r in lib) for k in lib[0]}
    cli_s = statistics.median(cli)
    print(f"12 points, 4 arrays, median of {ROUNDS} rounds (budget {BUDGET_S:.1f} s):")
    print(
        f"  library: validate {med['validate_s'] * 1e3:.1f} ms, "
        f"render {med['render_s'] * 1e3:.1f} ms, submit {med['submit_s'] * 1e3:.1f} ms, "
        f"total {med['total_s']:.3f} s ({med['total_s'] / BUDGET_S:.2f} of budget)"
    )
    print(
        f"  kfac-hpc sweep (CLI, Python start-up included): {cli_s:.3f} s "
        f"({cli_s / BUDGET_S:.2f} of budget)"
    )
    print(f"  CLI / library: {cli_s / med['total_s']:.2f}x")
    result = {
        "benchmark": "sweep_submit",
        "points": 12,
        "arrays": 4,
        "rounds": ROUNDS,
        "budget_s": BUDGET_S,
        "library_median": med,
        "cli_median_s": cli_s,
        "library_rounds": lib,
        "cli_rounds_s": cli,
    }
    out = Path(__file__).parent / "results" / "bench_sweep.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
