"""DHO2 with pipelined curvature: training ranks that wait for each ESE against ones that never
wait (``max_staleness`` 0 against a bound), side by side at P = 4 (gloo, CPU).

One command: ``.venv/bin/python benchmarks/bench_fosi_pipeline.py [--rounds 3]``
starts itself as 4 real ranks (``mpiexec``): ranks 0-2 train, rank 3 computes ESEs
(``curvature_ranks=1``). The workload is the autoencoder task of bench_tts_fosi_tasks.py
(``kfac_hpc.train.fosi_tasks``: the 8x8 digits through 64-128-32-8-32-128-64, tanh, 25,480
parameters, MSE), FOSI around SGD (lr 0.05, momentum 0.9; k = 10, 40 Lanczos steps,
double-backward HVPs), the first ESE at step 10 and one every 20 steps after, a global training
batch of 126 (42 per training rank) and a curvature batch of 128 on the curvature rank, the same
batches for every variant. It is FOSI's own loop; ``--job`` measures the job instead (below).

Variants, interleaved per round (the order rotating): ``wait`` (``max_staleness=0``: the
training ranks wait for every ESE at its step, the synchronous algorithm) and ``no-wait``
(``max_staleness=19``, the largest bound below ``ese_every``: they never wait, and take the
base update alone while an ESE is later than that), and ``sgd`` (no ESE within the steps: the
base optimizer alone, the reference for time and loss). Per round and variant: the training ranks'
seconds for the steps (slowest training rank, from a barrier before the first step to its last
step), the steps that took the base update alone (``late_steps``), the staleness of each swap,
the ESE seconds on the curvature rank and the training loss of the last 10 steps. Prints the
median (min..max) over the rounds and the ratio no-wait / wait per round; writes
benchmarks/results/bench_fosi_pipeline.json. Target: no-wait <= 0.9x the waiting time.
Note: 4 ranks on a machine with fewer cores share them (the curvature rank's ESE then slows
the training ranks too); the figures are this machine's, not a GPU cluster's.

``--job``: the same comparison through the training job, ``kfac-hpc train`` at P = 3 (2 training
ranks + 1 curvature rank, gloo), autoencoder task, the settings above (global batch 126, 100
steps, ESE every 20 from step 10, ``--max-staleness`` 0 against 19), ``wait`` and ``no-wait``
interleaved per round. Per run: the training time (run.json: the sum of training rank 0's step
seconds, the steps only), the loop's seconds from the end of step 10 to the end of the final
evaluation (metrics.jsonl; evaluations, at every epoch end, about every 11 steps, are the
training ranks' alone), the attempt's wall seconds (run.json: start-up included; the end's
meeting with the curvature rank, which waits for the ESE in flight, comes after it), the late
steps, the staleness and the final test loss. Prints median (min..max) and the per-round
ratio no-wait / wait of each time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import harness  # benchmarks/harness.py, beside this script

RANKS = 4
ROUNDS = 3
STEPS = 100
ESE_EVERY = 20
# name -> (max_staleness, the first ESE's step; past the last step: the base alone, SGD)
VARIANTS = {"wait": (0, 10), "no-wait": (ESE_EVERY - 1, 10), "sgd": (0, STEPS)}
TARGET = 0.9  # no-wait time over waiting time
TRAIN_BATCH = 42  # per training rank
CURVATURE_BATCH = 128


def run_variant(rank: int, world: int, bound: int, warmup: int) -> dict[str, Any]:
    """One run of ``STEPS`` steps with ``max_staleness=bound``, the first ESE at ``warmup``."""
    import torch
    import torch.distributed as dist

    from kfac_hpc.optim.fosi import FOSI
    from kfac_hpc.train.fosi_tasks import autoencoder, digits_reconstruction

    source = digits_reconstruction(None)  # type: ignore[arg-type]  # it reads no context
    torch.manual_seed(0)
    model = autoencoder(SimpleNamespace(input_shape=source.shape, args={}))  # type: ignore[arg-type]
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = FOSI(model.parameters(), base, k=10, alpha=0.01, ese_every=ESE_EVERY, warmup=warmup,
               lanczos_iters=40, model=model, hvp="double-backward", curvature_ranks=1,
               max_staleness=bound)  # fmt: skip
    trainers = world - 1
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    dist.barrier()
    started = time.perf_counter()
    for _ in range(STEPS):
        order = torch.randperm(source.train_len, generator=gen)  # every rank draws alike
        cx, cy = source.train(order[:CURVATURE_BATCH])
        if not opt.is_curvature_rank:
            x, y = source.train(order[rank * TRAIN_BATCH : (rank + 1) * TRAIN_BATCH])
            model.zero_grad()
            loss = source.loss(model(x), y)
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step(lambda cx=cx, cy=cy: source.loss(model(cx), cy))
    seconds = time.perf_counter() - started
    opt.close()  # not timed: the curvature rank may still be in its last ESE
    return {
        "seconds": seconds,
        "curvature_rank": opt.is_curvature_rank,
        "late_steps": list(opt.late_steps),
        "staleness": list(opt.staleness),
        "ese_s": opt.last_ese_s,
        "loss_last10": statistics.fmean(losses[-10:]) if losses else None,
        "trainers": trainers,
    }


def worker(out: Path, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from kfac_hpc.runtime import init_distributed, shutdown

    ctx = init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    if ctx.world_size != RANKS:
        raise SystemExit(f"bench_fosi_pipeline: run at {RANKS} ranks, got {ctx.world_size}")
    mine: list[dict[str, Any]] = []
    for index in range(rounds):
        for name in harness.rotation(list(VARIANTS), index):
            mine.append({"round": index, "variant": name,
                         **run_variant(ctx.rank, ctx.world_size, *VARIANTS[name])})  # fmt: skip
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.rank == 0:
        harness.write_worker_result(out, {"world_size": ctx.world_size, "ranks": gathered})
    shutdown()


def summarise(job: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Per variant and round: the slowest training rank's seconds, the late steps, staleness
    and last losses of training rank 0, the curvature rank's ESE seconds."""
    ranks = job["ranks"]
    table: dict[str, dict[str, list[Any]]] = {}
    for name in VARIANTS:
        rows: dict[str, list[Any]] = {"seconds": [], "late": [], "staleness": [], "loss": [],
                                      "ese_s": []}  # fmt: skip
        for index in range(rounds):
            runs = [next(r for r in rank if r["variant"] == name and r["round"] == index)
                    for rank in ranks]  # fmt: skip
            training = [r for r in runs if not r["curvature_rank"]]
            rows["seconds"].append(max(r["seconds"] for r in training))
            rows["late"].append(len(training[0]["late_steps"]))
            rows["staleness"].append(training[0]["staleness"])
            rows["loss"].append(training[0]["loss_last10"])
            rows["ese_s"].append(next(r["ese_s"] for r in runs if r["curvature_rank"]))
        table[name] = rows
    ratio = harness.ratios(table["no-wait"]["seconds"], table["wait"]["seconds"])
    over_sgd = {name: harness.ratios(table[name]["seconds"], table["sgd"]["seconds"])
                for name in ("wait", "no-wait")}  # fmt: skip
    return {"variants": table, "ratio": ratio, "over_sgd": over_sgd}


