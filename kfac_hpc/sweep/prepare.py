"""From a validated spec to a prepared sweep, for every backend: plan the arrays, check every
point as its job will, render every script, ask the backend, and only then write.

Order matters for "nothing half-done": the profile, template, every point's train arguments,
every script and the backend's own checks (a Slurm backend: ``sbatch --test-only`` of every
allocation) pass before anything is written, so bad input leaves no folder behind. Starting
the points is the backend's (:meth:`~kfac_hpc.sweep.backends.base.SweepBackend.submit`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.job_checks import check_loadable, check_train_values
from kfac_hpc.sweep.manifest import MANIFEST, ArrayRecord, Manifest, PointRecord, now
from kfac_hpc.sweep.profile import SiteProfile, job_command, load_profile
from kfac_hpc.sweep.render import ArrayScript, load_template, render_array
from kfac_hpc.sweep.slurm_commands import DEFAULT_MAX_ARRAY_SIZE
from kfac_hpc.sweep.spec import Point, SweepSpec, expand_points
from kfac_hpc.sweep.train_args import group_hash

if TYPE_CHECKING:
    from kfac_hpc.sweep.backends.base import SweepBackend

__all__ = [
    "SUBDIRS",
    "PreparedSweep",
    "new_manifest",
    "plan_arrays",
    "prepare_sweep",
    "write_scripts",
]


@dataclass(frozen=True)
class PreparedSweep:
    """Everything rendered and validated, nothing written or started yet. ``unchecked``: why
    the sweep was not checked against the scheduler (a dry run when Slurm does not answer)."""

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


def _check_sbatch_args(spec: SweepSpec, profile: SiteProfile) -> None:
    """Every script carries the sbatch options: options only, never a command."""
    for arg in (*profile.sbatch_args, *spec.sbatch_args):
        if not arg.startswith("-") or arg.startswith("--wrap"):
            raise SweepInputError(
                "sbatch_args", f"{arg!r} is not an sbatch option (e.g. --exclusive, --mem=8G)"
            )


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
    backend: SweepBackend,
    template: Path | None = None,
    *,
    load: bool = True,
    dry_run: bool = False,
) -> PreparedSweep:
    """Validate and render every array and let ``backend`` check it (:meth:`~kfac_hpc.sweep.
    backends.base.SweepBackend.preflight`); raises InputError (or the scheduler's error when it
    does not answer) before writing anything. ``load``: also load every point's dataset and
    build its model. ``dry_run``: a scheduler that cannot be asked is noted in ``unchecked``
    instead."""
    profile = load_profile(spec.profile)
    backend.check_profile(profile)
    _check_sbatch_args(spec, profile)
    _check_gpus(spec, profile)
    tmpl = load_template(template)
    points = expand_points(spec)
    if spec.script is None:  # a script's points are judged by the script itself
        check_train_values(points)
    unchecked = backend.unchecked(dry_run=dry_run)
    max_size = DEFAULT_MAX_ARRAY_SIZE if unchecked else backend.max_array_size()
    scripts = tuple(
        render_array(tmpl, spec, profile, name, group)
        for name, group in plan_arrays(points, spec.nodes, max_size - 1)
    )
    prepared = PreparedSweep(
        sweep_dir.resolve(), spec, profile, backend.name, scripts, unchecked=unchecked
    )
    backend.preflight(prepared)
    if load and spec.script is None:
        check_loadable(points)
    _check_sweep_dir(sweep_dir)
    return prepared


def write_scripts(prepared: PreparedSweep) -> None:
    """The array scripts into ``SWEEP_DIR/scripts`` (every backend writes them: the same sweep
    runs with ``--backend slurm``), with the ``logs`` and ``runs`` folders."""
    for sub in ("scripts", "logs", "runs"):
        (prepared.sweep_dir / sub).mkdir(exist_ok=True)
    for script in prepared.scripts:
        path = prepared.sweep_dir / script.relpath
        path.write_text(script.text)
        path.chmod(0o755)


def new_manifest(prepared: PreparedSweep) -> Manifest:
    """The manifest of a prepared sweep: every point ``pending``, nothing submitted."""
    arrays = [ArrayRecord(s.name, s.nodes, s.relpath, len(s.points)) for s in prepared.scripts]
    points = [
        PointRecord(p.point_id, p.params, group_hash(p.params), f"runs/{p.point_id}", s.name, i)
        for s in prepared.scripts
        for i, p in enumerate(s.points)
    ]
    profile = prepared.profile.to_dict()
    spec = prepared.spec
    # resolved, as rendered: the train command, or the script's
    profile["train_command"] = list(job_command(prepared.profile, spec.script, spec.script_args))
    return Manifest(
        prepared.spec.name,
        prepared.backend,
        now(),
        prepared.spec.to_dict(),
        profile,
        arrays,
        points,
    )
