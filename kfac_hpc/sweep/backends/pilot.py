"""The pilot backend (``--backend parsl-slurm``): one Slurm allocation runs every point, as
job steps started by the Parsl workflow :mod:`kfac_hpc.workflows.pilot` (its block's size, its
run loop) in the process of ``kfac-hpc sweep`` or ``resume``; each point's ``job_id`` is the
pilot's Slurm job id.

This module is the sweep's side: what the scheduler must accept before anything is written,
and each point's state from the manifest, the pilot job and the run directory's markers. The
workflow (and Parsl) is imported only when a pilot is sized or runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kfac_hpc.contracts.rundir import CONFIG, read_markers
from kfac_hpc.contracts.states import LIVE, PointState, Verdict, classify_point
from kfac_hpc.sweep import slurm_commands as slurm
from kfac_hpc.sweep.backends.base import SweepBackend
from kfac_hpc.sweep.backends.slurm import check_arrays_accepted, slurm_unchecked
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.manifest import Manifest, PointRecord, read_manifest
from kfac_hpc.sweep.prepare import PreparedSweep, new_manifest, write_scripts
from kfac_hpc.sweep.profile import SiteProfile

__all__ = ["ParslSlurmBackend"]

# Slurm's states of a pilot job that still holds (or will hold) its points.
_PILOT_LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")


class ParslSlurmBackend(SweepBackend):
    """Every point as a job step of one Parsl pilot allocation, run from the process of
    ``kfac-hpc sweep`` or ``resume``; state from that process's records, the pilot job and
    the run directories' markers."""

    name = "parsl-slurm"
    runs_in_process = True

    def check_profile(self, profile: SiteProfile) -> None:
        if profile.launcher not in ("srun", "mpiexec"):
            raise SweepInputError(
                "profile",
                f"profile {profile.name} launches with {profile.launcher}; the parsl-slurm "
                "backend launches with srun or mpiexec (MPICH): choose such a profile or "
                "--backend slurm",
            )

    def unchecked(self, *, dry_run: bool) -> str | None:
        return slurm_unchecked(dry_run=dry_run)

    def max_array_size(self) -> int:
        slurm.require_sbatch()
        return slurm.DEFAULT_MAX_ARRAY_SIZE  # no arrays: the groups only name the points

    def preflight(self, prepared: PreparedSweep) -> None:
        """The array backend's checks of every node count (:func:`~kfac_hpc.sweep.backends.
        slurm.check_arrays_accepted`), then ``sbatch --test-only`` of the pilot block itself:
        an allocation Slurm can never grant is refused here, not waited for."""
        from kfac_hpc.workflows.configs import pilot_test_script
        from kfac_hpc.workflows.pilot import pilot_address, pilot_shape

        pilot_address()
        if prepared.unchecked:
            return
        manifest = new_manifest(prepared)
        shape = pilot_shape(manifest, manifest.points)  # and the partition holds the points
        check_arrays_accepted(prepared)
        what = f"the pilot allocation ({shape.nodes} node(s) for {shape.walltime})"
        slurm.check_accepted(["sbatch"], pilot_test_script(shape), what)

    def submit(self, prepared: PreparedSweep) -> Manifest:
        from kfac_hpc.workflows.pilot import run_pilot_points

        manifest = new_manifest(prepared)
        write_scripts(prepared)  # the arrays' scripts: the same sweep by --backend slurm
        manifest.write(prepared.sweep_dir)
        run_pilot_points(prepared.sweep_dir)
        return read_manifest(prepared.sweep_dir)

    def refresh(self, manifest: Manifest, sweep_dir: Path) -> None:
        live_ids = {p.job_id for p in manifest.points if p.job_id and PointState(p.state) in LIVE}
        pilots = slurm.job_states(live_ids)
        for point in manifest.points:
            known = Verdict(PointState(point.state), point.detail)
            live = None
            pilot = pilots.get(point.job_id or "")
            run_dir = sweep_dir / point.run_dir
            if known.state in LIVE and pilot in _PILOT_LIVE:
                started = pilot == "RUNNING" and (run_dir / CONFIG).exists()
                live = (
                    Verdict(PointState.RUNNING)
                    if started
                    else Verdict(PointState.SUBMITTED, f"in pilot job {point.job_id} ({pilot})")
                )
            markers = read_markers(run_dir)
            verdict = classify_point(
                markers,
                known,
                live=None if any(m is not None for m in markers) else live,
                # The pilot ended and the point is still live in the manifest without a marker:
                # the process that ran it is gone too (it records every end it sees).
                asked=known.state in LIVE and pilot is not None and pilot not in _PILOT_LIVE,
            )
            point.state, point.detail = verdict.state.value, verdict.detail

    def cancel(self, points: Sequence[PointRecord]) -> None:
        """Cancel the pilot jobs of ``points`` (every point of those pilots stops)."""
        slurm.scancel(p.job_id for p in points if p.job_id)

    def resubmit(self, manifest: Manifest, sweep_dir: Path, points: Sequence[PointRecord]) -> None:
        from kfac_hpc.workflows.pilot import run_pilot_points

        run_pilot_points(sweep_dir, [p.point_id for p in points])
