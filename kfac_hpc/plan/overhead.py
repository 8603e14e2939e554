"""The job's own cost per step outside the model's compute: measured on this machine.

A real ``kfac-hpc train`` of the smallest model (``mlp``, SGD, one rank, one thread) on the
planned dataset at the planned batch: its ``data`` phase (loading the batch) and the time
of each step that no phase counts (the learning-rate schedule, the loss accumulation, the
timer's own laps). Neither depends on the network, so the smallest model measures them for
every model.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kfac_hpc.plan.errors import PlanInputError

__all__ = ["JobOverhead", "measure_job_overhead"]

_STEPS, _LOG_EVERY = 60, 10


@dataclass(frozen=True)
class JobOverhead:
    """``data_s_per_sample``: the data phase per sample of the local batch (s);
    ``step_s``: seconds per step outside every phase, at one rank."""

    data_s_per_sample: float = 0.0
    step_s: float = 0.0


def measure_job_overhead(dataset: str, batch: int) -> JobOverhead:
    """Median over logging windows (the first dropped) of a real 1-rank run's data phase and
    its time outside the phases."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "overhead"
        argv = [sys.executable, "-m", "kfac_hpc", "train", "--run-dir", str(run_dir)]
        argv += ["--model", "mlp", "--dataset", dataset, "--batch-size", str(batch)]
        argv += ["--steps", str(_STEPS), "--log-every", str(_LOG_EVERY), "--no-kfac"]
        argv += ["--no-progress", "--checkpoint-every", str(10 * _STEPS)]
        if dataset != "digits":
            argv += ["--num-samples", str(max(batch * 4, 256))]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["?"])[-1]
            raise PlanInputError(
                "dataset",
                f"measuring the job's overhead with a 1-rank {dataset} run failed ({tail}); "
                "use a dataset present here or --profile",
            )
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    windows = [w for w in map(json.loads, lines) if w.get("kind") == "train"][1:]
    data = statistics.median(w["phases_s"]["data"] for w in windows)
    other = statistics.median(w["step_s"] - sum(w["phases_s"].values()) for w in windows)
    return JobOverhead(data / batch, max(0.0, other))