def report(summary: dict[str, Any], rounds: int) -> None:
    print(f"DHO2 pipelined at P = {RANKS} (3 training + 1 curvature rank), autoencoder, "
          f"{STEPS} steps, ESE every {ESE_EVERY} from step 10; {rounds} interleaved rounds, "
          "median (min..max)")  # fmt: skip
    print(f"{'variant':<9}{'bound':>6}{'train s':>26}{'late steps':>12}{'ESE s':>8}"
          f"{'loss (last 10)':>16}  staleness per swap (round 1)")  # fmt: skip
    for name, rows in summary["variants"].items():
        s = harness.stats(rows["seconds"])
        print(f"{name:<9}{VARIANTS[name][0]:>6}  {s['median']:.3f} ({s['min']:.3f}..{s['max']:.3f})"
              f"{statistics.median(rows['late']):>12}{statistics.median(rows['ese_s']):>8.3f}"
              f"{statistics.median(rows['loss']):>16.4f}  {rows['staleness'][0]}")  # fmt: skip
    r = harness.stats(summary["ratio"])
    print(f"no-wait / wait, per round: {r['median']:.2f}x ({r['min']:.2f}..{r['max']:.2f})")
    for name, values in summary["over_sgd"].items():
        o = harness.stats(values)
        print(f"{name} / sgd, per round: {o['median']:.2f}x ({o['min']:.2f}..{o['max']:.2f})")


JOB_RANKS = 3
JOB_STEPS = 100
JOB_ARGS = ["--dataset", "kfac_hpc.train.fosi_tasks:digits_reconstruction"]
JOB_ARGS += ["--model", "kfac_hpc.train.fosi_tasks:autoencoder", "--batch-size", "126"]
JOB_ARGS += ["--steps", str(JOB_STEPS), "--lr", "0.05", "--momentum", "0.9"]
JOB_ARGS += ["--lr-schedule", "constant", "--weight-decay", "0", "--no-progress"]
JOB_ARGS += ["--backend", "gloo", "--log-every", "10", "--fosi", "--fosi-k", "10"]
JOB_ARGS += ["--lanczos-iters", "40", "--fosi-warmup", "10", "--ese-every", str(ESE_EVERY)]
JOB_ARGS += ["--fosi-alpha", "0.01", "--fosi-hvp", "double-backward", "--curvature-ranks", "1"]
JOB_VARIANTS = {"wait": 0, "no-wait": ESE_EVERY - 1}  # name -> --max-staleness


