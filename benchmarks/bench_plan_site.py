"""`kfac-hpc plan` with a profile calibrated on the local Slurm cluster, against real runs there.

    .venv/bin/python benchmarks/bench_plan_site.py [--rounds 2] [--steps 60] [--methods sgd,fosi]
        [--work-dir DIR] [--check]

Needs the local cluster running (``bash slurm/cluster.sh start``, ``SLURM_CONF`` exported; run
it under the cluster's lock where others share it). One invocation: ``kfac-hpc plan calibrate``
under ``srun`` on 2 nodes of 2 ranks (both links measured, gloo), then per round, in rotating
order, real ``kfac-hpc train`` runs of the small CNN on digits (global batch 128, strong
scaling, factors every step, inverses every 10) under ``srun`` on 2 and 4 nodes of one rank
each, SGD, K-FAC COMM-OPT and FOSI (DHO2: k = 4, 16 Lanczos steps, full reorthogonalization,
float64 basis, an ESE every 10 steps from step 10: 5 ESEs in 60 steps; ``--methods`` picks
some of them). Each run is predicted from its own ``config.json`` with the
calibrated profile (``kfac_hpc.plan.explain.predicted_vs_measured``: the path of
``kfac-hpc plan --explain``); measured: ``run.json``'s per-step means. Per run and phase:
predicted / measured, median (min-max) over rounds. Target (issue 29): every phase within
20 %, reported as the count of (run, phase) points met, the step's among them. The calibration
times the small CNN's own modules too (``--model``), and each run is predicted twice from the
same profile and measurements: with its module fits (``[machine.modules]``: forward and
backward priced by every module's kind and shape) and without them ("rates": the layer curves
by FLOPs plus activation traffic, the model before the fits), side by side; and a third
time as before the modules were timed in the model's own passes ("before": the fits of the
modules timed alone, which calibrate keeps as comments, and no K-FAC forward-hook cost).

Writes benchmarks/results/bench_plan_site.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py, beside this script

from kfac_hpc.plan.explain import predicted_vs_measured
from kfac_hpc.plan.planner import build_cost_model

TOLERANCE = 0.20
MODEL, DATASET, BATCH = "small_cnn", "digits", 128
NODES = (2, 4)
FOSI = ["--fosi", "--fosi-k", "4", "--lanczos-iters", "16", "--fosi-warmup", "10"]
FOSI += ["--ese-every", "10", "--fosi-reorthogonalize", "full", "--fosi-lanczos-dtype", "float64"]
METHODS = {
    "sgd": ["--no-kfac"],
    "kfac-comm-opt": ["--kfac", "--grad-worker-fraction", "comm-opt"],
    "fosi": FOSI,
}
SRUN = ["srun", "--mpi=pmi2", "-t", "10"]
PYTHON = [sys.executable, "-m", "kfac_hpc"]


def calibrate(out: Path) -> None:
    """The profile: srun on 2 nodes of 2 ranks, gloo; eigendecompositions up to the small
    CNN's largest factor (513), the job's overhead on its dataset."""
    argv = [*SRUN, "-N", "2", "--ntasks-per-node", "2", *PYTHON, "plan", "calibrate"]
    argv += ["--out", str(out), "--backend", "gloo", "--eigh-sizes", "32,64,128,256,512"]
    argv += ["--dataset", DATASET, "--model", MODEL]
    _run(argv)


def without_module_fits(site: Path, out: Path) -> None:
    """``site`` without its ``[machine.modules]`` table (the profile the model had before)."""
    kept, skipping = [], False
    for line in site.read_text().splitlines():
        if line.startswith("["):
            skipping = line.strip() == "[machine.modules]"
        if not skipping:
            kept.append(line)
    out.write_text("\n".join(kept) + "\n")


def before_change(site: Path, out: Path) -> None:
    """``site`` as the model priced it before in-pass module timing and the K-FAC forward
    hook's cost: ``[machine.modules]`` from the modules timed alone (the ``# alone:`` rows
    calibrate writes when it keeps the in-pass fits) and no ``kfac_forward_layer_s``."""
    lines = site.read_text().splitlines()
    alone = [line[len("# alone: ") :] for line in lines if line.startswith("# alone: ")]
    kept, section = [], ""
    for line in lines:
        if line.startswith("["):
            section = line.strip()
        if line.startswith("kfac_forward_layer_s"):
            continue
        if alone and section == "[machine.modules]" and line.strip() and line[0] != "[":
            continue
        kept.append(line)
        if alone and line.strip() == "[machine.modules]":
            kept += alone
    out.write_text("\n".join(kept) + "\n")


def train(run_dir: Path, nodes: int, method: str, steps: int) -> None:
    """One real run, one rank a node."""
    argv = [*SRUN, "-N", str(nodes), "--ntasks-per-node", "1", *PYTHON, "train"]
    argv += ["--run-dir", str(run_dir), "--model", MODEL, "--dataset", DATASET]
    argv += ["--batch-size", str(BATCH), "--steps", str(steps), "--log-every", "10"]
    argv += ["--factor-update-steps", "1", "--inv-update-steps", "10", "--no-progress"]
    argv += ["--checkpoint-every", "100000", *METHODS[method]]
    _run(argv)
    world = json.loads((run_dir / "run.json").read_text())["world_size"]
    assert world == nodes, (world, nodes)


def _run(argv: list[str]) -> None:
    env = harness.worker_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(harness.REPO)})
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")


def main() -> int:
    parser = harness.parser(__doc__, rounds=2)
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}"
    )
    parser.add_argument(
        "--work-dir", type=Path, help="keep the profile and run directories here (re-predictable)"
    )
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise SystemExit(f"--methods: {unknown or 'none'}; choose from {', '.join(METHODS)}")
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("SLURM_CONF is not set: start the cluster (bash slurm/cluster.sh start)")
    bench = harness.Benchmark("bench_plan_site")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if args.work_dir is None else args.work_dir
        root.mkdir(parents=True, exist_ok=True)
        site = root / "site.toml"
        calibrate(site)
        planned = build_cost_model(MODEL, DATASET, str(site))
        without_module_fits(site, root / "rates.toml")
        rated = build_cost_model(MODEL, DATASET, str(root / "rates.toml"))
        before_change(site, root / "before.toml")
        before = build_cost_model(MODEL, DATASET, str(root / "before.toml"))
        print(f"profile: {planned.source}", flush=True)
        measured_keys = ("slowdown_curve", "sync", "step_overhead_s", "data_s_per_sample")
        profile_lines = site.read_text().splitlines()
        section = ""
        for line in profile_lines:
            section = line if line.startswith("[") else section
            if (
                line.startswith(measured_keys)
                or section == "[machine.modules]"
                or (line.startswith(("# points", "# batch", "kfac_forward")))
            ):
                print(f"  {line}", flush=True)

        def point(nodes: int, method: str) -> Any:
            def run(round_index: int) -> dict[str, dict[str, float]]:
                run_dir = root / f"{method}-{nodes}-{round_index}"
                train(run_dir, nodes, method, args.steps)
                fits = predicted_vs_measured(planned, run_dir)
                rates = predicted_vs_measured(rated, run_dir)
                old = predicted_vs_measured(before, run_dir)
                for phase, row in fits.items():
                    row["rates_predicted_s"] = rates[phase]["predicted_s"]
                    row["before_predicted_s"] = old[phase]["predicted_s"]
                return fits

            return run

        variants = {f"{m}@{n}": point(n, m) for n in NODES for m in methods}
        measured = harness.interleave(variants, args.rounds)
    results: dict[str, Any] = {"profile": planned.source, "points": {}}
    results["profile_text"] = profile_lines
    met = {"fits": 0, "rates": 0, "before": 0}
    step_met = {"fits": 0, "rates": 0, "before": 0}
    total = 0
    for key, rounds in measured.items():
        print(
            f"\n{key}: phase, predicted ms, measured ms median (min-max), ratio median (min-max)"
            ", then before in-pass timing (modules alone, no K-FAC forward hook) and without"
            " the module fits: predicted ms, ratio median"
        )
        phases: dict[str, Any] = {}
        for phase in rounds[0]:
            seen = [r[phase]["measured_s"] for r in rounds]
            predicted = {
                "fits": rounds[0][phase]["predicted_s"],
                "rates": rounds[0][phase]["rates_predicted_s"],
                "before": rounds[0][phase]["before_predicted_s"],
            }
            if max(*predicted.values(), *seen) < 1e-6:
                continue  # a phase this method has not
            total += 1
            entry: dict[str, Any] = {"measured_s": seen}
            marks = {}
            for name, value in predicted.items():
                ratios = [value / m if m > 0 else float("inf") for m in seen]
                summary = harness.Stats.of(ratios)
                within = abs(summary.median - 1) <= TOLERANCE
                met[name] += within
                step_met[name] += within and phase == "step"
                entry[name] = {"predicted_s": value, "ratio": summary.as_dict()}
                marks[name] = f"{summary:.2f}{'' if within else ' MISS'}"
            phases[phase] = entry
            ms = harness.Stats.of(seen).scaled(1e3)
            print(
                f"  {phase:<16} {predicted['fits'] * 1e3:9.2f} {ms:.2f}  {marks['fits']:<24}"
                f"| {predicted['before'] * 1e3:9.2f}  {marks['before']:<24}"
                f"| {predicted['rates'] * 1e3:9.2f}  {marks['rates']}"
            )
        results["points"][key] = phases
    bench.target(
        "plan with a calibrated profile within 20 % of real runs, per phase (points)",
        met["fits"],
        total,
        ">=",
        note=f"small CNN, 2 and 4 Slurm nodes, {', '.join(methods)}; module fits",
    )
    bench.target("... of which the step (runs)", step_met["fits"], len(measured), ">=")
    bench.target(
        "the same before in-pass timing (modules alone, no K-FAC forward hook), points",
        met["before"],
        total,
        ">=",
    )
    bench.target("... of which the step (runs)", step_met["before"], len(measured), ">=")
    bench.target(
        "the same without the module fits (layer curves by FLOPs), points",
        met["rates"],
        total,
        ">=",
    )
    bench.target("... of which the step (runs)", step_met["rates"], len(measured), ">=")
    return bench.finish(results, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
