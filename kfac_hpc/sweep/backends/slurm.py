"""The Slurm backend: one job array per node count, submitted with ``sbatch``; each point's
state from ``squeue``, then ``sacct`` (or ``scontrol`` where accounting is off), then its run
directory's markers.

Also what every backend that runs under Slurm shares: asking the controller before anything
is written (:func:`slurm_unchecked`), and ``sbatch --test-only`` of the array of every node
count (:func:`check_arrays_accepted`). Submission keeps "nothing half-done": the manifest is
written just before the first ``sbatch`` and updated after each array, so a crash mid-way
leaves a manifest that says exactly what was submitted.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.rundir import read_markers
from kfac_hpc.contracts.states import PointState, Verdict, classify_point
from kfac_hpc.sweep import slurm_commands as slurm
from kfac_hpc.sweep.backends.base import SweepBackend
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.manifest import ArrayRecord, Manifest, PointRecord, now
from kfac_hpc.sweep.prepare import PreparedSweep, new_manifest, write_scripts

__all__ = [
    "SlurmBackend",
    "array_spec",
    "check_arrays_accepted",
    "dry_run_lines",
    "sbatch_argv",
    "slurm_unchecked",
    "submit_array",
    "submit_sweep",
]

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


def slurm_unchecked(*, dry_run: bool) -> str | None:
    """Whether the Slurm controller can be asked about a sweep: None when it answers; else,
    for a dry run, why not (the dry run goes on and says so). A real run stops: SweepInputError
    without ``sbatch`` or a usable configuration, SlurmError when the controller is down."""
    slurm.require_sbatch()
    try:
        problem = slurm.cluster_problem()
    except SweepInputError as exc:  # no usable configuration: a dry run says so
        if not dry_run:
            raise
        return str(exc)
    if problem is not None and not dry_run:
        raise slurm.SlurmError(problem)
    return problem


def array_spec(indices: Sequence[int], max_concurrent: int | None) -> str:
    """``0-5%2`` or ``1,4`` (compact ranges of consecutive indices) with the optional throttle."""
    ranges: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(ranges) + (f"%{max_concurrent}" if max_concurrent else "")


def sbatch_argv(
    prepared: PreparedSweep | Manifest, script: str, indices: Sequence[int], after: str | None
) -> list[str]:
    """The exact ``sbatch`` command line of one (re)submission, run from the sweep dir."""
    spec, profile = _spec_and_profile(prepared)
    max_concurrent = 1 if spec["serial"] else spec["max_concurrent"]
    argv = ["sbatch", "--parsable", f"--array={array_spec(indices, max_concurrent)}"]
    argv += [*profile["sbatch_args"], *spec["sbatch_args"]]
    if after:
        argv.append(f"--dependency=afterany:{after}")
    return [*argv, script]


def _spec_and_profile(
    source: PreparedSweep | Manifest,
) -> tuple[dict[str, Any], dict[str, Any]]:
    if isinstance(source, Manifest):
        return source.spec, source.profile
    return source.spec.to_dict(), source.profile.to_dict()


def check_arrays_accepted(prepared: PreparedSweep) -> None:
    """:func:`~kfac_hpc.sweep.slurm_commands.check_accepted` for the array of each node count
    (the chunks of one node count share their allocation)."""
    seen: set[int] = set()
    for script in prepared.scripts:
        if script.nodes not in seen:
            seen.add(script.nodes)
            argv = sbatch_argv(prepared, script.relpath, [0], None)[:-1]
            what = f"array {script.name} ({script.nodes} node(s))"
            slurm.check_accepted(argv, script.text, what)


def dry_run_lines(prepared: PreparedSweep) -> list[str]:
    """A runnable shell snippet: the exact sbatch commands, chained through variables."""
    lines = [f"cd {shlex.quote(str(prepared.sweep_dir))}"]
    previous: str | None = None
    for script in prepared.scripts:
        var = script.name.replace("-", "_")
        after = f"${previous}" if previous and prepared.spec.serial else None
        argv = sbatch_argv(prepared, script.relpath, range(len(script.points)), after)
        # The dependency names the previous line's shell variable: it must stay unquoted.
        text = shlex.join(argv).replace(
            shlex.quote(f"--dependency=afterany:{after}"), f"--dependency=afterany:{after}"
        )
        lines.append(f"{var}=$({text})")
        previous = var
    return lines


def submit_array(
    manifest: Manifest,
    sweep_dir: Path,
    array: ArrayRecord,
    indices: Sequence[int],
    after: str | None,
) -> str:
    """One sbatch of ``indices`` of an array; updates the manifest's records (not the file)."""
    argv = sbatch_argv(manifest, array.script, indices, after)
    array_job_id = slurm.sbatch(argv, cwd=sweep_dir)
    array.submissions.append(
        {"array_job_id": array_job_id, "indices": list(indices), "argv": argv, "time": now()}
    )
    for point in manifest.points:
        if point.array == array.name and point.array_index in indices:
            point.array_job_id = array_job_id
            point.job_id = f"{array_job_id}_{point.array_index}"
            point.attempts += 1
            point.state = "submitted"
            point.detail = ""
    return array_job_id


def submit_sweep(prepared: PreparedSweep) -> Manifest:
    """Submit every array of a prepared sweep (chained if serial); a failed ``sbatch`` cancels
    the arrays already submitted and marks every point cancelled."""
    write_scripts(prepared)
    manifest = new_manifest(prepared)
    manifest.write(prepared.sweep_dir)
    previous: str | None = None
    submitted: list[str] = []
    try:
        for array in manifest.arrays:
            after = previous if prepared.spec.serial else None
            previous = submit_array(manifest, prepared.sweep_dir, array, range(array.size), after)
            submitted.append(previous)
            manifest.write(prepared.sweep_dir)
    except slurm.SlurmError as exc:
        slurm.scancel(submitted)
        for point in manifest.points:
            point.state, point.detail = "cancelled", f"submission aborted: {exc}"
        manifest.write(prepared.sweep_dir)
        raise
    return manifest


class SlurmBackend(SweepBackend):
    """Job arrays submitted with ``sbatch``; state from ``squeue``, then ``sacct`` (or
    ``scontrol`` where accounting is off), then the run directory's markers."""

    name = "slurm"

    def unchecked(self, *, dry_run: bool) -> str | None:
        return slurm_unchecked(dry_run=dry_run)

    def max_array_size(self) -> int:
        slurm.require_sbatch()
        return slurm.max_array_size()

    def preflight(self, prepared: PreparedSweep) -> None:
        """The partition holds the largest point, and ``sbatch --test-only`` accepts the
        array of every node count (ranks, CPUs and GPUs per node, time limit, options)."""
        if prepared.unchecked:
            return
        spec, profile = prepared.spec, prepared.profile
        args = (*profile.sbatch_args, *spec.sbatch_args)
        slurm.check_partition_fits(max(spec.nodes), profile.partition, args)
        check_arrays_accepted(prepared)

    def submit(self, prepared: PreparedSweep) -> Manifest:
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
        previous: str | None = None
        for array in manifest.arrays:
            indices = sorted(p.array_index for p in points if p.array == array.name)
            if indices:
                after = previous if manifest.spec["serial"] else None
                previous = submit_array(manifest, sweep_dir, array, indices, after)
                manifest.write(sweep_dir)
