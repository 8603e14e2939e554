"""Time to target accuracy of the training methods side by side on MNIST-1D, at 1, 2 and 4 ranks.

    .venv/bin/python benchmarks/bench_tts_methods.py                 # all of it (about 2 hours)
    .venv/bin/python benchmarks/bench_tts_methods.py --tune          # the grids, seeds 0-2
    .venv/bin/python benchmarks/bench_tts_methods.py --ranks 1 --round 1   # one round at P = 1
    .venv/bin/python benchmarks/bench_tts_methods.py --ranks 1 --round 1 --seed 3  # held out
    .venv/bin/python benchmarks/bench_tts_methods.py --report        # the table of stored rounds

The parts can run as separate commands (each a few minutes, e.g. under a machine lock): they
accumulate in benchmarks/results/bench_tts_methods.rounds.json, and ``--report`` prints the
table and the target (SGD+K-FAC <= 0.75x SGD's time at 1 rank, median over held-out seeds;
``--check``: exit 1 when missed), and writes benchmarks/results/bench_tts_methods.json.

Task: MNIST-1D (generated locally, 32,000 training and 8,000 test sequences of length 40), the
paper's 1-D CNN widened to 160 channels (``--cnn1d-channels 160``, 0.16 M parameters, so that a
step is compute, not Python overhead), global batch 1024 (strong scaling), constant learning
rate, no weight decay, test accuracy every 20 steps (``--eval-every-steps``), stopped at 98 %.
Every run is the real job (``kfac-hpc train``; ``mpiexec -n P`` and gloo for P > 1, one thread
per rank) with seed 0 (the same for every method; the tuning and held-out rounds use others).
Methods: SGD (momentum 0.9, 0.95 or 0.98), Adam,
SGD+K-FAC (expand; factors every 10 steps, damped inverses every 100, lr 0.1: the KL clip
bounds every step, so damping and KL clip are its grid), SGD+K-FAC-reduce (the same at
K-FAC's setting), FOSI with an SGD base (k = 10, 20 Lanczos steps,
an ESE at step 20 and every 200 steps after; at P > 1 it is DHO2: coordinates sharded over the
ranks), and DHO2 with pipelined curvature (``--curvature-ranks 1``, P > 1 only: one rank
computes the ESEs, the others train on (P − 1)/P of the global batch), and FOSI with the cheap
ESE (``fosi-cheap``, at FOSI's setting: Hessian-vector products on a quarter of each rank's
batch, a float32 Lanczos basis with partial reorthogonalization), and the same with its first
ESE only (``fosi-cheap-once``: the interval set to the step cap, so one ESE, at step 20).

1. ``--tune``: each method's grid (``METHODS``: lr and momentum for SGD and for FOSI's SGD
   base, damping and KL clip for K-FAC, lr for Adam) at the method's smallest P (1; 2
   for DHO2 with pipelined curvature, whose curvature is a step behind: FOSI's momentum 0.95
   diverged with it at P = 4), once at each of the seeds ``TUNE_SEEDS``, ``--jobs`` runs at a
   time; the setting with the fewest steps to target, median over the seeds (then the
   fewest on average, then the shorter median time), is kept for every P (K-FAC-reduce
   takes K-FAC's, DHO2 and both FOSIs with the cheap ESE FOSI's; FOSI has its own grid: it scales
   its SGD base's update by up to 3, so SGD's lr diverges with it); a diverged run counts as
   not reached (infinitely many steps); rounds measured with a setting no longer chosen are
   dropped, and so is all a method holds when its grid changed (the other methods' tuning and
   rounds are kept; adding or removing a method without a grid of its own changes none).
2. ``--round R``: every method at each of ``--ranks`` once, the order rotating from round to
   round (``harness.rotation``), so machine noise hits all alike; a stored (round, P, method)
   is replaced.
3. ``--report``: per (P, method) the median, min and max over rounds of the time to target (the
   run's wall time at the first evaluation at or above the target, as run.json reports it:
   evaluations included; data generation and torch import excluded), the median steps to
   target and mean step time (all phases), the ratio to SGD's median at the same P, the ESE
   share of the step time, and the peak resident set (max over rounds; rank 0). The load
   averages seen at the start and end of every part are printed with it.
4. ``--round R --seed S`` (S above ``TUNE_SEEDS``): a round at a held-out seed, with the
   settings chosen on the tuning seeds; ``--report`` lists these apart (time to target and
   steps per seed, and each method's ratio to SGD at the same seed and round, median over
   seeds): what the choice is worth on seeds it was not picked on.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from itertools import product
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
# the accumulated tuning and rounds (harness.Benchmark writes bench_tts_methods.json)
RESULTS = harness.RESULTS_DIR / "bench_tts_methods.rounds.json"
SAMPLES, TARGET = 32000, 0.98
# a run that has not reached the target by then counts as not reached (a non-finite loss ends
# the job sooner); a step cap, not a wall-time one, so that load cannot cut a converging run
MAX_STEPS = 800
KFAC_TARGET = 0.75  # SGD+K-FAC's time to target over SGD's at 1 rank, held-out seeds
TASK = ["--dataset", "mnist1d", "--model", "cnn1d", "--num-samples", str(SAMPLES)]
TASK += [
    "--cnn1d-channels",
    "160",
    "--batch-size",
    "1024",
    "--steps",
    str(MAX_STEPS),
    "--seed",
    "0",
]
TASK += ["--lr-schedule", "constant", "--weight-decay", "0", "--eval-every-steps", "20"]
TASK += ["--target-accuracy", str(TARGET), "--stop-at-target"]
QUIET = ["--no-progress", "--log-every", "20", "--backend", "gloo"]
KFAC = ["--kfac", "--factor-update-steps", "10", "--inv-update-steps", "100"]
KFAC += ["--compute-method", "inverse"]
FOSI = ["--fosi", "--fosi-k", "10", "--lanczos-iters", "20", "--fosi-warmup", "20"]
FOSI += ["--ese-every", "200", "--fosi-alpha", "0.01"]
# the cheap ESE: products on a quarter of the batch, a basis in the parameters' dtype (float32)
# reorthogonalized only where it drifts
CHEAP_ESE = ["--fosi-curvature-fraction", "0.25", "--fosi-lanczos-dtype", "training"]
CHEAP_ESE += ["--fosi-reorthogonalize", "partial"]
# a grid point: job options (names as in the job's config) and their values
Setting = dict[str, float]
# every grid point runs at each of these seeds; the choice takes the medians over them (one
# seed picks the luckiest draw: at seed 0 alone SGD's chosen setting took 248 steps, and
# 260-340 at five other seeds)
TUNE_SEEDS = (0, 1, 2)


def grid(**axes: tuple[float, ...]) -> tuple[Setting, ...]:
    """Every combination of the values of ``axes`` (option name -> values), the last fastest."""
    return tuple(dict(zip(axes, values, strict=True)) for values in product(*axes.values()))


# method: (flags, grid, or the method whose tuned setting it takes, and the smallest P)
METHODS: dict[str, tuple[list[str], tuple[Setting, ...] | str, int]] = {
    "sgd": (["--no-kfac"], grid(lr=(0.1, 0.15, 0.2, 0.3), momentum=(0.9, 0.95, 0.98)), 1),
    "adam": (["--no-kfac", "--optimizer", "adam"], grid(lr=(0.001, 0.003, 0.01, 0.03)), 1),
    # the KL clip bounds every step here, so it, not the lr, sets the step length
    "sgd+kfac": (
        KFAC,
        grid(lr=(0.1,), damping=(0.003, 0.01, 0.03), kl_clip=(5e-4, 1e-3, 2e-3, 4e-3)),
        1,
    ),
    "sgd+kfac-reduce": ([*KFAC, "--kfac-approx", "reduce"], "sgd+kfac", 1),
    # FOSI scales the SGD update by up to --fosi-clip (3): SGD's lr diverges with it
    "fosi": (FOSI, grid(lr=(0.05, 0.1, 0.2), momentum=(0.9, 0.95)), 1),
    "fosi-cheap": ([*FOSI, *CHEAP_ESE], "fosi", 1),
    # the cheap ESE once, at step 20: no second ESE before the target (~300 steps)
    "fosi-cheap-once": ([*FOSI, *CHEAP_ESE, "--ese-every", str(MAX_STEPS)], "fosi", 1),
    # its curvature is a step behind: tuned on its own, at its smallest P
    "dho2-pipelined": ([*FOSI, "--curvature-ranks", "1"], grid(lr=(0.1,), momentum=(0.9, 0.95)), 2),
}

# what --tune searched, as stored (a method whose grid changed is tuned afresh)
GRIDS = json.loads(json.dumps({m: g for m, (_, g, _) in METHODS.items()}))
GRIDS["__tune_seeds__"] = list(TUNE_SEEDS)


def searched(grids: dict[str, Any]) -> dict[str, Any]:
    """The grids that were searched: a method that takes another's setting searched none, so
    adding or removing one leaves the stored tuning and rounds valid."""
    return {m: g for m, g in grids.items() if not isinstance(g, str)}


def as_flags(setting: Setting) -> list[str]:
    """The job's command-line flags of ``setting``."""
    return [f for k, v in setting.items() for f in (f"--{k.replace('_', '-')}", f"{v:g}")]


