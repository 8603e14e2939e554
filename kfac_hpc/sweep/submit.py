"""From a validated spec to submitted arrays: plan, render everything, check, then submit.

Order matters for "nothing half-done": the sweep directory, profile, template, every script
and (a Slurm backend) ``sbatch --test-only`` of every allocation are checked before anything
is written, so bad input leaves no folder behind; the
manifest is written just before it and updated after each array, so a crash mid-way leaves a
manifest that says exactly what was submitted.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_hpc.sweep import slurm
from kfac_hpc.sweep.backends import backend_for
from kfac_hpc.sweep.command import group_hash
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.manifest import MANIFEST, ArrayRecord, Manifest, PointRecord, now
from kfac_hpc.sweep.points_check import check_loadable, check_train_values
from kfac_hpc.sweep.profile import SiteProfile, load_profile, train_command
from kfac_hpc.sweep.render import ArrayScript, load_template, render_array
from kfac_hpc.sweep.spec import Point, SweepSpec, expand_points

__all__ = [
    "PreparedSweep",
    "array_spec",
    "check_accepted",
    "check_arrays_accepted",
    "check_partition_fits",
    "plan_arrays",
    "prepare_sweep",
    "submit_array",
    "submit_sweep",
]


@dataclass(frozen=True)
class PreparedSweep:
    """Everything rendered and validated, nothing submitted yet. ``unchecked``: why the
    sweep was not checked against the scheduler (a dry run when Slurm does not answer)."""

    sweep_dir: Path
    spec: SweepSpec
    profile: SiteProfile
    backend: str
    scripts: tuple[ArrayScript, ...]
    unchecked: str | None = None


def plan_arrays(
    points: Sequence[Point], node_counts: Sequence[int], max_size: int
) -> list[tuple[str, tuple[Point, ...]]]:
    """One array per node count, split into chunks of at most ``max_size`` tasks
    (indices 0..max_size-1), named ``n<nodes>-<chunk>``."""
    plan: list[tuple[str, tuple[Point, ...]]] = []
    for nodes in node_counts:
        group = [p for p in points if p.nodes == nodes]
        for chunk, start in enumerate(range(0, len(group), max_size)):
            plan.append((f"n{nodes}-{chunk}", tuple(group[start : start + max_size])))
    return plan


def _check_gpus(spec: SweepSpec, profile: SiteProfile) -> None:
    """One rank per GPU on GPU nodes, unless the user asks otherwise: more ranks than GPUs
    share devices (NCCL refuses two ranks on one GPU), fewer leave GPUs idle."""
    gpus = spec.gpus_per_node or (profile.gpus_per_node or 0)
    if gpus and spec.ranks_per_node != gpus and not spec.allow_gpu_rank_mismatch:
        raise SweepInputError(
            "ranks_per_node",
            f"{spec.ranks_per_node} rank(s) per node on nodes with {gpus} GPU(s); use "
            f"--ranks-per-node {gpus}, or --allow-gpu-rank-mismatch if that is intended",
        )


def _requested_partition(sbatch_args: Sequence[str]) -> str | None:
    """The partition named by ``-p X``, ``-pX``, ``--partition X`` or ``--partition=X``."""
    for i, arg in enumerate(sbatch_args):
        if arg in ("-p", "--partition") and i + 1 < len(sbatch_args):
            return sbatch_args[i + 1]
        for prefix in ("--partition=", "-p"):
            if arg.startswith(prefix) and len(arg) > len(prefix):
                return arg[len(prefix) :]
    return None


def check_partition_fits(
    nodes: int, partition: str | None, sbatch_args: Sequence[str]
) -> int | None:
    """Refuse a node count that the partition can never hold (it would pend forever).
    Returns the most nodes one job gets in the partition asked for (None: not known)."""
    partitions = slurm.partition_limits()
    wanted = _requested_partition(sbatch_args) or partition
    chosen = [p for p in partitions if p.name == wanted or (wanted is None and p.default)]
    for part in chosen:
        if nodes > part.job_nodes:
            biggest = max(partitions, key=lambda p: p.job_nodes)
            raise SweepInputError(
                "nodes",
                f"{nodes} node(s) do not fit partition {part.name}, which holds at most "
                f"{part.job_nodes} node(s) per job (largest partition: {biggest.name}, "
                f"{biggest.job_nodes}); lower --nodes or choose a partition with --sbatch-arg=-p",
            )
    return chosen[0].job_nodes if chosen else None


def check_accepted(argv: Sequence[str], script: str, what: str) -> None:
    """SweepInputError with Slurm's reason unless ``sbatch --test-only`` accepts ``script``
    (given on stdin) with ``argv`` (``sbatch OPTIONS``, no script path): an allocation Slurm
    can never grant (more ranks or CPUs than the nodes have, GPUs it lacks, a partition it
    does not know, a time limit above the partition's) is refused before anything is written."""
    problem = slurm.sbatch_test_only(argv, script=script)
    if problem is not None:
        raise SweepInputError("sbatch", f"Slurm rejects {what}: {problem}")


def check_arrays_accepted(prepared: PreparedSweep) -> None:
    """:func:`check_accepted` for the array of each node count (the chunks of one node count
    share their allocation)."""
    seen: set[int] = set()
    for script in prepared.scripts:
        if script.nodes not in seen:
            seen.add(script.nodes)
            argv = sbatch_argv(prepared, script.relpath, [0], None)[:-1]
            check_accepted(argv, script.text, f"array {script.name} ({script.nodes} node(s))")


# The folders a sweep writes into its directory.
SUBDIRS = ("scripts", "logs", "runs", "parsl", "report", "failed")


def _check_sweep_dir(sweep_dir: Path) -> None:
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise SweepInputError(
            "sweep_dir", f"{sweep_dir} exists and is not a directory; choose another --sweep-dir"
        )
    _check_subdirs(sweep_dir)
    if (sweep_dir / MANIFEST).exists():
        raise SweepInputError(
            "sweep_dir",
            f"{sweep_dir} already holds a sweep; use kfac-hpc status/resume or another --sweep-dir",
        )
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SweepInputError("sweep_dir", f"cannot create {sweep_dir}: {exc.strerror}") from None
    if not os.access(sweep_dir, os.W_OK | os.X_OK):
        raise SweepInputError(
            "sweep_dir", f"{sweep_dir} is not writable; choose another --sweep-dir"
        )


def _check_subdirs(sweep_dir: Path) -> None:
    """The sweep's own folders are folders (or absent) before anything is written."""
    for sub in SUBDIRS:
        path = sweep_dir / sub
        if (path.exists() or path.is_symlink()) and not path.is_dir():
            raise SweepInputError(
                "sweep_dir",
                f"{path} exists and is not a directory; remove it or choose another --sweep-dir",
            )


def prepare_sweep(
    spec: SweepSpec,
    sweep_dir: Path,
    backend: str,
    template: Path | None = None,
    *,
    load: bool = True,
    dry_run: bool = False,
) -> PreparedSweep:
    """Validate and render every array and check it against the scheduler (a Slurm backend);
    raises InputError (or SlurmError when Slurm does not answer) before writing anything.
    ``load``: also load every point's dataset and build its model. ``dry_run``: a scheduler
    that does not answer is noted in ``unchecked`` instead."""
    sweep_backend = backend_for(backend)
    profile = load_profile(spec.profile)
    for arg in (*profile.sbatch_args, *spec.sbatch_args):
        if not arg.startswith("-") or arg.startswith("--wrap"):
            raise SweepInputError(
                "sbatch_args", f"{arg!r} is not an sbatch option (e.g. --exclusive, --mem=8G)"
            )
    _check_gpus(spec, profile)
    tmpl = load_template(template)
    points = expand_points(spec)
    check_train_values(points)
    unchecked = None
    if sweep_backend.uses_slurm:
        slurm.require_sbatch()
        try:
            unchecked = slurm.cluster_problem()
        except SweepInputError as exc:  # no usable configuration: a dry run says so
            if not dry_run:
                raise
            unchecked = str(exc)
        if unchecked is not None and not dry_run:
            raise slurm.SlurmError(unchecked)
    max_size = slurm.DEFAULT_MAX_ARRAY_SIZE if unchecked else sweep_backend.max_array_size()
    scripts = tuple(
        render_array(tmpl, spec, profile, name, group)
        for name, group in plan_arrays(points, spec.nodes, max_size - 1)
    )
    prepared = PreparedSweep(
        sweep_dir.resolve(), spec, profile, backend, scripts, unchecked=unchecked
    )
    sweep_backend.preflight(prepared)
    if load:
        check_loadable(points)
    _check_sweep_dir(sweep_dir)
    return prepared


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


def write_scripts(prepared: PreparedSweep) -> None:
    for sub in ("scripts", "logs", "runs"):
        (prepared.sweep_dir / sub).mkdir(exist_ok=True)
    for script in prepared.scripts:
        path = prepared.sweep_dir / script.relpath
        path.write_text(script.text)
        path.chmod(0o755)


def new_manifest(prepared: PreparedSweep) -> Manifest:
    arrays = [ArrayRecord(s.name, s.nodes, s.relpath, len(s.points)) for s in prepared.scripts]
    points = [
        PointRecord(p.point_id, p.params, group_hash(p.params), f"runs/{p.point_id}", s.name, i)
        for s in prepared.scripts
        for i, p in enumerate(s.points)
    ]
    profile = prepared.profile.to_dict()
    profile["train_command"] = list(train_command(prepared.profile))  # resolved, as rendered
    return Manifest(
        prepared.spec.name,
        prepared.backend,
        now(),
        prepared.spec.to_dict(),
        profile,
        arrays,
        points,
    )


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
    """Submit every array of a sweep :func:`prepare_sweep` checked (chained if serial)."""
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
