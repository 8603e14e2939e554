"""The ``kfac-hpc sweep`` group (``run``, ``status``, ``resume``, ``cancel``): parse, call,
print. ``kfac-hpc sweep [OPTIONS]`` without a subcommand is ``sweep run``, and the top-level
``status``, ``resume`` and ``cancel`` are the same commands.

The train settings and axes flags are made from the job's option table
(:mod:`kfac_hpc.contracts.options`), so a new train option is a sweep flag as well.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from kfac_hpc.cli_errors import exit_with, guard
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.options import ALIASES
from kfac_hpc.contracts.states import PointState
from kfac_hpc.sweep.backends import BACKEND_NAMES
from kfac_hpc.sweep.errors import SweepInputError, WorkflowError
from kfac_hpc.sweep.manifest import MANIFEST, read_manifest
from kfac_hpc.sweep.slurm_commands import SlurmError
from kfac_hpc.sweep.spec import AXES, TRAIN_SETTINGS

__all__ = ["cancel", "resume", "run", "status", "sweep"]

_FAILURES = ((SlurmError, "Slurm error"), (WorkflowError, "workflow error"))
_LIST = "comma-separated list"


def _sweep_dir_arg(sweep_dir: str) -> Path:
    path = Path(sweep_dir)
    if not (path / MANIFEST).exists():
        raise SweepInputError(
            "SWEEP_DIR", f"{path} holds no manifest.json; give a directory made by kfac-hpc sweep"
        )
    return path.resolve()


def _train_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """One flag per train setting and axis of the option table (reversed: help keeps order)."""
    for name, option in reversed(list(AXES.items())):
        text = f"Axis ({_LIST}): {option.describe()}."
        command = click.option(option.flag, name, default=None, help=text)(command)
    command = click.option(
        "--train-arg",
        "extra_args",
        multiple=True,
        help="Extra argument for kfac-hpc train (repeatable).",
    )(command)
    for name, setting in reversed(list(TRAIN_SETTINGS.items())):
        flag = "--" + name.replace("_", "-")
        if setting is None:
            text = ALIASES[name][1]
        else:
            default = "" if setting.default in (None, ()) else f" [train: {setting.default}]"
            text = f"{setting.describe()}{default}"
        command = click.option(flag, name, default=None, help=text)(command)
    return command


def _run_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The flags of ``sweep run``: the sweep's own, then the train settings and axes."""
    command = _train_options(command)
    for decorator in reversed(_SWEEP_OPTIONS):
        command = decorator(command)
    return command


_SWEEP_OPTIONS = [
    click.option(
        "-f",
        "--file",
        "sweep_file",
        type=click.Path(dir_okay=False),
        help="Sweep TOML file (flags override it).",
    ),
    click.option("--sweep-dir", default=None, help="Directory of the sweep [sweeps/NAME]."),
    click.option("--name", default=None, help="Sweep name (job names start with it) [sweep]."),
    click.option(
        "--nodes", default=None, help=f"Node counts, {_LIST}: one Slurm array each (e.g. 1,2,4)."
    ),
    click.option("--ranks-per-node", default=None, help="MPI ranks per node [1]."),
    click.option("--gpus-per-node", default=None, help="GPUs per node [0, or the profile's]."),
    click.option("--cpus-per-task", default=None, help="CPUs per rank; sets OMP_NUM_THREADS [1]."),
    click.option("--repeats", default=None, help="Runs of every configuration [1]."),
    click.option("--max-concurrent", default=None, help="At most K tasks of an array at once."),
    click.option(
        "--serial", is_flag=True, default=None, help="One point at a time: arrays chained, %1."
    ),
    click.option(
        "--profile",
        default=None,
        help="Site profile: shipped name (local, mpiexec, mpirun) or PATH.toml.",
    ),
    click.option("--time", default=None, help="Slurm time limit per point [the profile's]."),
    click.option("--signal-seconds", default=None, help="USR2 this many seconds before the limit."),
    click.option(
        "--sbatch-arg", "sbatch_args", multiple=True, help="Extra sbatch option (repeatable)."
    ),
    click.option(
        "--allow-gpu-rank-mismatch",
        is_flag=True,
        default=None,
        help="Allow ranks per node != GPUs per node (default: refused on GPU nodes).",
    ),
    click.option(
        "--template",
        type=click.Path(dir_okay=False),
        default=None,
        help="Own Jinja2 sbatch template.",
    ),
    click.option(
        "--script",
        default=None,
        help="Your own training script (PATH.py using kfac_hpc.Run) instead of kfac-hpc train; "
        "its arguments follow -- (docs/sweep.md).",
    ),
    click.option("--backend", type=click.Choice(BACKEND_NAMES), default="slurm", show_default=True),
    click.option(
        "--dry-run",
        is_flag=True,
        help="Write the scripts, print the sbatch commands, submit nothing.",
    ),
    click.option(
        "--wait", is_flag=True, help="Slurm: follow the sweep to the end and print the report."
    ),
]