def label(setting: Setting) -> str:
    """``setting`` in a few characters, e.g. ``lr 0.2 momentum 0.9``."""
    return " ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in setting.items())


def data_cache() -> Path:
    """A folder holding the generated MNIST-1D arrays, filled once (seconds) for every run."""
    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.workloads import load_data

    cache = Path(tempfile.gettempdir()) / "kfac-hpc-bench-mnist1d"
    cache.mkdir(exist_ok=True)
    load_data(TrainConfig(dataset="mnist1d", num_samples=SAMPLES, data_path=str(cache)))
    return cache


def run(
    ranks: int, method: str, setting: Setting, cache: Path, work: Path, seed: int = 0
) -> dict[str, Any]:
    """One real run; its run.json figures (time to target None when not reached), or, when
    the job fails, ``error``: the last line it wrote (a failure is a result, not the end)."""
    task = [
        str(seed) if prev == "--seed" else a for prev, a in zip(["", *TASK[:-1]], TASK, strict=True)
    ]
    args = [
        *task,
        *QUIET,
        "--data-path",
        str(cache),
        *METHODS[method][0],
        *as_flags(setting),
    ]
    job = harness.run_job(args, ranks, work)
    if job.error is not None:
        return {
            "ranks": ranks,
            "method": method,
            "setting": setting,
            "seed": seed,
            "error": job.error,
        }
    summary = job.summary
    phases = summary["phases_s"]
    step_s = sum(phases.values())
    return {
        "ranks": ranks,
        "method": method,
        "setting": setting,
        "seed": seed,
        "tts_s": summary["time_to_target_s"],
        "steps": summary["step_to_target"],
        "best_accuracy": summary["best_accuracy"],
        "step_s": step_s,
        "phases_s": phases,
        "ese_share": phases.get("ese", 0.0) / step_s if step_s else 0.0,
        "rss_mib": summary["peak_rss_bytes"] / 2**20,
    }