def run_jobs(rounds: int) -> dict[str, Any]:
    """``rounds`` interleaved rounds of the job at P = 3, waiting and not."""
    import tempfile

    keys = ("train_s", "loop_s", "wall_s", "late", "staleness", "ese_s", "test_loss")
    table: dict[str, dict[str, list[Any]]] = {
        name: {key: [] for key in keys} for name in JOB_VARIANTS
    }
    with tempfile.TemporaryDirectory(prefix="bench-fosi-job-") as tmp:
        for index in range(rounds):
            for name in harness.rotation(list(JOB_VARIANTS), index):
                flags = [*JOB_ARGS, "--max-staleness", str(JOB_VARIANTS[name])]
                job = harness.run_job(flags, JOB_RANKS, Path(tmp), timeout=900)
                if job.error is not None:
                    raise SystemExit(f"bench_fosi_pipeline --job: {name}: {job.error}")
                summary, rows = job.summary, table[name]
                steps = summary["step_s"]
                rows["train_s"].append(steps["mean"] * steps["n"])
                rows["loop_s"].append(loop_seconds(job.run_dir))
                rows["wall_s"].append(summary["wall_s"])
                rows["late"].append(summary["fosi_late_steps"])
                rows["staleness"].append(summary["ese_staleness_steps"])
                rows["ese_s"].append(statistics.fmean(summary["ese_s"] or [0.0]))
                rows["test_loss"].append(summary["final_test_loss"])
                done = f"train {rows['train_s'][-1]:.2f} s, loop {rows['loop_s'][-1]:.2f} s"
                print(f"round {index + 1} {name}: {done}, late {rows['late'][-1]}", flush=True)
    ratios = {
        key: harness.ratios(table["no-wait"][key], table["wait"][key])
        for key in ("train_s", "loop_s", "wall_s")
    }
    return {"variants": table, "ratios": ratios}


def loop_seconds(run_dir: Path) -> float:
    """Seconds from the end of step 10 (its timing window) to the end of the final evaluation."""
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r["wall_s"] for r in records if r["kind"] == "train" and r["step"] == 10)
    end = next(r["wall_s"] for r in records if r["kind"] == "eval" and r["step"] == JOB_STEPS)
    return float(end - start)


def report_jobs(summary: dict[str, Any], rounds: int) -> None:
    print(f"kfac-hpc train, DHO2 at P = {JOB_RANKS} (2 training + 1 curvature rank), "
          f"autoencoder, {JOB_STEPS} steps, ESE every {ESE_EVERY} from step 10; {rounds} "
          "interleaved rounds, median (min..max)")  # fmt: skip
    print(f"{'variant':<9}{'bound':>6}{'train s':>24}{'loop s':>24}{'wall s':>24}{'late':>6}"
          f"{'ESE s':>8}{'test loss':>11}  staleness per swap (round 1)")  # fmt: skip
    for name, rows in summary["variants"].items():
        t, o = harness.stats(rows["train_s"]), harness.stats(rows["loop_s"])
        w = harness.stats(rows["wall_s"])
        print(f"{name:<9}{JOB_VARIANTS[name]:>6}"
              f"  {t['median']:7.2f} ({t['min']:.2f}..{t['max']:.2f})"
              f"  {o['median']:7.2f} ({o['min']:.2f}..{o['max']:.2f})"
              f"  {w['median']:7.2f} ({w['min']:.2f}..{w['max']:.2f})"
              f"{statistics.median(rows['late']):>6}{statistics.median(rows['ese_s']):>8.3f}"
              f"{statistics.median(rows['test_loss']):>11.4f}  {rows['staleness'][0]}")  # fmt: skip
    for key, values in summary["ratios"].items():
        r = harness.stats(values)
        print(f"no-wait / wait {key}, per round: {r['median']:.2f}x "
              f"({r['min']:.2f}..{r['max']:.2f})")  # fmt: skip


def main() -> int:
    parser = harness.parser(__doc__, rounds=ROUNDS)
    parser.add_argument("--job", action="store_true", help="measure kfac-hpc train at P = 3")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.rounds)
        return 0
    if args.job:
        bench = harness.Benchmark("bench_fosi_pipeline_job")
        summary = run_jobs(args.rounds)
        report_jobs(summary, args.rounds)
        bench.target(
            f"kfac-hpc train, DHO2 at P = {JOB_RANKS}: no-wait / wait training time",
            statistics.median(summary["ratios"]["train_s"]),
            TARGET,
            "<=",
            "×",
            f"training rank 0's step seconds, median of {args.rounds} rounds",
        )
        return bench.finish({"summary": summary}, check=args.check)
    bench = harness.Benchmark("bench_fosi_pipeline")
    job = harness.launch(__file__, "--rounds", str(args.rounds), ranks=RANKS,
                         env={"OMP_NUM_THREADS": "1"}, timeout=1800)  # fmt: skip
    summary = summarise(job, args.rounds)
    report(summary, args.rounds)
    bench.target(
        f"DHO2 pipelined at P = {RANKS}: no-wait / wait training time",
        statistics.median(summary["ratio"]),
        TARGET,
        "<=",
        "×",
        f"slowest training rank, median of {args.rounds} rounds",
    )
    return bench.finish({"job": job, "summary": summary}, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
