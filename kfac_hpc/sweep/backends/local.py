"""The local backend: every point with local MPI ranks on this host, run by the Parsl workflow
:mod:`kfac_hpc.workflows.local` in the process of ``kfac-hpc sweep`` or ``resume``.

No scheduler holds the points: the workflow records each point's end in the manifest as it
happens, so :meth:`LocalBackend.refresh` reads the markers and trusts the manifest for the
rest. The workflow (and Parsl) is imported only when points run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kfac_hpc.contracts.rundir import read_markers
from kfac_hpc.contracts.states import PointState, Verdict, classify_point
from kfac_hpc.sweep.backends.base import SweepBackend
from kfac_hpc.sweep.manifest import Manifest, PointRecord, read_manifest
from kfac_hpc.sweep.prepare import PreparedSweep, new_manifest
from kfac_hpc.sweep.slurm_commands import DEFAULT_MAX_ARRAY_SIZE

__all__ = ["LocalBackend"]


class LocalBackend(SweepBackend):
    """Local MPI ranks through Parsl; no scheduler, nothing to cancel from another process."""

    name = "local"
    runs_in_process = True

    def max_array_size(self) -> int:
        return DEFAULT_MAX_ARRAY_SIZE  # no arrays: the groups only name the points

    def submit(self, prepared: PreparedSweep) -> Manifest:
        from kfac_hpc.workflows.local import run_local_points

        new_manifest(prepared).write(prepared.sweep_dir)
        run_local_points(prepared.sweep_dir)
        return read_manifest(prepared.sweep_dir)

    def refresh(self, manifest: Manifest, sweep_dir: Path) -> None:
        for point in manifest.points:
            verdict = classify_point(
                read_markers(sweep_dir / point.run_dir),
                Verdict(PointState(point.state), point.detail),
            )
            point.state, point.detail = verdict.state.value, verdict.detail

    def cancel(self, points: Sequence[PointRecord]) -> None:
        """Nothing to stop from here: the points run under the workflow of another process
        (stopping it stops them); they are marked cancelled."""

    def resubmit(self, manifest: Manifest, sweep_dir: Path, points: Sequence[PointRecord]) -> None:
        from kfac_hpc.workflows.local import run_local_points

        run_local_points(sweep_dir, [p.point_id for p in points])
