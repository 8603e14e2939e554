"""Open MPI for real, beside MPICH: Debian's ``mpirun.openmpi`` starts the ranks and mpi4py's
wheel loads Open MPI's ``libmpi.so.40`` (MPI4PY_LIBMPI); the runtime reads OMPI_COMM_WORLD_*."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, _must_not_skip
from tests.helpers.launch import run_bounded, script_env

pytestmark = pytest.mark.mpi

MPIRUN = "mpirun.openmpi"
KFAC_HPC = str(VENV_BIN / "kfac-hpc")


@pytest.fixture(scope="module")
def openmpi_env() -> dict[str, str]:
    """The environment of an Open MPI launch; a failure instead of a skip under make test/CI."""
    if shutil.which(MPIRUN) is None:
        why = f"{MPIRUN} missing: install openmpi-bin (make sysdeps)"
        if _must_not_skip():
            pytest.fail(why)
        pytest.skip(why)
    return {"MPI4PY_LIBMPI": "libmpi.so.40"}


def _mpirun(n: int, argv: list[str], env: dict[str, str], timeout: float = 240):
    # --oversubscribe: more ranks than this machine's cores; as root Open MPI needs the flag.
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), *argv]
    return run_bounded(cmd, env=script_env(env), timeout=timeout)


def test_doctor_reports_the_openmpi_launch_on_both_ranks(openmpi_env) -> None:
    out = _mpirun(2, [KFAC_HPC, "doctor"], openmpi_env)
    assert out.returncode == 0, out.stdout + out.stderr
    launches = re.findall(r"launch\s+rank (\d)/(\d), local \d/\d, source (\w+)", out.stdout)
    assert sorted(launches) == [("0", "2", "openmpi"), ("1", "2", "openmpi")], out.stdout
    # mpi4py loaded Open MPI's library, not the venv's MPICH
    assert out.stdout.count("Open MPI") == 2, out.stdout


def test_two_rank_training_under_openmpi_finishes_done(openmpi_env, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [KFAC_HPC, "train", "--run-dir", str(run_dir), "--dataset", "digits"]
    argv += ["--model", "small_cnn", "--batch-size", "64", "--steps", "6", "--no-progress"]
    out = _mpirun(2, argv, openmpi_env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["state"] == "done" and run["steps"] == 6
    assert run["world_size"] == 2
    assert (run_dir / "done").exists()
