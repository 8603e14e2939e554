"""Following a sweep from disk: ``status``, ``resume`` and ``cancel``.

A point's state comes from its backend (the scheduler's queue and memory of ended jobs) and
its run directory's markers, combined by :func:`kfac_hpc.contracts.states.classify_point`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from kfac_hpc.contracts.records import TRAIN
from kfac_hpc.contracts.rundir import CONFIG, METRICS, Marker
from kfac_hpc.contracts.states import LIVE, RESUMABLE, PointState
from kfac_hpc.sweep.backends import backend_for
from kfac_hpc.sweep.manifest import Manifest, PointRecord, locked_manifest

__all__ = [
    "RETRY",
    "PointStatus",
    "cancel_sweep",
    "progress",
    "refresh",
    "resume_sweep",
    "status",
]

# What `resume` does with a point in each state: start it clean (its directory moves aside,
# the failure may lie in its state), continue it from its latest checkpoint, or leave it.
RETRY: dict[PointState, str | None] = {
    PointState.PENDING: None,
    PointState.SUBMITTED: None,
    PointState.RUNNING: None,
    PointState.REQUEUED: None,
    PointState.DONE: None,
    PointState.FAILED: "clean",
    PointState.TIMEOUT: "continue",
    PointState.CANCELLED: "continue",
    PointState.PREEMPTED: "continue",
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


def refresh(manifest: Manifest, sweep_dir: Path) -> None:
    """Update every point's state in ``manifest`` (in memory) from its backend and markers."""
    backend_for(manifest.backend).refresh(manifest, sweep_dir)


def progress(run_dir: Path) -> str:
    """``step 120/500`` from the last train record of metrics.jsonl (and config.json), or ``-``."""
    metrics = run_dir / METRICS
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
        if record.get("kind") == TRAIN:
            step = record.get("step")
            break
    if step is None:
        return "-"
    try:
        total = json.loads((run_dir / CONFIG).read_text()).get("steps")
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
    """Cancel every live point (its backend stops its job); those points become
    ``cancelled``."""
    with locked_manifest(sweep_dir) as manifest:
        refresh(manifest, sweep_dir)
        live = [p for p in manifest.points if PointState(p.state) in LIVE]
        backend_for(manifest.backend).cancel(live)
        for point in live:
            point.state, point.detail = PointState.CANCELLED.value, "kfac-hpc cancel"
    return [p.point_id for p in live]


def resumable(manifest: Manifest) -> list[PointRecord]:
    return [p for p in manifest.points if PointState(p.state) in RESUMABLE]


def prepare_for_retry(sweep_dir: Path, point: PointRecord) -> None:
    """Make ``point``'s run directory ready for the retry :data:`RETRY` names for its state."""
    run_dir = sweep_dir / point.run_dir
    retry = RETRY[PointState(point.state)]
    if retry == "clean" and (run_dir.exists() or run_dir.is_symlink()):
        graveyard = sweep_dir / "failed"
        graveyard.mkdir(exist_ok=True)
        shutil.move(str(run_dir), str(graveyard / f"{point.point_id}.{point.attempts}"))
    elif retry == "continue":
        (run_dir / str(Marker.PREEMPTED)).unlink(missing_ok=True)


def resume_sweep(sweep_dir: Path) -> list[str]:
    """Run exactly the failed, timed-out, cancelled and preempted points again (Slurm: the
    same array scripts, only their indices). Returns their point ids."""
    with locked_manifest(sweep_dir) as manifest:
        backend = backend_for(manifest.backend)
        refresh(manifest, sweep_dir)
        todo = resumable(manifest)
        for point in todo:
            prepare_for_retry(sweep_dir, point)
        if not backend.runs_in_process:
            backend.resubmit(manifest, sweep_dir, todo)
    if todo and backend.runs_in_process:  # runs for long: the manifest lock is released
        backend.resubmit(manifest, sweep_dir, todo)
    return [p.point_id for p in todo]