class _SweepGroup(click.Group):
    """The sweep group: everything after ``--`` is the ``--script``'s own arguments (kept in
    ``ctx.meta``, verbatim), never a subcommand or a sweep flag."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[_SCRIPT_ARGS] = tuple(args[cut + 1 :])
            args = args[:cut]
        return super().parse_args(ctx, args)


_SCRIPT_ARGS = "kfac_hpc.sweep.script_args"


def _script_args() -> tuple[str, ...]:
    return tuple(click.get_current_context().meta.get(_SCRIPT_ARGS, ()))


@click.group("sweep", cls=_SweepGroup, invoke_without_command=True)
@_run_options
@click.pass_context
def sweep(ctx: click.Context, **options: Any) -> None:
    """Expand a scaling sweep into Slurm job arrays (one per node count) and submit them,
    or run it locally with MPI ranks (--backend local); with --script PATH.py, every point
    runs your own training script (its arguments after --). Without a subcommand: `sweep run`."""
    if ctx.invoked_subcommand is None:
        _sweep(**options, script_args=_script_args())


@sweep.command("run")
@_run_options
def run(**options: Any) -> None:
    """Expand a scaling sweep and submit it (the same as `kfac-hpc sweep [OPTIONS]`)."""
    _sweep(**options, script_args=_script_args())


@guard("sweep", _FAILURES)
def _sweep(
    sweep_file: str | None,
    sweep_dir: str | None,
    template: str | None,
    backend: str,
    dry_run: bool,
    wait: bool,
    **fields: Any,
) -> None:
    from kfac_hpc.sweep.backends import backend_for
    from kfac_hpc.sweep.backends.slurm import dry_run_lines
    from kfac_hpc.sweep.prepare import prepare_sweep, write_scripts
    from kfac_hpc.sweep.spec import load_spec

    spec = load_spec(Path(sweep_file) if sweep_file else None, fields)
    directory = Path(sweep_dir) if sweep_dir else Path("sweeps") / spec.name
    sweep_backend = backend_for(backend)
    prepared = prepare_sweep(
        spec,
        directory,
        sweep_backend,
        Path(template) if template else None,
        load=not dry_run,
        dry_run=dry_run,
    )
    points = sum(len(s.points) for s in prepared.scripts)
    if dry_run:
        write_scripts(prepared)
        if prepared.unchecked:
            unchecked = f"NOT checked against a Slurm cluster: {prepared.unchecked}"
            click.echo(f"kfac-hpc sweep: warning: {unchecked}", err=True)
        click.echo(
            f"# dry run: {points} point(s) in {len(prepared.scripts)} array(s); "
            f"scripts in {prepared.sweep_dir}/scripts"
        )
        if prepared.unchecked:
            click.echo(f"# {unchecked}")
        click.echo("\n".join(dry_run_lines(prepared)))
        return
    if sweep_backend.runs_in_process or wait:
        from kfac_hpc.sweep.progress_line import watching
        from kfac_hpc.workflows.sweep_flow import run_sweep

        with watching(prepared.sweep_dir, sys.stderr):
            text = run_sweep(prepared, sweep_backend)
        click.echo(text, nl=False)
        final = read_manifest(prepared.sweep_dir).points
        unfinished = [p for p in final if PointState(p.state) is not PointState.DONE]
        if unfinished:
            exit_with(
                "sweep",
                f"{len(unfinished)} point(s) did not finish; see kfac-hpc status "
                f"{prepared.sweep_dir}, then kfac-hpc resume",
                ExitCode.FAILED,
            )
        return
    manifest = sweep_backend.submit(prepared)
    for array in manifest.arrays:
        job = array.submissions[-1]["array_job_id"]
        click.echo(
            f"array {array.name}: {array.size} point(s) on {array.nodes} node(s) -> job {job}"
        )
    click.echo(f"{points} point(s) submitted; follow with: kfac-hpc status {prepared.sweep_dir}")


@sweep.command("status")
@click.argument("sweep_dir")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per point.")
@click.option(
    "--watch", is_flag=True, help="Show a progress line until no point is live, then the table."
)
@click.option(
    "--interval",
    default=2.0,
    type=click.FloatRange(0.1, 3600),
    help="Seconds before the next poll after a change; doubles while nothing changes (to 60).",
)
@guard("status", _FAILURES)
def status(sweep_dir: str, as_json: bool, watch: bool, interval: float) -> None:
    """State of every point of a sweep (its backend's view, and the run-dir markers)."""
    from kfac_hpc.sweep.follow import status as sweep_status

    path = _sweep_dir_arg(sweep_dir)
    if watch:
        _watch(path, interval)
    _, rows = sweep_status(path)
    if as_json:
        for row in rows:
            click.echo(json.dumps(asdict(row)))
        return
    row_format = "{:12}  {:>5}  {:9}  {:14}  {:>5}  {:14}  {}"
    click.echo(row_format.format("point", "nodes", "state", "job", "tries", "progress", "detail"))
    for r in rows:
        fields = (r.point_id, r.nodes, r.state, r.job_id or "-", r.attempts, r.progress, r.detail)
        click.echo(row_format.format(*fields))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    click.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))


