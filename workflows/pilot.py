"""The Parsl pilot workflow (``--backend parsl-slurm``): one Slurm allocation runs every point.

The pilot backend (:class:`kfac_hpc.sweep.backends.pilot.ParslSlurmBackend`) runs it:
``kfac-hpc sweep`` (or ``resume``) asks Slurm for one block (Parsl's ``SlurmProvider``) of
:func:`pilot_nodes` nodes and packs the points into it by node count: Parsl's ``MPIExecutor``
gives each point the nodes it asks for and starts it with the site's launcher as one job step
(``srun --mpi=pmi2`` with the profile ``local``). A sweep of many small points thus waits in
the queue once. The run directories, the manifest, ``status``, ``resume`` and the report are
the array backend's; each point's ``job_id`` is the pilot's Slurm job id.

Preemption: the block is submitted with ``--signal=USR2@signal_seconds``, which Slurm sends
to every job step, so the running points checkpoint and exit 75 (``preempted``); ``resume``
continues them in a new allocation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ipaddress
import math
import os
import shlex
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import parsl
from parsl.app.app import bash_app

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.states import LIVE, PointState
from kfac_hpc.sweep import slurm_commands as slurm
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.manifest import Manifest, PointRecord, locked_manifest, read_manifest
from kfac_hpc.sweep.safety import slurm_time_seconds
from kfac_hpc.workflows.configs import PilotShape, pilot_config
from kfac_hpc.workflows.local import finish_point, mark_points, point_command

__all__ = [
    "pilot_address",
    "pilot_nodes",
    "pilot_shape",
    "pilot_walltime_s",
    "run_pilot_points",
    "slurm_seconds",
]

# How long the pilot's job id may take to appear after parsl.load (sbatch is synchronous; a
# failed submission is reported at once, so this bound only matters on a very busy machine).
_BLOCK_WAIT_S = 300.0


@bash_app
def _pilot_point(
    command: str,
    parsl_resource_specification: dict[str, Any] | None = None,
    stdout: str | None = None,
    stderr: str | None = None,
) -> str:
    """One point as a job step of the pilot (``$PARSL_MPI_PREFIX`` = srun on its nodes).

    Under the step, ``SLURM_JOB_NODELIST`` is the whole pilot's; the job's rendezvous takes
    the first host of it, so each rank sees the step's own node list instead."""
    inner = (
        'if [ -n "${SLURM_STEP_NODELIST:-}" ]; then '
        'export SLURM_JOB_NODELIST="$SLURM_STEP_NODELIST"; fi; exec "$@"'
    )
    return f"$PARSL_MPI_PREFIX bash -c {shlex.quote(inner)} kfac-point {command}"


def slurm_seconds(value: str) -> int:
    """Seconds of a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``),
    as the sweep's validation reads it (:func:`~kfac_hpc.sweep.safety.slurm_time_seconds`)."""
    seconds = slurm_time_seconds(value)
    if seconds is None:
        raise SweepInputError("time", f"{value!r} is not a Slurm time limit")
    return seconds


def pilot_nodes(node_counts: Sequence[int], max_concurrent: int | None, limit: int | None) -> int:
    """Nodes of the pilot: room for ``max_concurrent`` (default 1) of the largest points at
    once, never more than all points together need, nor more than the partition gives."""
    want = min(max(node_counts) * (max_concurrent or 1), sum(node_counts))
    return max(max(node_counts), min(want, limit or want))


def pilot_walltime_s(node_counts: Sequence[int], block_nodes: int, point_s: int) -> int:
    """The pilot's time limit: every point gets its own limit ``point_s``, in as many rounds as
    packing needs: at most twice the node-seconds bound (first fit), at most one per point."""
    rounds = min(len(node_counts), math.ceil(2 * sum(node_counts) / block_nodes))
    return max(1, rounds) * point_s


