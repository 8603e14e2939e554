"""A 12-point sweep (1-, 2- and 4-node points x 4 repeats, tiny MLP) on the local Slurm
cluster, Slurm job arrays vs the Parsl pilot backend: total wall time of the user's commands
from ``sweep`` to ``report`` (arrays: ``kfac-hpc sweep --wait``, which follows the arrays and
prints the report; pilot: ``kfac-hpc sweep --backend parsl-slurm``, which runs every point in
one allocation and prints the report), side by side, the two orders alternating per round.
Target: the pilot no slower than the arrays (arrays / pilot >= 1, median of the per-round
ratios).

Both get ``--max-concurrent 4``: no throttle for the arrays (4 points per array), a 16-node
pilot. Needs the 16-node cluster (``bash slurm/cluster.sh start --nodes 16``):

    SLURM_CONF=.work/slurm/etc/slurm.conf .venv/bin/python benchmarks/bench_pilot.py [--rounds N]

--rounds defaults to 3 (median, min and max over rounds; a bare number is taken as --rounds).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script

from kfac_hpc.sweep.manifest import read_manifest

ROUNDS = 3
COMMON = [
    *("--nodes", "1,2,4", "--repeats", "4", "--model", "mlp", "--steps", "20"),
    *("--max-concurrent", "4", "--time", "00:05:00", "--train-arg=--no-progress"),
]
BACKENDS = {
    "arrays": ["--backend", "slurm", "--wait"],
    "pilot": ["--backend", "parsl-slurm"],
}


def one_sweep(root: Path, backend: str, round_no: int) -> float:
    """Seconds from ``kfac-hpc sweep`` to its printed report; every point must end done."""
    sweep_dir = root / f"{backend}-{round_no}"
    argv = [sys.executable, "-m", "kfac_hpc", "sweep", *COMMON, *BACKENDS[backend]]
    argv += ["--name", f"b{backend[0]}{round_no}", "--sweep-dir", str(sweep_dir)]
    env = {**os.environ, "KFAC_HPC_PILOT_ADDRESS": "127.0.0.1", "MPLBACKEND": "Agg"}
    # sbatch runs from the sweep's directory: a relative SLURM_CONF would not resolve there
    env["SLURM_CONF"] = str(Path(env["SLURM_CONF"]).resolve())
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        tail = out.stderr[-2000:]
        raise SystemExit(f"{backend} round {round_no} exited {out.returncode}: {tail}")
    states = {p.state for p in read_manifest(sweep_dir).points}
    if states != {"done"}:
        raise SystemExit(f"{backend} round {round_no} failed ({states}): {out.stderr[-2000:]}")
    return wall


def main() -> int:
    parser = harness.parser(__doc__, rounds=ROUNDS)
    parser.add_argument(
        "legacy_rounds", nargs="?", type=harness.positive_int, help=argparse.SUPPRESS
    )  # the ROUNDS positional of before
    args = parser.parse_args()
    rounds = args.legacy_rounds or args.rounds
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("set SLURM_CONF (bash slurm/cluster.sh env) and start the cluster first")
    bench = harness.Benchmark("bench_pilot")
    print(f"load average at start: {bench.load_start:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-pilot-") as tmp:
        times = harness.interleave(
            {name: functools.partial(one_sweep, Path(tmp), name) for name in BACKENDS},
            rounds,
            on_measure=lambda r, name, s: print(f"round {r}: {name:6} {s:6.1f} s", flush=True),
        )
    print(f"\n12 points (nodes 1,2,4 x 4 repeats), {rounds} round(s), sweep -> report:")
    walls = {name: harness.Stats.of(values) for name, values in times.items()}
    for name, wall in walls.items():
        print(f"  {name:8} {wall:.1f} s")
    ratio = harness.Stats.of(harness.ratios(times["arrays"], times["pilot"]))
    print(f"arrays / pilot, per round: {ratio:.2f}")
    bench.target("arrays / pilot wall time, sweep to report", ratio.median, 1.0, ">=", "×")
    result = {
        "rounds": rounds,
        "wall_s": {name: wall.as_dict() for name, wall in walls.items()},
        "arrays_over_pilot": ratio.as_dict(),
        "rounds_s": times,
    }
    return bench.finish(result, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
