"""Helpers of the job's tests: start `kfac-hpc train` as real processes, read its run dir."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.conftest import VENV_BIN, clean_env, run_mpi

KFAC_HPC = str(VENV_BIN / "kfac-hpc")
# Small and quick: digits, the small CNN, K-FAC on; 22 steps per epoch at a global batch of 64.
QUICK = ["--dataset", "digits", "--model", "small_cnn", "--batch-size", "64", "--log-every", "5"]


def train_cmd(run_dir: Path, *args: str) -> list[str]:
    return [KFAC_HPC, "train", "--run-dir", str(run_dir), *QUICK, *args]


def run_plain(run_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
    return subprocess.run(
        train_cmd(run_dir, *args),
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_ranks(n: int, run_dir: Path, *args: str, env: dict[str, str] | None = None):
    return run_mpi(n, train_cmd(run_dir, *args), env=env, timeout=240)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def start_until_checkpoint(
    run_dir: Path, *args: str, launcher: tuple[str, ...] = (), timeout_s: float = 120
) -> subprocess.Popen[str]:
    """A training run started in the background (behind ``launcher``, e.g. mpiexec -n 2),
    returned once it has a checkpoint (within ``timeout_s``)."""
    proc = subprocess.Popen(
        [*launcher, *train_cmd(run_dir, *args)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "checkpoints" / "latest").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no checkpoint within {timeout_s:g} s"
        time.sleep(0.02)
    return proc


def rank_pids(run_dir: Path) -> list[int]:
    """The training processes (not mpiexec or its proxy) whose command line names run_dir."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if str(run_dir) in text and "mpiexec" not in text and "hydra" not in text:
            pids.append(int(entry.name))
    return sorted(pids)
