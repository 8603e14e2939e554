"""The job's own cost per step outside the model's compute: measured on this machine.

A real ``kfac-hpc train`` of the smallest model (``mlp``, SGD, one rank, one thread) on the
planned dataset's input shape: its ``data`` phase (loading the batch) and the time of each step
that no phase counts (the learning-rate schedule, the loss accumulation, the timer's own laps).
Neither depends on the network, so the smallest model measures them for every model.

The plan needs the input's shape, not the data: a dataset read from files (cifar10,
imagefolder) is measured on the synthetic dataset of its shape (augmentation included), so no
data files are needed; one that is shipped or generated here (digits, mnist1d) is used as is.
The data phase is measured per sample at a batch of at most ``MAX_BATCH`` samples.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_BATCH",
    "JobOverhead",
    "measure_job_overhead",
    "one_process_env",
    "overhead_dataset",
]

_STEPS, _LOG_EVERY = 60, 10
MAX_BATCH = 256  # the data phase is measured per sample: a larger batch only takes longer
# datasets read from files -> the synthetic dataset of the same input shape and classes
_SYNTHETIC = {"cifar10": "synthetic_cifar", "imagefolder": "synthetic_imagenet"}
_TIMEOUT_S = 600


@dataclass(frozen=True)
class JobOverhead:
    """``data_s_per_sample``: the data phase per sample of the local batch (s);
    ``step_s``: seconds per step outside every phase, at one rank."""

    data_s_per_sample: float = 0.0
    step_s: float = 0.0


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
    """Median over logging windows (the first dropped) of a real 1-rank run's data phase and
    its time outside the phases (on :func:`overhead_dataset`, at ``min(batch, MAX_BATCH)``).
    RuntimeError (one line) when the run fails."""
    measured, batch = overhead_dataset(dataset), max(1, min(batch, MAX_BATCH))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "overhead"
        argv = [sys.executable, "-m", "kfac_hpc", "train", "--run-dir", str(run_dir)]
        argv += ["--model", "mlp", "--dataset", measured, "--batch-size", str(batch)]
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
    windows = [w for w in map(json.loads, lines) if w.get("kind") == "train"][1:]
    data = statistics.median(w["phases_s"]["data"] for w in windows)
    other = statistics.median(w["step_s"] - sum(w["phases_s"].values()) for w in windows)
    return JobOverhead(data / batch, max(0.0, other))
