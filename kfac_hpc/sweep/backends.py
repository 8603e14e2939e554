"""Where a sweep's points run: the :class:`SweepBackend` interface and its registry.

A backend says how points are submitted, how their state is learned, how they are cancelled
and resumed, and what script runs a point. The Slurm backend submits job arrays and asks
``squeue``/``sacct``; the local backend runs points with local MPI ranks through a Parsl
workflow (:mod:`kfac_hpc.workflows.local`). Everything else (planning, rendering, the
manifest, markers) is shared. A new backend is one class plus one line in ``_REGISTRY``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from kfac_hpc.contracts.rundir import read_markers
from kfac_hpc.contracts.states import PointState, Verdict, classify_point
from kfac_hpc.sweep import slurm
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.manifest import Manifest, PointRecord

if TYPE_CHECKING:
    from kfac_hpc.sweep.submit import PreparedSweep

__all__ = ["BACKEND_NAMES", "SlurmBackend", "SweepBackend", "backend_for"]

# name -> "module:class"; imported on first use (the local backend needs Parsl).
_REGISTRY: dict[str, str] = {
    "slurm": "kfac_hpc.sweep.backends:SlurmBackend",
    "local": "kfac_hpc.workflows.local:LocalBackend",
    "parsl-slurm": "kfac_hpc.workflows.pilot:ParslSlurmBackend",
}
BACKEND_NAMES = tuple(_REGISTRY)


class SweepBackend(ABC):
    """One way of running the points of a sweep."""

    name: ClassVar[str]
    # True: `kfac-hpc sweep` runs the points in this process and returns when they ended.
    runs_in_process: ClassVar[bool] = False
    # True: the points run under Slurm, which must answer before a sweep is written (a dry
    # run says when it did not); :meth:`preflight` then asks it about the sweep.
    uses_slurm: ClassVar[bool] = False

    def preflight(self, prepared: PreparedSweep) -> None:  # noqa: B027 (optional hook)
        """Check ``prepared`` before anything is written (dry runs too): InputError for a
        sweep the backend cannot run, or its scheduler would refuse or hold forever (asked
        unless ``prepared.unchecked`` says why it cannot be: a dry run without Slurm)."""

    @abstractmethod
    def max_array_size(self) -> int:
        """The largest array the backend takes; InputError when it is not usable here."""

    @abstractmethod
    def submit(self, prepared: PreparedSweep) -> Manifest:
        """Start every point of a prepared sweep; the manifest on disk says what started."""

    @abstractmethod
    def refresh(self, manifest: Manifest, sweep_dir: Path) -> None:
        """Update every point's state in ``manifest`` (in memory)."""

    @abstractmethod
    def cancel(self, points: Sequence[PointRecord]) -> None:
        """Stop the jobs of ``points`` (live ones)."""

    @abstractmethod
    def resubmit(self, manifest: Manifest, sweep_dir: Path, points: Sequence[PointRecord]) -> None:
        """Run ``points`` again (already prepared for their retry); updates the manifest."""


def backend_for(name: str) -> SweepBackend:
    """The backend called ``name``; SweepInputError naming the registered ones otherwise."""
    target = _REGISTRY.get(name)
    if target is None:
        raise SweepInputError("backend", f"{name!r} is not one of {', '.join(_REGISTRY)}")
    module, attr = target.split(":")
    backend: SweepBackend = getattr(importlib.import_module(module), attr)()
    return backend


# Slurm's job states as point states: the scheduler holds the task ...
_SLURM_LIVE = {
    **dict.fromkeys(
        ("RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"),
        PointState.RUNNING,
    ),
    **dict.fromkeys(
        ("REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED", "SUSPENDED"),
        PointState.REQUEUED,
    ),
}
# ... or it has ended (what sacct or scontrol remember).
_SLURM_ENDED = {
    "TIMEOUT": PointState.TIMEOUT,
    "DEADLINE": PointState.TIMEOUT,
    "CANCELLED": PointState.CANCELLED,
    "PREEMPTED": PointState.PREEMPTED,
    "FAILED": PointState.FAILED,
    "NODE_FAIL": PointState.FAILED,
    "OUT_OF_MEMORY": PointState.FAILED,
    "BOOT_FAIL": PointState.FAILED,
    "COMPLETED": PointState.FAILED,  # completed without writing a done marker
}


