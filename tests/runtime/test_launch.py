"""Rank discovery: one row per launcher's variables, and the error cases."""

from __future__ import annotations

import re

import pytest

from kfac_hpc.runtime.launch import LaunchError, LaunchInfo, MpiWorld, discover_launch


def no_mpi() -> MpiWorld | None:
    return None


CASES = [
    pytest.param({}, LaunchInfo(0, 1, 0, 1, "single"), id="nothing-set"),
    pytest.param(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        LaunchInfo(3, 8, 1, 2, "env"),
        id="torchrun",
    ),
    pytest.param(
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "SLURM_PROCID": "1",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "4",
        },
        LaunchInfo(0, 2, 0, 2, "env"),
        id="env-beats-slurm",
    ),
    pytest.param(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_STEP_ID": "0",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
        },
        LaunchInfo(5, 8, 1, 2, "slurm"),
        id="srun-step",
    ),
    pytest.param(
        {
            "SLURM_PROCID": "4",
            "SLURM_STEP_NUM_TASKS": "5",
            "SLURM_STEP_ID": "3",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        },
        LaunchInfo(4, 5, 0, 1, "slurm"),
        id="srun-uneven-tasks-per-node",
    ),
    pytest.param(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"},
        LaunchInfo(0, 1, 0, 1, "single"),
        id="sbatch-script-one-task",
    ),
    pytest.param(
        {
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        },
        LaunchInfo(2, 4, 0, 2, "openmpi"),
        id="openmpi",
    ),
    pytest.param(
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        LaunchInfo(1, 2, 1, 2, "pmi"),
        id="mpich-hydra",
    ),
    pytest.param(
        {
            "SLURM_PROCID": "1",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_STEP_ID": "0",
            "SLURM_NTASKS": "8",
            "PMI_RANK": "5",
            "PMI_SIZE": "8",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "4",
        },
        LaunchInfo(5, 8, 1, 4, "pmi"),
        id="mpiexec-inside-allocation",
    ),
    pytest.param(
        {
            "SLURM_PROCID": "3",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_ID": "0",
            "PMI_RANK": "3",
            "PMI_SIZE": "4",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_NODEID": "1",
        },
        LaunchInfo(3, 4, 1, 2, "slurm"),
        id="srun-mpi-pmi2-agrees",
    ),
]


@pytest.mark.parametrize(("env", "expected"), CASES)
def test_discovery_per_launcher(env: dict[str, str], expected: LaunchInfo) -> None:
    assert discover_launch(env, mpi_probe=no_mpi) == expected


def test_mpi4py_is_the_last_resort() -> None:
    info = discover_launch({}, mpi_probe=lambda: MpiWorld(2, 3, 0, 1))
    assert info == LaunchInfo(2, 3, 0, 1, "mpi4py")


def test_mpi4py_not_asked_when_environment_names_the_launch() -> None:
    def must_not_run() -> MpiWorld | None:
        raise AssertionError("mpi4py probed although PMI variables were set")

    assert discover_launch({"PMI_RANK": "0", "PMI_SIZE": "2"}, mpi_probe=must_not_run).rank == 0


ERRORS = [
    pytest.param({"RANK": "0"}, "WORLD_SIZE", id="rank-without-world-size"),
    pytest.param({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'", id="not-an-integer"),
    pytest.param({"RANK": "4", "WORLD_SIZE": "4"}, "outside [0, 4)", id="rank-out-of-range"),
    pytest.param({"PMI_RANK": "0", "PMI_SIZE": "0"}, "must be >= 1", id="empty-world"),
    pytest.param(
        {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "9"},
        "SLURM_NTASKS=4",
        id="singleton-trap-plain-command-in-batch-script",
    ),
    pytest.param(
        {"SLURM_NTASKS": "4", "PMI_RANK": "0", "PMI_SIZE": "1"},
        "singleton",
        id="singleton-trap-foreign-mpiexec",
    ),
]


@pytest.mark.parametrize(("env", "message"), ERRORS)
def test_inconsistent_launches_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(message)):
        discover_launch(env, mpi_probe=no_mpi)


def test_singleton_trap_seen_through_mpi4py() -> None:
    with pytest.raises(LaunchError, match="SLURM_NTASKS=2"):
        discover_launch({"SLURM_NTASKS": "2"}, mpi_probe=lambda: MpiWorld(0, 1, 0, 1))
