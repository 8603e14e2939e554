"""The runtime on the real local Slurm cluster: srun steps, sbatch jobs, doctor in a job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN
from tests.helpers.launch import script_env
from tests.runtime.test_mpi_allreduce import PROBE, parse_ranks

pytestmark = pytest.mark.slurm


def test_srun_four_nodes_pmi2_allreduce(slurm_cluster: dict[str, str]) -> None:
    result = subprocess.run(
        ["srun", "-N", "4", "-n", "4", "--mpi=pmi2", "-t", "2", sys.executable, str(PROBE)],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    rows = parse_ranks(result.stdout)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        assert row["world_size"] == 4 and row["pg_world_size"] == 4
        assert row["source"] == "slurm" and row["rendezvous"] == "slurm"
        assert row["sum"] == 10.0


def test_sbatch_two_nodes_writes_its_output(slurm_cluster: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\nsrun --mpi=pmi2 {sys.executable} {PROBE}\n")
    out = tmp_path / "job-%j.out"
    result = subprocess.run(
        ["sbatch", "--wait", "-N", "2", "-n", "4", "-t", "2", "-o", str(out), str(script)],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[-1]
    rows = parse_ranks((tmp_path / f"job-{job_id}.out").read_text())
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert {r["world_size"] for r in rows} == {4}
    assert {r["sum"] for r in rows} == {10.0}
    # two nodes, two ranks on each
    assert sorted(r["local_rank"] for r in rows) == [0, 0, 1, 1]


def test_doctor_passes_inside_a_job(slurm_cluster: dict[str, str]) -> None:
    result = subprocess.run(
        ["srun", "-N", "1", "-n", "1", "-t", "2", str(VENV_BIN / "kfac-hpc"), "doctor"],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "inside job" in result.stdout
    assert "pmi2" in result.stdout
    assert "source slurm" in result.stdout


def test_singleton_trap_refused_inside_batch_script(
    slurm_cluster: dict[str, str], tmp_path: Path
) -> None:
    """A plain command in a 2-task batch script is a world of 1: refused, not silently run."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{sys.executable} {PROBE}\n")
    out = tmp_path / "trap.out"
    result = subprocess.run(
        ["sbatch", "--wait", "-N", "1", "-n", "2", "-t", "2", "-o", str(out), str(script)],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode != 0
    assert "SLURM_NTASKS=2" in out.read_text()
