"""The transformer workload: SGD, Adam, SGD+K-FAC and FOSI/DHO2 side by side at 1, 2 and 4 ranks.

    .venv/bin/python benchmarks/bench_transformer.py                  # tune, then held-out rounds
    .venv/bin/python benchmarks/bench_transformer.py --reuse-tuning   # rounds with stored settings
    .venv/bin/python benchmarks/bench_transformer.py --ranks 1 --seeds 3 --methods sgd,kfac

Task: ``--model gpt`` (2 pre-LayerNorm blocks, d_model 32, 4 heads, context 32: 43 k
parameters) on ``generated_text`` (4,096 training windows), global batch 32 (strong scaling),
constant learning rate, no weight decay, at most 150 steps (a run stops at the target), the
validation loss every 10 steps. Every
run is the real job (``kfac-hpc train``; ``mpiexec -n P`` and gloo for P > 1, one thread per
rank). Time to target = the run's wall time at the first validation loss at or below
``TARGET_LOSS`` (evaluations included); steps to target = that evaluation's step.

1. Tuning: each method's grid (``METHODS``) at 1 rank, one run at each seed of ``TUNE_SEEDS``;
   the setting with the fewest steps to target, median over the seeds, wins
   (``harness.tts_score``: then the mean steps, then the median time; a run that misses the
   target counts as infinitely many steps). ``kfac_10_100`` takes K-FAC's setting. The choice
   is stored in benchmarks/results/bench_transformer.tuned.json (``--reuse-tuning`` reads it).
2. Rounds at held-out seeds (``--seeds``, default 3 and 4): every method at each of ``--ranks``
   once per seed, the order rotating from round to round (``harness.rotation``). At P > 1 FOSI
   is DHO2 (its Lanczos coordinates sharded over the ranks).

Per (P, method) it reports the median, min and max over the rounds of the mean step time (all
phases, from run.json), of the time and steps to target, FOSI's ESE share of the step, and the
ratios to SGD's at the same P and seed. Targets: K-FAC 10/100's step time ≤ 1.5× SGD's and
K-FAC's time to target ≤ SGD's, both at 1 rank (held-out seeds).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from itertools import product
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py, beside this script

TUNED = harness.RESULTS_DIR / "bench_transformer.tuned.json"
TARGET_LOSS = 1.8  # nats per byte; 2.92 without context, 1.52 given the previous byte
STEP_RATIO_TARGET = 1.5
TUNE_SEEDS = (0, 1, 2)
TASK = ["--model", "gpt", "--dataset", "generated_text", "--num-samples", "4096"]
TASK += ["--gpt-layers", "2", "--gpt-d-model", "32", "--gpt-heads", "4", "--context-length", "32"]
TASK += ["--batch-size", "32", "--steps", "150", "--lr-schedule", "constant"]
TASK += ["--weight-decay", "0", "--eval-every-steps", "10", "--log-every", "10"]
TASK += [
    "--stop-at-target",
    "--target-loss",
    str(TARGET_LOSS),
]  # the steps after it: nothing to learn
TASK += ["--no-progress", "--backend", "gloo"]
# FOSI on Adam, as FOSI's paper runs its language models: k = 8 top eigenpairs from 16
# Lanczos steps, the first ESE at step 10 and one every 25 steps after.
FOSI = ["--fosi", "--optimizer", "adam", "--fosi-k", "8", "--lanczos-iters", "16"]
FOSI += ["--fosi-warmup", "10", "--ese-every", "25"]
KFAC_10_100 = ["--kfac", "--factor-update-steps", "10", "--inv-update-steps", "100"]


def _grid(**axes: tuple[float, ...]) -> list[dict[str, float]]:
    return [dict(zip(axes, values, strict=True)) for values in product(*axes.values())]


# method: (its flags, and its grid or the method whose tuned setting it takes)
METHODS: dict[str, tuple[list[str], list[dict[str, float]] | str]] = {
    "sgd": (["--no-kfac", "--momentum", "0.9"], _grid(lr=(0.05, 0.1, 0.2))),
    "adam": (["--no-kfac", "--optimizer", "adam"], _grid(lr=(0.001, 0.003, 0.01))),
    "kfac": (["--kfac", "--momentum", "0.9"], _grid(lr=(0.1, 0.3, 1.0))),
    "kfac_10_100": ([*KFAC_10_100, "--momentum", "0.9"], "kfac"),
    "fosi": (FOSI, _grid(lr=(0.001, 0.003, 0.01))),
}


def _flags(setting: dict[str, float]) -> list[str]:
    return [arg for key, value in setting.items() for arg in (f"--{key}", str(value))]


def run(
    ranks: int, method: str, setting: dict[str, float], seed: int, work: Path
) -> dict[str, Any]:
    """One real run: its mean step time, ESE share, and the wall time and step of the first
    validation loss at or below the target (None when not reached)."""
    job = harness.run_job(
        [*TASK, "--seed", str(seed), *METHODS[method][0], *_flags(setting)], ranks, work
    )
    if job.error is not None:
        raise SystemExit(f"{method} {setting} at P={ranks}: {job.error}")
    summary = job.summary
    records = [
        json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [r for r in records if r.get("kind") == "eval"]
    reached = next((r for r in evals if r["loss"] <= TARGET_LOSS), None)
    phases = summary["phases_s"]
    step_s = sum(phases.values())
    return {
        "ranks": ranks,
        "method": method,
        "setting": setting,
        "seed": seed,
        "step_s": step_s,
        "ese_share": phases.get("ese", 0.0) / step_s,
        "tts_s": None if reached is None else reached["wall_s"],
        "steps": None if reached is None else reached["step"],
        "final_loss": evals[-1]["loss"],
    }


def _show(r: dict[str, Any], prefix: str) -> None:
    tts = "not reached" if r["tts_s"] is None else f"{r['tts_s']:.1f} s"
    print(f"{prefix} P={r['ranks']} {r['method']:12} {r['setting']} seed {r['seed']}: "
          f"step {1000 * r['step_s']:.1f} ms, to {TARGET_LOSS}: {tts} (step {r['steps']}), "
          f"last validation loss {r['final_loss']:.3f}", flush=True)  # fmt: skip


def tune(methods: list[str], work: Path) -> dict[str, dict[str, float]]:
    """Every grid at 1 rank and each tuning seed; the winning setting of each method."""
    chosen: dict[str, dict[str, float]] = {}
    tried: list[dict[str, Any]] = []
    for method in methods:
        grid = METHODS[method][1]
        if isinstance(grid, str):
            continue
        scores = []
        for setting in grid:
            runs = [run(1, method, setting, seed, work) for seed in TUNE_SEEDS]
            for r in runs:
                _show(r, "tune")
            tried += runs
            scores.append(harness.tts_score(runs))
        chosen[method] = grid[scores.index(min(scores))]
    for method, (_, grid) in METHODS.items():
        if isinstance(grid, str) and grid in chosen:
            chosen[method] = chosen[grid]
    TUNED.parent.mkdir(parents=True, exist_ok=True)
    TUNED.write_text(json.dumps({"task": TASK, "chosen": chosen, "tune": tried}, indent=1))
    return chosen


def _stored_tuning() -> dict[str, dict[str, float]]:
    stored = json.loads(TUNED.read_text()) if TUNED.exists() else {}
    if stored.get("task") != TASK:
        raise SystemExit(f"{TUNED.name} is missing or holds another task: run without "
                         "--reuse-tuning")  # fmt: skip
    return dict(stored["chosen"])


def _per_seed_ratio(
    runs: list[dict[str, Any]], p: int, method: str, key: str
) -> harness.Stats | None:
    """Per held-out seed, ``key`` of ``method`` over SGD's at P = ``p``; None when either
    missed the target at some seed."""
    mine = {r["seed"]: r[key] for r in runs if r["ranks"] == p and r["method"] == method}
    sgd = {r["seed"]: r[key] for r in runs if r["ranks"] == p and r["method"] == "sgd"}
    pairs = [(mine[s], sgd[s]) for s in sorted(mine) if s in sgd]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    return harness.Stats.of(harness.ratios([a for a, _ in pairs], [b for _, b in pairs]))


def _summarise(runs: list[dict[str, Any]], ranks: list[int], methods: list[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for world, method in product(ranks, methods):
        mine = [r for r in runs if r["ranks"] == world and r["method"] == method]
        reached = [r for r in mine if r["tts_s"] is not None]
        cell = {
            "step_ms": harness.Stats.of(r["step_s"] * 1000 for r in mine),
            "ese_share": statistics.median(r["ese_share"] for r in mine),
            "tts_s": harness.Stats.of(r["tts_s"] for r in reached) if reached else None,
            "steps_to_target": statistics.median(r["steps"] for r in reached) if reached else None,
            "reached": f"{len(reached)}/{len(mine)}",
            "step_ratio_to_sgd": _per_seed_ratio(runs, world, method, "step_s"),
            "tts_ratio_to_sgd": _per_seed_ratio(runs, world, method, "tts_s"),
        }
        table[f"{world}/{method}"] = cell

        def fmt(value: Any, spec: str) -> str:
            return "—" if value is None else format(value, spec)

        print(f"P={world} {method:12} step {cell['step_ms']:.1f} ms  "
              f"time to target {fmt(cell['tts_s'], '.1f')} s ({cell['reached']} reached, "
              f"median step {cell['steps_to_target']})  step/SGD "
              f"{fmt(cell['step_ratio_to_sgd'], '.2f')}  tts/SGD "
              f"{fmt(cell['tts_ratio_to_sgd'], '.2f')}  ESE {cell['ese_share']:.0%}")  # fmt: skip
    return table


def main() -> int:
    p = harness.parser(__doc__, rounds=None)
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    p.add_argument("--seeds", default="3,4", help="held-out seeds, one round each (default 3,4)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--reuse-tuning", action="store_true", help="settings from the last tuning")
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or "sgd" not in methods:
        p.error(f"--methods: {','.join(unknown) or 'sgd missing'}; choose from "
                f"{','.join(METHODS)} (sgd included: every ratio is to it)")  # fmt: skip
    if set(seeds) & set(TUNE_SEEDS):
        p.error(f"--seeds: held-out seeds must not be tuning seeds {TUNE_SEEDS}")
    bench = harness.Benchmark("bench_transformer")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-transformer-") as tmp:
        chosen = _stored_tuning() if args.reuse_tuning else tune(methods, Path(tmp))
        print(f"tuned at 1 rank, seeds {TUNE_SEEDS}: {chosen}", flush=True)
        for index, seed in enumerate(seeds):
            for world in ranks:
                for method in harness.rotation(methods, index):
                    r = {"round": index, **run(world, method, chosen[method], seed, Path(tmp))}
                    runs.append(r)
                    _show(r, f"round {index}")
    print(f"\nmedian (min-max) over held-out seeds {seeds}; target validation loss {TARGET_LOSS}")
    table = _summarise(runs, ranks, methods)
    one = table.get("1/kfac_10_100", {}).get("step_ratio_to_sgd")
    bench.target(
        "K-FAC 10/100 step time / SGD, 1 rank",
        None if one is None else one.median,
        STEP_RATIO_TARGET,
        "<=",
        "×",
    )
    measured = None
    if 1 in ranks and "kfac" in methods:
        tts: harness.Stats | None = table["1/kfac"]["tts_ratio_to_sgd"]
        measured = float("nan") if tts is None else tts.median
    bench.target(
        f"K-FAC time to loss {TARGET_LOSS} / SGD, 1 rank (held-out seeds)",
        measured,
        1.0,
        "<=",
        "×",
        "nan: K-FAC or SGD missed the target at some seed",
    )
    document = {"runs": runs, "table": table, "chosen": chosen, "cpus": os.cpu_count()}
    return bench.finish(document, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
