"""The job's own cost per step outside the model's compute: measured on this machine.

A real ``kfac-hpc train`` of the smallest model (``mlp``, SGD, one rank, one thread) on the
planned dataset's input shape: its ``data`` phase (loading the batch) and the time of each step
that no phase counts (the learning-rate schedule, the loss accumulation, the timer's own laps).
Neither depends on the network, so the smallest model measures them for every model. Its
``optimizer`` phase is the job's update in the job's own steps (caches holding the step's
activations, not the optimizer's state): :func:`job_optimizer_tensor_s` prices a parameter tensor
from it. Each is the per-step mean over the run's windows after the first, weighted by their
steps, as the job reports its phases (its slow steps and epoch starts counted), not a median.

The plan needs the input's shape, not the data: a dataset read from files (cifar10,
imagefolder) is measured on the synthetic dataset of its shape (augmentation included), so no
data files are needed; one that is shipped or generated here (digits, mnist1d) is used as is.
The data phase is measured per sample at a batch of at most ``MAX_BATCH`` samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_hpc.plan.layers import model_shape

__all__ = [
    "MAX_BATCH",
    "JobOverhead",
    "job_optimizer_tensor_s",
    "measure_job_overhead",
    "one_process_env",
    "overhead_dataset",
    "window_means",
]

_MODEL, _STEPS, _LOG_EVERY = "mlp", 60, 10
MAX_BATCH = 256  # the data phase is measured per sample: a larger batch only takes longer
# datasets read from files -> the synthetic dataset of the same input shape and classes
_SYNTHETIC = {"cifar10": "synthetic_cifar", "imagefolder": "synthetic_imagenet"}
_TIMEOUT_S = 600


@dataclass(frozen=True)
class JobOverhead:
    """``data_s_per_sample``: the data phase per sample of the local batch (s);
    ``step_s``: seconds per step outside every phase, at one rank; ``optimizer_s``: the
    run's optimizer phase per step (0: not measured)."""

    data_s_per_sample: float = 0.0
    step_s: float = 0.0
    optimizer_s: float = 0.0


def overhead_dataset(dataset: str) -> str:
    """The dataset that measures ``dataset``'s overhead: itself, or the synthetic one of its
    shape when it is read from files."""
    return _SYNTHETIC.get(dataset, dataset)


# what a launcher tells its ranks (kfac_hpc.runtime.launch reads them): a 1-rank run started
# from inside a launch (``plan calibrate`` under srun or mpiexec) must not inherit them
_LAUNCH_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "HYDRA_", "MPI_LOCALRANKID")
_LAUNCH_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"}
_LAUNCH_NAMES |= {"MASTER_PORT", "KFAC_HPC_EMULATED_NODES"}


def one_process_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without a launcher's variables."""
    launch = (k for k in env if k in _LAUNCH_NAMES or k.startswith(_LAUNCH_PREFIXES))
    dropped = set(launch)
    return {k: v for k, v in env.items() if k not in dropped}


def measure_job_overhead(dataset: str, batch: int) -> JobOverhead:
    """A real 1-rank run's data phase, its time outside the phases and its optimizer phase
    (on :func:`overhead_dataset`, at ``min(batch, MAX_BATCH)``): :func:`window_means`.
    RuntimeError (one line) when the run fails."""
    measured, batch = overhead_dataset(dataset), max(1, min(batch, MAX_BATCH))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "overhead"
        argv = [sys.executable, "-m", "kfac_hpc", "train", "--run-dir", str(run_dir)]
        argv += ["--model", _MODEL, "--dataset", measured, "--batch-size", str(batch)]
        argv += ["--steps", str(_STEPS), "--log-every", str(_LOG_EVERY), "--no-kfac"]
        argv += ["--no-progress", "--checkpoint-every", str(10 * _STEPS)]
        if measured != "digits":
            argv += ["--num-samples", str(max(batch * 4, 256))]
        env = {**one_process_env(os.environ), "OMP_NUM_THREADS": "1"}
        try:
            out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"measuring the job's overhead with a 1-rank {measured} run took over "
                f"{_TIMEOUT_S} s; use --hardware"
            ) from None
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["?"])[-1]
            raise RuntimeError(
                f"measuring the job's overhead with a 1-rank {measured} run failed ({tail}); "
                "use --hardware"
            )
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return window_means([json.loads(line) for line in lines], batch)


def window_means(records: list[dict[str, Any]], batch: int) -> JobOverhead:
    """The job's overhead from its metrics records: per-step means over the train windows
    after the first (its warm-up), weighted by their steps, of the data phase (over
    ``batch``), the time outside every phase (>= 0) and the optimizer phase."""
    windows = [w for w in records if w.get("kind") == "train"][1:]
    steps = sum(w["window_steps"] for w in windows)

    def mean(value: Callable[[dict[str, Any]], float]) -> float:
        return sum(w["window_steps"] * value(w) for w in windows) / steps

    data = mean(lambda w: w["phases_s"]["data"])
    other = mean(lambda w: w["step_s"] - sum(w["phases_s"].values()))
    optimizer = mean(lambda w: w["phases_s"]["optimizer"])
    return JobOverhead(data / batch, max(0.0, other), optimizer)


def job_optimizer_tensor_s(job: JobOverhead, dataset: str, bytes_per_s: float) -> float:
    """The job's optimizer cost per parameter tensor beyond its traffic, from the 1-rank
    run's optimizer phase: (that phase − the update's 5 × 4 bytes a parameter at
    ``bytes_per_s``) / the run's model's parameter tensors (>= 0)."""
    shape = model_shape(_MODEL, overhead_dataset(dataset))
    traffic = 5 * 4 * shape.params / bytes_per_s
    return max(0.0, (job.optimizer_s - traffic) / shape.param_tensors)
