"""A 12-point sweep (1-, 2- and 4-node points x 4 repeats, tiny MLP) on the local Slurm
cluster, Slurm job arrays vs the Parsl pilot backend: total wall time of the user's commands
from ``sweep`` to ``report`` (arrays: ``kfac-hpc sweep --wait``, which follows the arrays and
prints the report; pilot: ``kfac-hpc sweep --backend parsl-slurm``, which runs every point in
one allocation and prints the report), side by side, the two orders alternating per round.

Both get ``--max-concurrent 4``: no throttle for the arrays (4 points per array), a 16-node
pilot. Needs the 16-node cluster (``bash slurm/cluster.sh start --nodes 16``):

    SLURM_CONF=.work/slurm/etc/slurm.conf .venv/bin/python benchmarks/bench_pilot.py [ROUNDS]

ROUNDS defaults to 3 (median, min and max over rounds).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    if "SLURM_CONF" not in os.environ:
        raise SystemExit("set SLURM_CONF (bash slurm/cluster.sh env) and start the cluster first")
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    times: dict[str, list[float]] = {name: [] for name in BACKENDS}
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-pilot-") as tmp:
        for r in range(rounds):
            order = list(BACKENDS) if r % 2 == 0 else list(reversed(BACKENDS))
            for backend in order:
                times[backend].append(one_sweep(Path(tmp), backend, r))
                print(f"round {r}: {backend:6} {times[backend][-1]:6.1f} s", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"\n12 points (nodes 1,2,4 x 4 repeats), {rounds} round(s), sweep -> report:")
    print(f"{'backend':8} {'median_s':>9} {'min_s':>7} {'max_s':>7}")
    for name, values in times.items():
        print(f"{name:8} {statistics.median(values):9.1f} {min(values):7.1f} {max(values):7.1f}")
    ratio = statistics.median(times["arrays"]) / statistics.median(times["pilot"])
    print(f"arrays / pilot (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