def load_results(fresh_task: bool = False) -> dict[str, Any]:
    """The stored results; with ``fresh_task`` (tuning), a new file when it holds another
    task or tuning seeds, and the methods whose grid changed dropped (tuning, settings and
    rounds)."""
    old = RESULTS.with_name("bench_tts_methods.json")  # where the rounds were kept before
    if not RESULTS.exists() and old.exists() and "harness" not in json.loads(old.read_text()):
        old.replace(RESULTS)
    stored: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if stored.get("task") == TASK and searched(stored["grids"]) == searched(GRIDS):
        return {**stored, "grids": GRIDS}
    if stored and not fresh_task:
        sys.exit(f"{RESULTS.name} holds another task or grid: run --tune first")
    if stored.get("task") != TASK or stored["grids"].get("__tune_seeds__") != list(TUNE_SEEDS):
        return {"task": TASK, "grids": GRIDS, "chosen": {}, "tune": [], "runs": [], "load": []}
    # the same task, some grids changed: keep what the methods with an unchanged grid hold
    keep = {m for m, g in GRIDS.items() if isinstance(g, list) and stored["grids"].get(m) == g}
    keep |= {m for m, g in GRIDS.items() if isinstance(g, str) and g in keep}
    return {
        **stored,
        "grids": GRIDS,
        "chosen": {m: s for m, s in stored["chosen"].items() if m in keep},
        "tune": [t for t in stored["tune"] if t["method"] in keep],
        "runs": [r for r in stored["runs"] if r["method"] in keep],
    }


