"""Cost of the job's own instrumentation (phase timers + metrics records) per training step.

Two measurements, side by side in one run:

- A/B: the real loop (`Job.loop`) runs blocks of steps with instrumentation on (PhaseTimer +
  WindowRecorder writing metrics.jsonl every `log_every` steps) and off (NullTimer +
  NullRecorder), in interleaved rounds, alternating which goes first. Reported: the median, min
  and max of the per-round ratios (on / off - 1) and the ratio of the fastest blocks. On a
  shared machine other processes make single blocks much slower, so the A/B figure is only as
  good as the machine is quiet.
- direct: the instrumentation calls of one step (phase laps, K-FAC timings, loss accumulation)
  and one window close (gather + JSON line) timed on their own, best of several repetitions,
  divided by the fastest step time without instrumentation. This is the cost itself, without
  the noise of the step around it; the 2% target is checked on it.

Two cases: the small CNN without K-FAC (the shortest step, the worst case) and with K-FAC, on
synthetic CIFAR-shaped data with many samples, so no epoch boundary (evaluation) falls inside
a block. Run: .venv/bin/python benchmarks/bench_instrumentation.py [--rounds 10 --steps 40]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import harness  # benchmarks/harness.py, beside this script
import torch  # after OMP_NUM_THREADS: torch reads it at import

from kfac_hpc.contracts import RunDir
from kfac_hpc.runtime import DistributedContext, init_distributed, shutdown
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.job import Job, Position
from kfac_hpc.train.preemption import PreemptionHandler
from kfac_hpc.train.progress import Progress
from kfac_hpc.train.records import NullRecorder, WindowRecorder
from kfac_hpc.train.timing import NullTimer, PhaseTimer
from kfac_hpc.train.workloads import load_data

TARGET = 0.02


def _block(job: Job, pos: Position, instrumented: bool, steps: int, run_dir: RunDir) -> float:
    """Seconds per step of ``steps`` steps of the real loop."""
    job.timer = PhaseTimer() if instrumented else NullTimer()
    cls = WindowRecorder if instrumented else NullRecorder
    recorder = cls(run_dir, 0, 1, torch.device("cpu"), job.sizes.global_batch_size, 0)
    job.total_steps = pos.step + steps
    start = time.perf_counter()
    job.loop(pos, recorder, Progress(job, enabled=False), PreemptionHandler())
    recorder.close(job.timer, pos.step, 0, 0.0)  # the window still open at the end
    return (time.perf_counter() - start) / steps


def direct_cost_s(run_dir: RunDir, log_every: int, calls: int = 2000) -> float:
    """Seconds per step of the instrumentation calls alone (best of 5)."""
    timings = dict.fromkeys(("factor_compute", "factor_comm", "inverse_compute"), 1e-4)
    loss = torch.tensor(0.5)
    best = float("inf")
    for _ in range(5):
        timer = PhaseTimer()
        recorder = WindowRecorder(run_dir, 0, 1, torch.device("cpu"), 32, 0)
        start = time.perf_counter()
        for i in range(calls):
            timer.begin_step()
            for phase in ("data", "forward", "backward", "grad_allreduce"):
                timer.lap(phase)
            timer.add(timings)
            timer.skip()
            timer.lap("optimizer")
            recorder.add_loss(loss)
            timer.end_step()
            if (i + 1) % log_every == 0:
                recorder.close(timer, i + 1, 0, 0.0)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(
    kfac: bool, reps: int, steps: int, batch: int, ctx: DistributedContext, root: Path
) -> dict[str, Any]:
    config = TrainConfig(
        dataset="synthetic_cifar",
        num_samples=200_000,
        model="small_cnn",
        batch_size=batch,
        kfac=kfac,
        log_every=20,
        progress=False,
    )
    run_dir = RunDir(root / ("kfac" if kfac else "sgd"))
    run_dir.create()
    job = Job(config, ctx, run_dir, load_data(config))
    pos = Position(0, 0)
    _block(job, pos, True, steps, run_dir)  # warm-up
    seconds = harness.interleave(
        {
            mode: lambda _r, m=mode: _block(job, pos, m == "on", steps, run_dir)
            for mode in ("on", "off")
        },
        reps,
    )
    on, off = seconds["on"], seconds["off"]
    ratios = [r - 1.0 for r in harness.ratios(on, off)]
    cost_s = direct_cost_s(run_dir, config.log_every)
    return {
        "kfac": kfac,
        "batch_size": batch,
        "step_s_on": harness.stats(on),
        "step_s_off": harness.stats(off),
        "ab_overhead": harness.stats(ratios),
        "ab_overhead_of_fastest": min(on) / min(off) - 1.0,
        "instrumentation_s_per_step": cost_s,
        "overhead": cost_s / min(off),
        "reps": reps,
        "steps_per_rep": steps,
    }


def main() -> int:
    parser = harness.parser(__doc__, rounds=10, rounds_aliases=("--reps",))
    parser.add_argument("--steps", type=harness.positive_int, default=40)
    args = parser.parse_args()
    bench = harness.Benchmark("bench_instrumentation")
    torch.set_num_threads(1)
    ctx = init_distributed("gloo")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        # K-FAC steps are ~10x longer: fewer, smaller ones keep the run short
        for kfac, batch, steps in ((False, 32, args.steps), (True, 8, max(5, args.steps // 4))):
            r = measure(kfac, args.rounds, steps, batch, ctx, Path(tmp))
            results.append(r)
            ab = harness.Stats(**r["ab_overhead"]).scaled(100)
            print(
                f"{'K-FAC' if kfac else 'SGD  '} small_cnn b{batch}: step "
                f"{r['step_s_off']['min'] * 1e3:.2f} ms; instrumentation "
                f"{r['instrumentation_s_per_step'] * 1e6:.1f} us/step = "
                f"{100 * r['overhead']:.3f}% (direct); A/B on vs off, per round: {ab:+.2f} %, "
                f"fastest blocks {100 * r['ab_overhead_of_fastest']:+.2f} %"
            )
            name = f"{'SGD+K-FAC' if kfac else 'SGD'} small CNN: instrumentation / step"
            bench.target(name, r["overhead"], TARGET, "<=", "%", "direct, fastest step")
    shutdown()
    return bench.finish({"cases": results}, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
