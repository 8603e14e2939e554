"""``kfac-hpc collect`` on 1,000 realistic run directories (issue 15).

Each run is a 20-epoch CIFAR-sized run: 7,800 steps, a logging window every 20 steps (390
windows), 4 ranks per node on 1-16 nodes with all 12 phases per rank, an eval per epoch, two
requeued attempts on every tenth point; about 2 GB for 1,000 runs. They are written once with the
synthetic-run writer under .work/bench-collect/ (gitignored) and reused by later runs.

Times, through the CLI (a subprocess, as a user runs it), in each round:
  first     collect with no cache (the OS page cache is warm: the files were just written/read)
  again     collect after 10 runs changed (their metrics.jsonl touched)
the CPU time of the collector's process tree (user + system, its workers included: what the
collector costs, whatever else loads the machine), and its peak memory (RSS summed over the
parent and its workers, sampled every 10 ms). Targets: first <= 3 s and <= 300 MB; again
<= 0.5 s. Also measures, side by side on one run, the reader's orjson pass against the
standard library's json.
Prints median, min and max over the rounds and the table of targets (``--check``: exit 1 when
one is missed); writes benchmarks/results/bench_collect.json.

    .venv/bin/python benchmarks/bench_collect.py [--runs 1000] [--rounds 3] [--check]
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script

from kfac_hpc.analysis.cache import CACHE_DIR
from kfac_hpc.analysis.schema import PHASES

# The synthetic run writer is a test fixture (tests/helpers/synthetic_runs.py): run from a checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / ".work" / "bench-collect"
STEPS, WINDOW, STEPS_PER_EPOCH = 7800, 20, 390
FIRST_S, FIRST_MB, AGAIN_S, CHANGED = 3.0, 300.0, 0.5, 10


def make_sweep(root: Path, runs: int) -> None:
    """``runs`` points: node counts cycle 1..16 (4 ranks each), K-FAC on every other point."""
    phases = {p: 0.001 * (i + 1) for i, p in enumerate(PHASES)}
    epochs = STEPS // STEPS_PER_EPOCH
    points = [
        SyntheticRun(
            f"p{i:05d}",
            2 ** (i % 5),
            0.2 / (2 ** (i % 5)) ** 0.8,
            phases,
            ranks_per_node=4,
            kfac=bool(i % 2),
            seed=i // 10,
            steps=STEPS,
            window_steps=WINDOW,
            accuracy={STEPS_PER_EPOCH * k: 0.9 * k / epochs for k in range(1, epochs + 1)},
            target_accuracy=0.75,
            rank_skew=0.01,
            attempt_ends=(2600, 5200) if i % 10 == 0 else (),
        )
        for i in range(runs)
    ]
    write_sweep(root, points)


def sweep_dir(runs: int) -> Path:
    """The generated sweep for ``runs`` points, written on first use (into a temporary name,
    renamed when complete, so an interrupted generation is never reused)."""
    final = DATA / f"runs{runs}-steps{STEPS}-w{WINDOW}"
    if not (final / "manifest.json").exists():
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        print(f"writing {runs} run dirs to {final} (once) ...", flush=True)
        make_sweep(partial, runs)
        partial.rename(final)
    return final


def _tree_rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/statm") as fh:
                total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(f"/proc/{current}/task/{current}/children") as fh:
                stack.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError):
            continue
    return total


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_collect(sweep: Path, out: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the process tree, peak tree RSS in MB) of one
    ``kfac-hpc collect`` subprocess. The CPU time does not depend on other users' load."""
    cmd = [sys.executable, "-m", "kfac_hpc", "collect", str(sweep), "--out", str(out)]
    cpu = _children_cpu_s()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss_bytes(proc.pid))
        time.sleep(0.01)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"collect failed ({proc.returncode}): {stderr}")
    return wall, _children_cpu_s() - cpu, peak / 1e6