def _show(r: dict[str, Any], prefix: str) -> None:
    if "error" in r:
        print(f"  {prefix} P={r['ranks']} {r['method']:16s} {label(r['setting'])}: {r['error']}")
        return
    tts = "not reached" if r["tts_s"] is None else f"{r['tts_s']:.1f} s"
    print(f"  {prefix} P={r['ranks']} {r['method']:16s} {label(r['setting']):24s} {tts:12s} "
          f"steps={r['steps']} step={1e3 * r['step_s']:.1f} ms best={r['best_accuracy']:.3f}",
          flush=True)  # fmt: skip


def follow(results: dict[str, Any]) -> None:
    """A method without a grid takes the tuned setting of the method it names."""
    for method, (_, source, _) in METHODS.items():
        if isinstance(source, str) and source in results["chosen"]:
            results["chosen"][method] = results["chosen"][source]


def tune(results: dict[str, Any], methods: list[str], cache: Path, work: Path, jobs: int) -> None:
    """The grids of ``methods``, each at its smallest P and every seed of ``TUNE_SEEDS``
    (``jobs`` runs at a time: median, then mean steps decide, median time only breaks
    ties); their settings (and those that follow them) are stored, and rounds measured with
    other settings are dropped."""
    for method in methods:
        _, points, ranks = METHODS[method]
        if isinstance(points, str):
            continue
        with ThreadPoolExecutor(jobs) as pool:
            futures = [
                pool.submit(run, ranks, method, setting, cache, work, seed)
                for setting in points
                for seed in TUNE_SEEDS
            ]
            for future in as_completed(futures):
                r = future.result()
                _show(r, f"tune seed {r['seed']}")
            done = [f.result() for f in futures]
        results["tune"] = [t for t in results["tune"] if t["method"] != method] + done
        per = len(TUNE_SEEDS)
        best = min(
            range(len(points)), key=lambda i: harness.tts_score(done[i * per : (i + 1) * per])
        )
        results["chosen"][method] = points[best]
        follow(results)
        harness.save_json(RESULTS, results)
    chosen = results["chosen"]
    results["runs"] = [r for r in results["runs"] if chosen.get(r["method"]) == r["setting"]]


def run_round(
    results: dict[str, Any],
    index: int,
    ranks: list[int],
    methods: list[str],
    cache: Path,
    work: Path,
    seed: int = 0,
) -> None:
    """Every (P, method) once at ``seed``; replaces what the file held for this round, seed
    and these cells."""
    follow(results)
    untuned = [m for m in methods if m not in results["chosen"]]
    if untuned:
        sys.exit(f"no tuned setting stored for {', '.join(untuned)}: run --tune first")
    for p in ranks:
        for method in harness.rotation(methods, index):
            if p < METHODS[method][2]:
                continue
            r = {"round": index, **run(p, method, results["chosen"][method], cache, work, seed)}
            _show(r, f"round {index}" + (f" seed {seed}" if seed else ""))
            key = (index, p, method, seed)
            runs = [x for x in results["runs"] if _cell(x) != key]
            results["runs"] = [*runs, r]
            harness.save_json(RESULTS, results)


def _cell(r: dict[str, Any]) -> tuple[int, int, str, int]:
    """(round, P, method, seed) of a stored run (seed 0 before seeds were recorded)."""
    return r["round"], r["ranks"], r["method"], r.get("seed", 0)