def _watch(sweep_dir: Path, first_s: float) -> None:
    """The progress line (on stderr) until no point is live on two polls in a row (the one
    wait loop, :func:`~kfac_hpc.sweep.waiting.wait_for_sweep`, from ``first_s``)."""
    from kfac_hpc.sweep.progress_line import ProgressLine, count_states
    from kfac_hpc.sweep.waiting import wait_for_sweep

    line = ProgressLine(sys.stderr)
    try:
        wait_for_sweep(
            sweep_dir,
            first_s=first_s,
            on_poll=lambda manifest: line.update(count_states(p.state for p in manifest.points)),
        )
    finally:
        line.close()


@sweep.command("resume")
@click.argument("sweep_dir")
@guard("resume", _FAILURES)
def resume(sweep_dir: str) -> None:
    """Run again only the failed, timed-out, cancelled and preempted points (preempted and
    timed-out ones continue from their checkpoint)."""
    from kfac_hpc.sweep.follow import resume_sweep

    ids = resume_sweep(_sweep_dir_arg(sweep_dir))
    click.echo(f"resubmitted {len(ids)} point(s)" + (f": {' '.join(ids)}" if ids else ""))


@sweep.command("cancel")
@click.argument("sweep_dir")
@guard("cancel", _FAILURES)
def cancel(sweep_dir: str) -> None:
    """Cancel every unfinished point of a sweep (scancel)."""
    from kfac_hpc.sweep.follow import cancel_sweep

    ids = cancel_sweep(_sweep_dir_arg(sweep_dir))
    click.echo(f"cancelled {len(ids)} point(s)")
