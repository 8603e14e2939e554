"""Following a sweep from disk: ``status``, ``resume`` and ``cancel``.

A point's state comes from, in order: the scheduler's queue (``squeue``: pending, running,
requeued), the run directory's markers (``done``, ``error``, ``preempted``), the scheduler's
memory of ended jobs (``sacct`` when accounting works, else ``scontrol`` for MinJobAge
seconds), and finally the manifest's last known state.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kfac_hpc.sweep import slurm
from kfac_hpc.sweep.manifest import RESUMABLE_STATES, Manifest, PointRecord, locked_manifest
from kfac_hpc.sweep.submit import submit_array

__all__ = ["PointStatus", "cancel_sweep", "progress", "refresh", "resume_sweep"]

_RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT", "SIGNALING", "RESIZING"}
_REQUEUED = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED", "SUSPENDED"}
_ENDED = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "CANCELLED": "cancelled",
    "PREEMPTED": "preempted",
    "FAILED": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
}


@dataclass(frozen=True)
class PointStatus:
    """One line of ``kfac-hpc status``."""

    point_id: str
    nodes: int
    state: str
    job_id: str | None
    attempts: int
    progress: str
    detail: str


def _marker_state(run_dir: Path) -> tuple[str, str] | None:
    if (run_dir / "done").exists():
        return "done", ""
    if (run_dir / "error").exists():
        text = (run_dir / "error").read_text(errors="replace").strip().splitlines()
        return "failed", text[0][:200] if text else "error marker"
    if (run_dir / "preempted").exists():
        return "preempted", "checkpointed, waiting for a requeue"
    return None


def _classify(
    point: PointRecord, run_dir: Path, queued: slurm.TaskState | None, ended: slurm.TaskState | None
) -> tuple[str, str]:
    """(state, detail) of one point; see the module docstring for the order of sources."""
    marker = _marker_state(run_dir)
    if queued is not None:
        if queued.state in _RUNNING:
            return "running", ""
        if queued.state in _REQUEUED or (marker is not None and marker[0] == "preempted"):
            return "requeued", f"{queued.state} {queued.reason}".strip()
        return "submitted", f"{queued.state} {queued.reason}".strip()
    preempted = marker is not None and marker[0] == "preempted"
    if preempted and ended is not None and ended.state not in {*_ENDED, "COMPLETED"}:
        # squeue missed it for a moment (a requeued task between records), but the
        # controller still holds it pending or running: the requeue is under way.
        return "requeued", f"{ended.state} {ended.reason}".strip()
    if marker is not None:
        return marker
    if ended is not None:
        if ended.state in _ENDED:
            return _ENDED[ended.state], f"Slurm: {ended.state}"
        if ended.state == "COMPLETED":
            return "failed", "the job completed without a done marker"
    if point.state in ("submitted", "running", "requeued") and point.array_job_id is not None:
        return "failed", "gone from the scheduler without a marker; see the log in logs/"
    return point.state, point.detail


def refresh(manifest: Manifest, sweep_dir: Path) -> None:
    """Update every point's state in ``manifest`` (in memory) from the scheduler and markers."""
    ids = {p.array_job_id for p in manifest.points if p.array_job_id}
    queued = slurm.squeue_states(ids) if manifest.backend == "slurm" and ids else {}
    ended: dict[tuple[str, int], slurm.TaskState] = {}
    if manifest.backend == "slurm" and ids:
        accounted = slurm.sacct_states(ids)
        if accounted is not None:
            ended = accounted
        else:
            for array_job_id in ids:
                ended.update(
                    {(array_job_id, i): s for i, s in slurm.scontrol_states(array_job_id).items()}
                )
    for point in manifest.points:
        if manifest.backend == "local":
            marker = _marker_state(sweep_dir / point.run_dir)
            if marker is not None:
                point.state, point.detail = marker
            continue
        key = (point.array_job_id or "", point.array_index)
        point.state, point.detail = _classify(
            point, sweep_dir / point.run_dir, queued.get(key), ended.get(key)
        )


def progress(run_dir: Path) -> str:
    """``step 120/500`` from the last train record of metrics.jsonl (and config.json), or ``-``."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return "-"
    with open(metrics, "rb") as fh:
        fh.seek(0, 2)
        fh.seek(max(0, fh.tell() - 16384))
        tail = fh.read().decode(errors="replace").splitlines()
    step = None
    for line in reversed(tail):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train":
            step = record.get("step")
            break
    if step is None:
        return "-"
    try:
        total = json.loads((run_dir / "config.json").read_text()).get("steps")
    except (OSError, ValueError):
        total = None
    return f"step {step}/{total}" if total else f"step {step}"


def status(sweep_dir: Path) -> tuple[Manifest, list[PointStatus]]:
    """Refresh and persist the manifest, then one status line per point."""
    with locked_manifest(sweep_dir) as manifest:
        refresh(manifest, sweep_dir)
    rows = [
        PointStatus(
            p.point_id,
            int(p.params["nodes"]),
            p.state,
            p.job_id,
            p.attempts,
            progress(sweep_dir / p.run_dir),
            p.detail,
        )
        for p in manifest.points
    ]
    return manifest, rows


def cancel_sweep(sweep_dir: Path) -> list[str]:
    """``scancel`` every array with unfinished points; those points become ``cancelled``."""
    with locked_manifest(sweep_dir) as manifest:
        refresh(manifest, sweep_dir)
        live = [
            p for p in manifest.points if p.state in ("pending", "submitted", "running", "requeued")
        ]
        if manifest.backend == "slurm":
            slurm.scancel(p.job_id for p in live if p.job_id)
        for point in live:
            point.state, point.detail = "cancelled", "kfac-hpc cancel"
    return [p.point_id for p in live]


def resumable(manifest: Manifest) -> list[PointRecord]:
    return [p for p in manifest.points if p.state in RESUMABLE_STATES]


def prepare_for_retry(sweep_dir: Path, point: PointRecord) -> None:
    """A failed run restarts clean (its directory moves to ``failed/<id>.<attempt>``, the
    failure may lie in its state); preempted, timed-out and cancelled runs keep their directory
    and continue from their latest complete checkpoint."""
    run_dir = sweep_dir / point.run_dir
    if point.state == "failed" and (run_dir.exists() or run_dir.is_symlink()):
        graveyard = sweep_dir / "failed"
        graveyard.mkdir(exist_ok=True)
        shutil.move(str(run_dir), str(graveyard / f"{point.point_id}.{point.attempts}"))
    else:
        (run_dir / "preempted").unlink(missing_ok=True)


def resume_sweep(sweep_dir: Path) -> list[str]:
    """Resubmit exactly the failed, timed-out, cancelled and preempted points of a Slurm sweep
    (the same array scripts, only their indices). Returns the resubmitted point ids."""
    with locked_manifest(sweep_dir) as manifest:
        if manifest.backend != "slurm":
            raise ValueError(
                "resume of a local sweep runs through the workflow: kfac-hpc resume handles it"
            )
        refresh(manifest, sweep_dir)
        todo = resumable(manifest)
        for point in todo:
            prepare_for_retry(sweep_dir, point)
        previous: str | None = None
        for array in manifest.arrays:
            indices: Sequence[int] = sorted(p.array_index for p in todo if p.array == array.name)
            if indices:
                after = previous if manifest.spec["serial"] else None
                previous = submit_array(manifest, sweep_dir, array, indices, after)
                manifest.write(sweep_dir)
    return [p.point_id for p in todo]
