"""Helpers of the job's tests: start `kfac-hpc train` as real processes or in this one, read its
run dir."""

from __future__ import annotations

import gc
import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tests.conftest import VENV_BIN, clean_env, run_mpi

KFAC_HPC = str(VENV_BIN / "kfac-hpc")
# Small and quick: digits, the small CNN, K-FAC on; 22 steps per epoch at a global batch of 64.
QUICK = ["--dataset", "digits", "--model", "small_cnn", "--batch-size", "64", "--log-every", "5"]
# QUICK's settings with the MLP on Adam (K-FAC on): the runs whose checkpoints tests damage.
MLP_ADAM = ("--model", "mlp", "--no-progress", "--optimizer", "adam")


def train_cmd(run_dir: Path, *args: str) -> list[str]:
    return [KFAC_HPC, "train", "--run-dir", str(run_dir), *QUICK, *args]


def run_plain(run_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        train_cmd(run_dir, *args),
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_here(
    run_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    settings: Sequence[str] = QUICK,
) -> Result:
    """`kfac-hpc train` with ``settings`` (QUICK's) in this process (click's runner, stderr
    apart): for what the job decides (bad input, the checkpoint a resume takes), without the
    seconds a new process spends importing torch. One thread, as :func:`clean_env` gives a
    process; torch's count is put back afterwards. The test session's objects are kept out of
    the garbage collector meanwhile (the job's two full collections at its end would scan
    them all)."""
    import torch

    from kfac_hpc.cli import main

    threads = torch.get_num_threads()
    argv = ["train", "--run-dir", str(run_dir), *settings, *args]
    gc.freeze()
    try:
        return CliRunner().invoke(main, argv, env={"OMP_NUM_THREADS": "1", **(env or {})})
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


def explain_here(result: Result) -> str:
    """:func:`explain` for a :func:`train_here` result."""
    return _explained(result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="session")
def mlp_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 8-step run of the MLP (K-FAC on Adam) with checkpoints at steps 3, 6 and 8,
    shared by the files that damage a copy of it."""
    run = tmp_path_factory.mktemp("mlp-checkpoints") / "run"
    args = ("--steps", "8", "--checkpoint-every", "3", "--keep-checkpoints", "3")
    result = train_here(run, *MLP_ADAM, *args)
    assert result.exit_code == 0, explain_here(result)
    return run


def run_ranks(n: int, run_dir: Path, *args: str, env: dict[str, str] | None = None):
    return run_mpi(n, train_cmd(run_dir, *args), env=env, timeout=240)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def explain(proc: subprocess.CompletedProcess[str]) -> str:
    return _explained(proc.returncode, proc.stdout, proc.stderr)


def _explained(code: int, stdout: str, stderr: str) -> str:
    """An exit code and the ends of both streams, for an assertion's message."""
    return f"exit {code}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"


def start_until_checkpoint(
    run_dir: Path,
    *args: str,
    launcher: tuple[str, ...] = (),
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """A training run started in the background (behind ``launcher``, e.g. mpiexec -n 2),
    returned once it has a checkpoint (within ``timeout_s``)."""
    proc = subprocess.Popen(
        [*launcher, *train_cmd(run_dir, *args)],
        env=clean_env(env),
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
