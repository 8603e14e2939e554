"""Starting real processes from a test: ranks under the venv's ``mpiexec``, a clean launch
environment, and a time bound that ends the whole process tree instead of leaving it behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.helpers.waiting import bound_s

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
RANK_SCRIPTS = Path(__file__).resolve().parent / "rank_scripts"

# Variables that tell a process how it was launched; a test that starts its own ranks must not
# let the ones of the shell that runs pytest leak into them.
_LAUNCH_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_")
_LAUNCH_NAMES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
}


def clean_env(extra: dict[str, str] | None = None, keep_slurm_conf: bool = True) -> dict[str, str]:
    """The current environment without launcher variables, with the venv first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES
    }
    if keep_slurm_conf and "SLURM_CONF" in os.environ:
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def script_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """:func:`clean_env` for a test's own script, which imports ``tests.helpers``."""
    env = clean_env(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


class ProcessTimeout(AssertionError):
    """A started process tree outlived its bound; it was killed, its output is kept."""


def run_bounded(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` in a session of its own: past ``bound_s(timeout)`` every process of
    it (a launcher's ranks too) is killed and the test fails with the output so far."""
    limit = bound_s(timeout)
    with subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise ProcessTimeout(
                f"{' '.join(cmd)} still running after {limit:g} s (killed with its children)\n"
                f"stdout: {stdout[-3000:]}\nstderr: {stderr[-3000:]}"
            ) from None
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


def run_mpi(
    nranks: int,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Start ``nranks`` real processes with the venv's ``mpiexec`` and wait for them (hydra
    ends every rank as soon as one exits non-zero). The ranks can import ``tests.helpers``."""
    mpiexec = VENV_BIN / "mpiexec"
    assert mpiexec.exists(), f"{mpiexec} missing: install the 'mpich' extra (make venv)"
    return run_bounded(
        [str(mpiexec), "-n", str(nranks), *argv], timeout=timeout, env=script_env(env), cwd=cwd
    )


def parse_rank_records(stdout: str, marker: str = '{"rank"') -> list[dict[str, Any]]:
    """The JSON objects that ranks printed, wherever the launcher put them in the merged
    output (ranks write each object with one ``os.write``, but lines of different ranks may
    still be glued together)."""
    decoder = json.JSONDecoder()
    records: list[dict[str, Any]] = []
    start = stdout.find(marker)
    while start != -1:
        record, end = decoder.raw_decode(stdout, start)
        records.append(record)
        start = stdout.find(marker, end)
    return records