def report(results: dict[str, Any]) -> dict[tuple[int, str], harness.Stats]:
    """The table: one line per P and method, from every stored round of seed 0 (the seed the
    grids were searched at); then the held-out seeds (their ratios to SGD are returned)."""
    cells: dict[tuple[int, str], list[dict[str, Any]]] = {}
    tuned_seed = [r for r in results["runs"] if r.get("seed", 0) == 0]
    for r in sorted(tuned_seed, key=lambda r: (r["ranks"], list(METHODS).index(r["method"]))):
        cells.setdefault((r["ranks"], r["method"]), []).append(r)
    print(f"MNIST-1D, cnn1d x160, batch 1024, time to {TARGET:.0%} test accuracy "
          "(median [min-max] over rounds)")  # fmt: skip
    print(" P  method            tts s, median [min-max]  rounds  steps  step ms  "
          "vs SGD  ESE share  peak RSS MiB  setting")  # fmt: skip
    sgd: dict[int, float] = {}
    for (p, m), every in cells.items():
        runs = [r for r in every if "error" not in r]
        if not runs:
            print(f"{p:2d}  {m:16s}  failed {len(every)}/{len(every)}: {every[-1]['error']}")
            continue
        times = [r["tts_s"] for r in runs if r["tts_s"] is not None]
        med = statistics.median(times) if times and len(times) == len(every) else None
        if m == "sgd" and med is not None:
            sgd[p] = med
        ratio = f"{med / sgd[p]:.2f}x" if med is not None and p in sgd else "-"
        tts = (
            f"{med:6.1f} [{min(times):.1f}-{max(times):.1f}]"
            if med is not None
            else f"reached {len(times)}/{len(every)}"
        )
        steps = statistics.median(r["steps"] or 0 for r in runs)
        step_ms = 1e3 * statistics.median(r["step_s"] for r in runs)
        ese = statistics.median(r["ese_share"] for r in runs)
        rss = max(r["rss_mib"] for r in runs)
        print(f"{p:2d}  {m:16s}  {tts:23s}  {len(every):6d}  {steps:5g}  {step_ms:7.1f}  "
              f"{ratio:>6s}  {ese:9.1%}  {rss:12.0f}  {label(results['chosen'][m])}")  # fmt: skip
    seeds = ",".join(str(x) for x in TUNE_SEEDS)
    print(f"grids, each at its method's smallest P, one run at each seed {seeds}: median time "
          "and steps to target, then steps per seed (- not reached; * chosen):")  # fmt: skip
    points: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in results["tune"]:
        points.setdefault((t["method"], json.dumps(t["setting"])), []).append(t)
    for (method, setting), runs in points.items():
        chosen = "*" if results["chosen"].get(method) == json.loads(setting) else " "
        steps, _, tts = harness.tts_score(runs)
        median = "not reached" if math.isinf(tts) else f"{tts:6.1f} s {steps:5g} steps"
        per_seed = " ".join(
            f"{r.get('seed', 0)}:" + ("-" if r.get("tts_s") is None else str(r["steps"]))
            for r in sorted(runs, key=lambda r: r.get("seed", 0))
        )
        print(f"  {method:16s} {chosen}{label(json.loads(setting)):36s} {median:20s} {per_seed}")
    print("P = 1, mean ms per step by phase (median over rounds):")
    for (p, m), every in cells.items():
        runs = [r for r in every if "error" not in r]
        if p == 1 and runs:
            phases = {
                n: 1e3 * statistics.median(r["phases_s"][n] for r in runs)
                for n in runs[0]["phases_s"]
            }
            shown = ", ".join(f"{n} {v:.1f}" for n, v in phases.items() if v >= 0.05)
            print(f"  {m:16s} {shown}")
    ratios = held_out(results["runs"])
    for part in results["load"]:
        print(f"load average {part['what']}: start {part['start']}, end {part['end']}")
    return ratios


