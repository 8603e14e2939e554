"""Cost of the job's own instrumentation (phase timers + metrics records) per training step.

The real loop (`Job.loop`) runs blocks of steps with instrumentation on (PhaseTimer +
WindowRecorder writing metrics.jsonl every `log_every` steps) and off (NullTimer +
NullRecorder), interleaved in the same process, alternating which goes first. The overhead is
the median over repetitions of (on / off - 1). Target: <= 2% of step time.

Two cases: the small CNN without K-FAC (the shortest step, the worst case) and with K-FAC.
Synthetic CIFAR-shaped data with many samples, so no epoch boundary (evaluation) falls inside
a block. Run: .venv/bin/python benchmarks/bench_instrumentation.py [--reps 12 --steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from kfac_hpc.runtime import init_distributed, shutdown  # noqa: E402
from kfac_hpc.train.config import TrainConfig  # noqa: E402
from kfac_hpc.train.data import load_data  # noqa: E402
from kfac_hpc.train.loop import Job, Position, Progress  # noqa: E402
from kfac_hpc.train.records import NullRecorder, WindowRecorder  # noqa: E402
from kfac_hpc.train.rundir import RunDir  # noqa: E402
from kfac_hpc.train.timing import NullTimer, PhaseTimer  # noqa: E402

TARGET = 0.02
RESULTS = Path(__file__).resolve().parent / "results" / "bench_instrumentation.json"


def _block(job: Job, pos: Position, instrumented: bool, steps: int, run_dir: RunDir) -> float:
    """Seconds per step of ``steps`` steps of the real loop."""
    job.timer = PhaseTimer() if instrumented else NullTimer()
    cls = WindowRecorder if instrumented else NullRecorder
    recorder = cls(run_dir, 0, 1, torch.device("cpu"), job.sizes.global_batch_size, 0)
    job.total_steps = pos.step + steps
    start = time.perf_counter()
    job.loop(pos, recorder, Progress(job, enabled=False))
    recorder.close(job.timer, pos.step, 0, 0.0)  # the window still open at the end
    return (time.perf_counter() - start) / steps


def measure(kfac: bool, reps: int, steps: int, ctx: object, root: Path) -> dict[str, object]:
    config = TrainConfig(
        dataset="synthetic_cifar",
        num_samples=200_000,
        model="small_cnn",
        batch_size=32,
        kfac=kfac,
        log_every=20,
        progress=False,
    )
    run_dir = RunDir(root / ("kfac" if kfac else "sgd"))
    run_dir.create()
    job = Job(config, ctx, run_dir, load_data(config))  # type: ignore[arg-type]
    pos = Position(0, 0)
    _block(job, pos, True, steps, run_dir)  # warm-up
    on, off, ratios = [], [], []
    for rep in range(reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        seconds = {mode: _block(job, pos, mode, steps, run_dir) for mode in order}
        on.append(seconds[True])
        off.append(seconds[False])
        ratios.append(seconds[True] / seconds[False] - 1.0)
    return {
        "kfac": kfac,
        "step_s_on": statistics.median(on),
        "step_s_off": statistics.median(off),
        "overhead": statistics.median(ratios),
        "overhead_min_max": [min(ratios), max(ratios)],
        "reps": reps,
        "steps_per_rep": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed("gloo")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kfac in (False, True):
            r = measure(kfac, args.reps, args.steps, ctx, Path(tmp))
            results.append(r)
            print(
                f"{'K-FAC' if kfac else 'SGD  '} small_cnn b32: step {r['step_s_off'] * 1e3:.2f} ms "
                f"(off) vs {r['step_s_on'] * 1e3:.2f} ms (on): overhead "
                f"{100 * r['overhead']:+.2f}% (median of {r['reps']}; range "
                f"{100 * r['overhead_min_max'][0]:+.1f}%..{100 * r['overhead_min_max'][1]:+.1f}%)"
            )
    shutdown()
    ok = all(r["overhead"] <= TARGET for r in results)
    print(f"target <= {100 * TARGET:.0f}% of step time: {'met' if ok else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"target": TARGET, "met": ok, "cases": results}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