def _live(task: slurm.TaskState) -> Verdict:
    """A task the scheduler holds: running, requeued, or (any other word, PENDING...) waiting
    to start."""
    state = _SLURM_LIVE.get(task.state, PointState.SUBMITTED)
    detail = "" if state is PointState.RUNNING else f"{task.state} {task.reason}".strip()
    return Verdict(state, detail)


def _ended(task: slurm.TaskState) -> tuple[Verdict | None, Verdict | None]:
    """(live, ended) verdicts of a task squeue missed but the controller or accounting knows:
    a state that is not an end (a requeue under way) is still live."""
    if task.state in _SLURM_ENDED:
        detail = (
            "the job completed without a done marker"
            if task.state == "COMPLETED"
            else f"Slurm: {task.state}"
        )
        if task.exit_code and task.exit_code != "0:0":
            detail += f", exit status {task.exit_code}"
        return None, Verdict(_SLURM_ENDED[task.state], detail)
    return _live(task), None


class SlurmBackend(SweepBackend):
    """Job arrays submitted with ``sbatch``; state from ``squeue``, then ``sacct`` (or
    ``scontrol`` where accounting is off), then the run directory's markers."""

    name = "slurm"
    uses_slurm = True

    def max_array_size(self) -> int:
        slurm.require_sbatch()
        return slurm.max_array_size()

    def preflight(self, prepared: PreparedSweep) -> None:
        """The partition holds the largest point, and ``sbatch --test-only`` accepts the
        array of every node count (ranks, CPUs and GPUs per node, time limit, options)."""
        from kfac_hpc.sweep.submit import check_arrays_accepted, check_partition_fits

        if prepared.unchecked:
            return
        spec, profile = prepared.spec, prepared.profile
        args = (*profile.sbatch_args, *spec.sbatch_args)
        check_partition_fits(max(spec.nodes), profile.partition, args)
        check_arrays_accepted(prepared)

    def submit(self, prepared: PreparedSweep) -> Manifest:
        from kfac_hpc.sweep.submit import submit_sweep

        return submit_sweep(prepared)

    def refresh(self, manifest: Manifest, sweep_dir: Path) -> None:
        ids = {p.array_job_id for p in manifest.points if p.array_job_id}
        queued = slurm.squeue_states(ids) if ids else {}
        ended: dict[tuple[str, int], slurm.TaskState] = {}
        if ids:
            accounted = slurm.sacct_states(ids)
            if accounted is not None:
                ended = accounted
            else:
                for array_job_id in ids:
                    tasks = slurm.scontrol_states(array_job_id)
                    ended.update({(array_job_id, i): s for i, s in tasks.items()})
        for point in manifest.points:
            key = (point.array_job_id or "", point.array_index)
            live, final = None, None
            if key in queued:
                live = _live(queued[key])
            elif key in ended:
                live, final = _ended(ended[key])
            verdict = classify_point(
                read_markers(sweep_dir / point.run_dir),
                Verdict(PointState(point.state), point.detail),
                live=live,
                ended=final,
                asked=point.array_job_id is not None,
            )
            point.state, point.detail = verdict.state.value, verdict.detail

    def cancel(self, points: Sequence[PointRecord]) -> None:
        slurm.scancel(p.job_id for p in points if p.job_id)

    def resubmit(self, manifest: Manifest, sweep_dir: Path, points: Sequence[PointRecord]) -> None:
        from kfac_hpc.sweep.submit import submit_array

        previous: str | None = None
        for array in manifest.arrays:
            indices = sorted(p.array_index for p in points if p.array == array.name)
            if indices:
                after = previous if manifest.spec["serial"] else None
                previous = submit_array(manifest, sweep_dir, array, indices, after)
                manifest.write(sweep_dir)