def _hms(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def pilot_shape(manifest: Manifest, points: Sequence[PointRecord]) -> PilotShape:
    """The block that runs ``points`` of ``manifest`` (its spec and resolved profile)."""
    spec, profile = manifest.spec, manifest.profile
    counts = [int(p.params["nodes"]) for p in points]
    sbatch_args = (*profile["sbatch_args"], *spec["sbatch_args"])
    limit = slurm.check_partition_fits(max(counts), profile["partition"], sbatch_args)
    concurrent = 1 if spec["serial"] else spec["max_concurrent"]
    nodes = pilot_nodes(counts, concurrent, limit)
    point_s = slurm_seconds(spec["time"] or profile["time"])
    return PilotShape(
        nodes=nodes,
        workers=1 if spec["serial"] else nodes,
        walltime=_hms(pilot_walltime_s(counts, nodes, point_s)),
        ranks_per_node=int(spec["ranks_per_node"]),
        cpus_per_task=int(spec["cpus_per_task"]),
        gpus_per_node=spec["gpus_per_node"] or profile["gpus_per_node"],
        signal_seconds=int(spec["signal_seconds"] or profile["signal_seconds"]),
        launcher=profile["launcher"],
        srun_mpi=profile["srun_mpi"],
        partition=profile["partition"],
        account=profile["account"],
        qos=profile["qos"],
        constraint=profile["constraint"],
        setup=tuple(profile["setup"]),
        sbatch_args=sbatch_args,
        address=pilot_address(),
    )


def pilot_address() -> str | None:
    """``KFAC_HPC_PILOT_ADDRESS``: the IP address the pilot's workers reach this process at
    (None when unset: Parsl tries every address of this host)."""
    value = os.environ.get("KFAC_HPC_PILOT_ADDRESS") or None
    if value is not None:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise SweepInputError(
                "KFAC_HPC_PILOT_ADDRESS",
                f"{value!r} is not an IP address; set it to an address of this host that the "
                "nodes reach (e.g. 127.0.0.1), or unset it",
            ) from None
    return value


def _block_job_id(executor: Any) -> str:
    """The Slurm job id of the pilot block (Parsl submits it just after ``parsl.load``);
    SlurmError with sbatch's reason as soon as Parsl records that the submission failed."""
    deadline = time.monotonic() + _BLOCK_WAIT_S
    while not executor.blocks_to_job_id:
        for status in list(executor.status_facade.values()):
            if status.terminal:
                raise slurm.SlurmError(f"Slurm refused the pilot: {_sbatch_reason(status)}")
        if time.monotonic() > deadline:
            raise slurm.SlurmError("the pilot block was not submitted; see SWEEP_DIR/parsl")
        time.sleep(0.1)
    return str(next(iter(executor.blocks_to_job_id.values())))


def _sbatch_reason(status: Any) -> str:
    """sbatch's own error lines from Parsl's message of a failed submission, on one line."""
    message = str(status.message or status.state)
    _, found, stderr = message.partition("stderr=")
    lines = stderr.splitlines() if found else [message]
    said = [line.split("error:", 1)[-1].strip() for line in lines if line.strip()]
    return "; ".join(dict.fromkeys(said))[:400] or message[:400]


def _fail_points(sweep_dir: Path, point_ids: Sequence[str], detail: str) -> None:
    """Record points the pilot never started as failed (``resume`` runs them again)."""
    with locked_manifest(sweep_dir) as manifest:
        for point in manifest.points:
            if point.point_id in point_ids and PointState(point.state) in LIVE:
                point.state, point.detail = PointState.FAILED.value, detail


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (``kill``, a batch system ending the login session) unwinds like Ctrl-C, so
    Parsl's cleanup cancels the pilot and stops its interchange instead of orphaning them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_pilot_points(sweep_dir: Path, point_ids: Sequence[str] | None = None) -> None:
    """Run points (all, or ``point_ids``) in one new pilot allocation; returns when all ended
    (the allocation is given back then)."""
    manifest = read_manifest(sweep_dir)
    todo = [p for p in manifest.points if point_ids is None or p.point_id in point_ids]
    ids = [p.point_id for p in todo]
    try:
        shape = pilot_shape(manifest, todo)
    except InputError as exc:
        _fail_points(sweep_dir, ids, f"the pilot was not started: {exc}")
        raise
    (sweep_dir / "logs").mkdir(exist_ok=True)
    # Ranks leave at slightly different times after a preemption checkpoint (exit 75): srun
    # must not kill the slower ones. (Hydra's mpiexec takes its node list from Parsl alone.)
    launcher_options = (
        f"--cpus-per-task={shape.cpus_per_task} --mpi={shape.srun_mpi} --kill-on-bad-exit=0"
        if shape.launcher == "srun"
        else ""
    )
    config = pilot_config(sweep_dir / "parsl", shape)
    with _sigterm_unwinds(), parsl.load(config):
        try:
            job_id = _block_job_id(config.executors[0])
        except slurm.SlurmError as exc:
            _fail_points(sweep_dir, ids, str(exc))
            raise
        mark_points(sweep_dir, ids, PointState.SUBMITTED, job_id)
        # Points go to Parsl only when their nodes are free (first fit, in sweep order):
        # Parsl's own backlog of MPI tasks recurses without end when a finished task frees
        # fewer nodes than the next waiting one needs, and the pilot hangs.
        waiting, free = list(todo), shape.nodes
        running: dict[concurrent.futures.Future[Any], tuple[str, int]] = {}
        while waiting or running:
            for point in list(waiting):
                nodes = int(point.params["nodes"])
                if nodes <= free and len(running) < shape.workers:
                    waiting.remove(point)
                    free -= nodes
                    future = _launch(manifest, sweep_dir, point, job_id, shape, launcher_options)
                    running[future] = (point.point_id, nodes)
            ended, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in ended:
                point_id, nodes = running.pop(future)
                free += nodes
                finish_point(sweep_dir, point_id, future, lost="the pilot lost it")


def _launch(
    manifest: Manifest,
    sweep_dir: Path,
    point: PointRecord,
    job_id: str,
    shape: PilotShape,
    launcher_options: str,
) -> concurrent.futures.Future[Any]:
    """Start one point on ``nodes`` free nodes of the pilot; its log is in ``logs/``."""
    nodes = int(point.params["nodes"])
    name = f"{manifest.name}-{point.array}_{job_id}_{point.array_index}.out"
    log = str(sweep_dir / "logs" / name)
    future: concurrent.futures.Future[Any] = _pilot_point(
        point_command(manifest, sweep_dir, point, emulate_nodes=False),
        parsl_resource_specification={
            "num_nodes": nodes,
            "num_ranks": nodes * shape.ranks_per_node,
            "ranks_per_node": shape.ranks_per_node,
            "launcher_options": launcher_options,
        },
        stdout=(log, "a"),
        stderr=(log, "a"),
    )
    return future
