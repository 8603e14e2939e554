"""The installed command: any directory, --version, doctor on healthy and broken set-ups."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kfac_hpc import __version__
from tests.conftest import VENV_BIN, clean_env

KFAC_HPC = str(VENV_BIN / "kfac-hpc")


def test_version_from_another_directory(tmp_path: Path) -> None:
    result = subprocess.run(
        [KFAC_HPC, "--version"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"kfac-hpc, version {__version__}"


def test_doctor_healthy(tmp_path: Path) -> None:
    result = subprocess.run(
        [KFAC_HPC, "doctor"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for piece in ("torch", "gloo", "mpi", "launch", "h5py", "parsl"):
        assert f"[ok  ] {piece}" in result.stdout
    assert "MPICH" in result.stdout
    assert re.search(r"malloc +glibc: kfac-hpc train keeps freed memory", result.stdout)


def test_doctor_says_the_job_leaves_a_users_allocator_settings(tmp_path: Path) -> None:
    env = clean_env({"MALLOC_TRIM_THRESHOLD_": "131072"})
    result = subprocess.run(
        [KFAC_HPC, "doctor"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"malloc +set by MALLOC_\*", result.stdout) and "leaves it" in result.stdout


def test_doctor_names_a_missing_mpi_library(tmp_path: Path) -> None:
    env = clean_env({"MPI4PY_LIBMPI": str(tmp_path / "no-such-libmpi.so")})
    result = subprocess.run(
        [KFAC_HPC, "doctor"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "[FAIL] mpi" in result.stdout
    assert "mpich" in result.stdout  # the fix is named
    assert result.stderr.strip() == "broken: mpi"


def test_doctor_names_an_inconsistent_launch(tmp_path: Path) -> None:
    env = clean_env({"RANK": "5", "WORLD_SIZE": "2"})
    result = subprocess.run(
        [KFAC_HPC, "doctor"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "[FAIL] launch" in result.stdout and "outside [0, 2)" in result.stdout