def held_out(runs: list[dict[str, Any]]) -> dict[tuple[int, str], harness.Stats]:
    """Per P and method, the runs at seeds other than the tuning seeds: steps and time to
    target per seed, and the median over seeds of the time-to-target ratio to SGD at the same
    seed (and round): what the choice is worth on seeds it was not picked on. Returns those
    ratios per (P, method)."""
    by_cell = {_cell(r): r for r in runs if r.get("seed", 0) not in TUNE_SEEDS and "error" not in r}
    found: dict[tuple[int, str], harness.Stats] = {}
    if not by_cell:
        return found
    print(f"held-out seeds (settings tuned at seeds {','.join(str(x) for x in TUNE_SEEDS)}): "
          "time to target s (steps) per seed; ratio to SGD at the same seed, median "
          "[min-max]")  # fmt: skip
    for p, method in sorted(
        {(k[1], k[2]) for k in by_cell}, key=lambda c: (c[0], list(METHODS).index(c[1]))
    ):
        cells = sorted((k[3], k[0], r) for k, r in by_cell.items() if k[1:3] == (p, method))
        shown = ", ".join(
            f"{seed}: "
            + ("not reached" if r["tts_s"] is None else f"{r['tts_s']:.1f} ({r['steps']})")
            for seed, _, r in cells
        )
        ratios = [
            r["tts_s"] / sgd["tts_s"]
            for seed, index, r in cells
            if (sgd := by_cell.get((index, p, "sgd", seed))) and r["tts_s"] and sgd["tts_s"]
        ]
        ratio = ""
        if ratios and method != "sgd":
            found[(p, method)] = s = harness.Stats.of(ratios)
            ratio = f"{s.median:.2f}x [{s.min:.2f}-{s.max:.2f}]"
        print(f"{p:2d}  {method:16s} {ratio:22s} seed {shown}")
    return found


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--tune", action="store_true", help="the grids of --methods")
    parser.add_argument("--jobs", type=int, default=1, help="--tune: runs at a time")
    parser.add_argument("--round", type=int, help="run round R of every method at --ranks")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--methods", default=",".join(METHODS), help="a subset, in this order")
    parser.add_argument("--report", action="store_true", help="print the stored table")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help=f"--round: the job's seed (0: the table's; a held-out seed > {max(TUNE_SEEDS)})",
    )
    args = parser.parse_args()
    if args.seed and args.seed in TUNE_SEEDS:
        parser.error(
            f"--seed: {args.seed} is a tuning seed; give 0 (the table's) or a held-out seed "
            f"> {max(TUNE_SEEDS)}"
        )
    ranks = [int(p) for p in args.ranks.split(",")]
    methods = [m for m in METHODS if m in args.methods.split(",")]
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(
            f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}"
        )
    everything = not (args.tune or args.round or args.report)
    bench = harness.Benchmark("bench_tts_methods")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.tune or everything:
            start = harness.load_average()
            results = load_results(fresh_task=True)
            tune(results, methods, data_cache(), work, args.jobs)
            end = harness.load_average()
            results["load"].append({"what": f"tune {args.methods}", "start": start, "end": end})
            harness.save_json(RESULTS, results)
        for index in [args.round] if args.round else (1, 2, 3) if everything else ():
            start = harness.load_average()
            results = load_results()
            what = f"round {index} P={args.ranks} seed {args.seed} ({time.strftime('%H:%M')})"
            run_round(results, index, ranks, methods, data_cache(), work, args.seed)
            end = harness.load_average()
            results["load"].append({"what": what, "start": start, "end": end})
            harness.save_json(RESULTS, results)
    if args.report or everything:
        ratios = report(load_results())
        kfac = ratios.get((1, "sgd+kfac"))
        bench.target(
            "SGD+K-FAC / SGD time to target, P = 1",
            kfac.median if kfac else None,
            KFAC_TARGET,
            "<=",
            "×",
            "held-out seeds, median",
        )
        summary = {f"P={p} {m}": r.as_dict() for (p, m), r in ratios.items()}
        return bench.finish({"held_out_ratio_to_sgd": summary}, check=args.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
