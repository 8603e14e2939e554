"""Validate + render + submit a 4-node-count × 3-repeat sweep (12 points) to the local Slurm
cluster; the issue's budget is 2 s, excluding the jobs' own run time (they are cancelled).

Side by side in interleaved rounds (3 by default): the library calls in this process (split
into validate, render and submit), and the ``kfac-hpc sweep`` command as a user runs it (Python
start-up included). Targets: both within the budget (median over rounds).

    SLURM_CONF=.work/slurm/etc/slurm.conf .venv/bin/python benchmarks/bench_sweep.py [--check]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script

from kfac_hpc.sweep.backends import backend_for
from kfac_hpc.sweep.backends.slurm import submit_sweep
from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.prepare import prepare_sweep
from kfac_hpc.sweep.slurm_commands import scancel
from kfac_hpc.sweep.spec import load_spec

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
    scancel(a.submissions[-1]["array_job_id"] for a in read_manifest(sweep_dir).arrays)


def library_round(root: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    spec = load_spec(None, FIELDS)
    t1 = time.perf_counter()
    prepared = prepare_sweep(spec, root / "lib", backend_for("slurm"))
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


def _round_dir(root: Path, round_index: int) -> Path:
    """The folder of one round's two sweeps (``lib`` and ``cli``)."""
    path = root / f"round{round_index}"
    path.mkdir(exist_ok=True)
    return path


def main() -> int:
    args = harness.parser(__doc__, rounds=ROUNDS).parse_args()
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("set SLURM_CONF (bash slurm/cluster.sh env) and start the cluster first")
    bench = harness.Benchmark("bench_sweep")
    with tempfile.TemporaryDirectory() as tmp:
        measured = harness.interleave(
            {
                "library": lambda r: library_round(_round_dir(Path(tmp), r)),
                "cli": lambda r: cli_round(_round_dir(Path(tmp), r)),
            },
            args.rounds,
        )
    lib: list[dict[str, float]] = measured["library"]
    cli: list[float] = measured["cli"]
    parts = {k: harness.Stats.of(r[k] for r in lib) for k in lib[0]}
    cli_s = harness.Stats.of(cli)
    print(
        f"12 points, 4 arrays, median (min–max) of {args.rounds} rounds (budget {BUDGET_S:.1f} s):"
    )
    print(
        f"  library: validate {parts['validate_s'].scaled(1e3):.1f} ms, "
        f"render {parts['render_s'].scaled(1e3):.1f} ms, submit "
        f"{parts['submit_s'].scaled(1e3):.1f} ms, total {parts['total_s']:.3f} s"
    )
    print(f"  kfac-hpc sweep (CLI, Python start-up included): {cli_s:.3f} s")
    print(f"  CLI / library: {cli_s.median / parts['total_s'].median:.2f}x")
    bench.target(
        "library: validate+render+submit 12 points", parts["total_s"].median, BUDGET_S, "<=", "s"
    )
    bench.target("kfac-hpc sweep of 12 points (CLI)", cli_s.median, BUDGET_S, "<=", "s")
    result = {
        "points": 12,
        "arrays": 4,
        "rounds": args.rounds,
        "budget_s": BUDGET_S,
        "library_s": {k: v.as_dict() for k, v in parts.items()},
        "cli_s": cli_s.as_dict(),
        "library_rounds": lib,
        "cli_rounds_s": cli,
    }
    return bench.finish(result, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
