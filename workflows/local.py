"""The local workflow: every point runs with local MPI ranks (Parsl's ``MPIExecutor`` on this
host), ``max_concurrent`` at a time, in the process of ``kfac-hpc sweep`` or ``resume``.

The local backend (:class:`kfac_hpc.sweep.backends.local.LocalBackend`) runs it. No scheduler
holds the points: the workflow records each point's end in the manifest as it happens (from
the run directory's markers and the exit code), so ``status`` from another shell reads the
markers and trusts the manifest for the rest.
"""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import parsl
from parsl.app.app import bash_app

from kfac_hpc.contracts.environment import EMULATED_NODES
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.rundir import read_markers
from kfac_hpc.contracts.states import PointState, Verdict, classify_point
from kfac_hpc.sweep.manifest import Manifest, PointRecord, locked_manifest, read_manifest
from kfac_hpc.sweep.train_args import train_argv
from kfac_hpc.workflows.configs import local_config

__all__ = ["exit_verdict", "finish_point", "mark_points", "point_command", "run_local_points"]


@bash_app
def _train_point(
    command: str,
    parsl_resource_specification: dict[str, int] | None = None,
    stdout: str | None = None,
    stderr: str | None = None,
) -> str:
    """One point under its MPI launcher (``command`` starts with the launcher's prefix)."""
    return command


def open_mpi() -> bool:
    """Whether the ``mpiexec`` the workers find is Open MPI's, not MPICH's hydra (the
    ``mpich`` extra). The workers' PATH starts with this Python's bin (see configs.py)."""
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    mpiexec = shutil.which("mpiexec", path=search)
    if mpiexec is None:
        return False
    try:
        version = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in version or "OpenRTE" in version


def mpi_prefix(ranks: int, is_open_mpi: bool) -> str:
    """The launcher of a point's ``ranks`` on this host: the executor's ``$PARSL_MPI_PREFIX``
    (hydra's flags), or ``mpiexec -n R --oversubscribe`` for Open MPI's mpiexec."""
    return f"mpiexec -n {ranks} --oversubscribe" if is_open_mpi else "$PARSL_MPI_PREFIX"


def point_command(
    manifest: Manifest, sweep_dir: Path, point: PointRecord, *, emulate_nodes: bool = True
) -> str:
    """The shell command that runs one point: the local backend's script (``emulate_nodes``:
    the point's nodes run as ranks on this host), or a pilot's job step on real nodes."""
    env = {
        "OMP_NUM_THREADS": str(point.params["cpus_per_task"]),
        "PYTHONUNBUFFERED": "1",
        # Emulated nodes: the job records the nodes asked for, not the one host it sees.
        **({EMULATED_NODES: str(point.params["nodes"])} if emulate_nodes else {}),
        **manifest.profile["env"],
    }
    argv = [
        *manifest.profile["train_command"],
        "--run-dir",
        str(sweep_dir / point.run_dir),
        *train_argv(point.params),
    ]
    # The prefix is `mpiexec ... `, so the environment goes through `env` (hydra passes it on).
    return shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])


def exit_verdict(code: int) -> Verdict:
    """What a point's exit status says when its markers say nothing more."""
    if code == ExitCode.PREEMPTED:
        return Verdict(PointState.PREEMPTED, "checkpointed; kfac-hpc resume continues it")
    return Verdict(PointState.FAILED, f"exit code {code}; see logs/")


def run_local_points(sweep_dir: Path, point_ids: Sequence[str] | None = None) -> None:
    """Run points (all, or ``point_ids``) with local MPI ranks, ``max_concurrent`` at a time."""
    manifest = read_manifest(sweep_dir)
    todo = [p for p in manifest.points if point_ids is None or p.point_id in point_ids]
    concurrency = 1 if manifest.spec["serial"] else int(manifest.spec["max_concurrent"] or 1)
    (sweep_dir / "logs").mkdir(exist_ok=True)
    is_open_mpi = open_mpi()
    with parsl.load(local_config(sweep_dir / "parsl", concurrency)):
        futures: dict[concurrent.futures.Future[Any], str] = {}
        for point in todo:
            ranks = int(point.params["nodes"]) * int(point.params["ranks_per_node"])
            log = str(
                sweep_dir / "logs" / f"{manifest.name}-{point.array}_local_{point.array_index}.out"
            )
            future = _train_point(
                f"{mpi_prefix(ranks, is_open_mpi)} {point_command(manifest, sweep_dir, point)}",
                parsl_resource_specification={
                    "num_nodes": 1,
                    "num_ranks": ranks,
                    "ranks_per_node": ranks,
                },
                stdout=(log, "a"),
                stderr=(log, "a"),
            )
            futures[future] = point.point_id
        mark_points(sweep_dir, [p.point_id for p in todo], PointState.RUNNING, "local")
        for future in concurrent.futures.as_completed(futures):
            finish_point(sweep_dir, futures[future], future)


def mark_points(sweep_dir: Path, point_ids: Sequence[str], state: PointState, job_id: str) -> None:
    """Record ``point_ids`` as handed to ``job_id`` in ``state``: one more attempt each."""
    with locked_manifest(sweep_dir) as manifest:
        for point in manifest.points:
            if point.point_id in point_ids:
                point.state, point.detail, point.job_id = state.value, "", job_id
                point.attempts += 1


def finish_point(
    sweep_dir: Path,
    point_id: str,
    future: concurrent.futures.Future[Any],
    lost: str | None = None,
) -> None:
    """The point's state from its markers, else from the exit code of its launcher; an
    exception without an exit code is a failure reading ``lost`` when given, else exit 1."""
    exc = future.exception()
    code = getattr(exc, "exitcode", 0 if exc is None else 1)
    with locked_manifest(sweep_dir) as manifest:
        point = next(p for p in manifest.points if p.point_id == point_id)
        ended = exit_verdict(code)
        if lost is not None and exc is not None and not hasattr(exc, "exitcode"):
            ended = Verdict(PointState.FAILED, f"{lost}: {str(exc)[:160]}")
        verdict = classify_point(
            read_markers(sweep_dir / point.run_dir), Verdict(PointState.RUNNING), ended=ended
        )
        point.state, point.detail = verdict.state.value, verdict.detail