def reader_ratio(sweep: Path, repeats: int = 15) -> dict[str, float]:
    """CPU seconds (least of ``repeats``) to parse one run's metrics.jsonl (rank arrays cut,
    as for a finished run): the reader's orjson pass vs the standard library, line by line."""
    from kfac_hpc.analysis.rundir import _parse_fast, _without_rank_arrays

    raw = (sweep / "runs" / "p00001" / "metrics.jsonl").read_bytes()
    body = _without_rank_arrays(raw).rstrip(b"\n")
    text = body.decode()
    fast, stdlib = [], []
    for _ in range(repeats):  # alternated, so that both see the same load
        t = time.process_time()
        _parse_fast(body)
        fast.append(time.process_time() - t)
        t = time.process_time()
        [json.loads(line) for line in text.split("\n")]
        stdlib.append(time.process_time() - t)
    return {"orjson_s": min(fast), "stdlib_s": min(stdlib)}


def collect_round(sweep: Path, out: Path, changed: list[Path]) -> dict[str, float]:
    """One round: collect with no cache, then again after ``changed`` runs were touched."""
    shutil.rmtree(sweep / CACHE_DIR, ignore_errors=True)
    first = run_collect(sweep, out)
    for path in changed:  # new mtime, same content: the runs are re-read, results agree
        os.utime(path)
    again = run_collect(sweep, out)
    keys = ("s", "cpu_s", "peak_mb")
    return {
        **{f"first_{k}": v for k, v in zip(keys, first, strict=True)},
        **{f"again_{k}": v for k, v in zip(keys, again, strict=True)},
    }


def main() -> int:
    parser = harness.parser(__doc__, rounds=3)
    parser.add_argument(
        "--runs", type=harness.positive_int, default=1000, help="run dirs (fewer: a quick run)"
    )
    args = parser.parse_args()
    sweep = sweep_dir(args.runs)
    bench = harness.Benchmark("bench_collect")
    size_mb = sum(f.stat().st_size for f in sweep.rglob("*") if f.is_file()) / 1e6
    out = DATA / "out"
    changed = [sweep / "runs" / f"p{i:05d}" / "metrics.jsonl" for i in range(CHANGED)]
    # one variant: "again" needs the cache "first" wrote, so the two run in this order
    rounds = harness.interleave(
        {"collect": lambda _r: collect_round(sweep, out, changed)}, args.rounds
    )["collect"]
    figures = {key: harness.Stats.of(r[key] for r in rounds) for key in rounds[0]}
    reader = reader_ratio(sweep)
    print(
        f"kfac-hpc collect, {args.runs} run dirs ({size_mb:.0f} MB), {args.rounds} rounds, "
        f"{os.cpu_count()} CPUs; median (min–max):"
    )
    labels = {
        "first_s": "first collect, wall (s)",
        "first_cpu_s": "first collect, CPU (s)",
        "first_peak_mb": "first peak RSS (MB)",
        "again_s": f"again, {CHANGED} changed, wall (s)",
        "again_cpu_s": f"again, {CHANGED} changed, CPU (s)",
        "again_peak_mb": "again peak RSS (MB)",
    }
    for key, label in labels.items():
        print(f"  {label:<32} {figures[key]:.3f}")
    print(
        f"  first / again: {figures['first_s'].median / figures['again_s'].median:.1f}x; reader "
        f"on one run: orjson {reader['orjson_s'] * 1e3:.2f} ms vs json "
        f"{reader['stdlib_s'] * 1e3:.2f} ms ({reader['stdlib_s'] / reader['orjson_s']:.2f}x)"
    )
    note = f"median of {args.rounds} rounds, {args.runs} runs"
    bench.target("first collect, wall", figures["first_s"].median, FIRST_S, "<=", "s", note)
    bench.target(
        "first collect, peak memory", figures["first_peak_mb"].median, FIRST_MB, "<=", "MB", note
    )
    bench.target(
        f"collect again ({CHANGED} runs changed), wall",
        figures["again_s"].median,
        AGAIN_S,
        "<=",
        "s",
        note,
    )
    result = {
        "runs": args.runs,
        "steps": STEPS,
        "window_steps": WINDOW,
        "sweep_mb": size_mb,
        "rounds": args.rounds,
        **{key: figures[key].as_dict() for key in labels},
        "per_round": rounds,
        "reader": reader,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    return bench.finish(result, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
