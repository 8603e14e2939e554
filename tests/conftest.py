"""Shared fixtures: real MPI ranks (the venv's MPICH) and the real local Slurm cluster."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

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


def run_mpi(
    nranks: int,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Start ``nranks`` real processes with the venv's ``mpiexec`` and wait for them."""
    mpiexec = VENV_BIN / "mpiexec"
    assert mpiexec.exists(), f"{mpiexec} missing: install the 'mpich' extra (make venv)"
    cmd = [str(mpiexec), "-n", str(nranks), *argv]
    return subprocess.run(
        cmd, env=clean_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd
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


def _must_not_skip() -> bool:
    """Under `make test` and in CI every system piece is installed: absence is a failure."""
    return os.environ.get("KFAC_HPC_REQUIRE_SLURM") == "1" or bool(os.environ.get("CI"))


def require_module(name: str) -> Any:
    """Import ``name`` (a test dependency `make venv` installs); under `make test`/CI its
    absence fails the test instead of skipping it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if _must_not_skip():
            pytest.fail(f"{name} missing: `make venv` installs it ({exc})")
        pytest.skip(f"{name} not installed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under `make test`/CI a skip for a module that could not be imported (a bare
    ``pytest.importorskip``) is a failure: every test dependency is installed there."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and _must_not_skip() and call.excinfo is not None:
        reason = str(call.excinfo.value)
        if reason.startswith("could not import"):
            report.outcome = "failed"
            report.longrepr = f"must not skip under make test/CI: {reason}"


@pytest.fixture(scope="session")
def hdf5_tools() -> None:
    """Debian's hdf5-tools (h5ls, h5dump); a failure instead of a skip under `make test`/CI."""
    missing = [tool for tool in ("h5ls", "h5dump") if shutil.which(tool) is None]
    if missing:
        if _must_not_skip():
            pytest.fail(f"{', '.join(missing)} missing: install hdf5-tools (make sysdeps)")
        pytest.skip(f"{', '.join(missing)} not installed")


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's headless Chromium; a failure instead of a skip under `make test`/CI."""
    path = shutil.which("chromium")
    if path is None:
        if _must_not_skip():
            pytest.fail("chromium missing: install it (make sysdeps)")
        pytest.skip("chromium not installed")
    return path


def _slurm_reachable() -> str | None:
    """None when the local cluster answers, else why not."""
    if shutil.which("sinfo") is None:
        return "sinfo not on PATH"
    if "SLURM_CONF" not in os.environ:
        return "SLURM_CONF is not set (start the cluster: bash slurm/cluster.sh start)"
    out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The running local Slurm cluster. Under `make test` (KFAC_HPC_REQUIRE_SLURM=1) or in
    CI a missing cluster fails the test instead of skipping it."""
    problem = _slurm_reachable()
    if problem is not None:
        if _must_not_skip():
            pytest.fail(f"the local Slurm cluster is required here: {problem}")
        pytest.skip(problem)
    return {"SLURM_CONF": os.environ["SLURM_CONF"]}


def pytest_collection_finish(session: pytest.Session) -> None:
    # pytest already fails on zero tests (exit 5); a suite that silently lost whole folders
    # should fail too, so a full run must collect every area.
    if session.config.getoption("-m") or session.config.args not in ([], [str(REPO / "tests")]):
        return
    if len(session.items) < 10:
        raise pytest.UsageError(f"only {len(session.items)} tests collected; the suite is broken")
