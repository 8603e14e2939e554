"""The click commands ``sweep``, ``status``, ``resume`` and ``cancel``: parse, call, print."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click

from kfac_hpc.sweep import slurm
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.manifest import read_manifest

__all__ = ["cancel", "resume", "status", "sweep"]

F = TypeVar("F", bound=Callable[..., Any])


def _fail_on_errors(name: str, func: F) -> F:
    """Bad input → one line naming the field, exit 2; a failing Slurm command → exit 1."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except SweepInputError as exc:
            click.echo(f"kfac-hpc {name}: error: {exc}", err=True)
            sys.exit(2)
        except slurm.SlurmError as exc:
            click.echo(f"kfac-hpc {name}: Slurm error: {exc}", err=True)
            sys.exit(1)

    wrapper.__name__, wrapper.__doc__ = func.__name__, func.__doc__
    return wrapper  # type: ignore[return-value]


def _sweep_dir_arg(sweep_dir: str) -> Path:
    path = Path(sweep_dir)
    if not (path / "manifest.json").exists():
        raise SweepInputError(
            "SWEEP_DIR", f"{path} holds no manifest.json; give a directory made by kfac-hpc sweep"
        )
    return path.resolve()


_LIST = "comma-separated list"


@click.command("sweep")
@click.option(
    "-f",
    "--file",
    "sweep_file",
    type=click.Path(dir_okay=False),
    help="Sweep TOML file (flags override it).",
)
@click.option("--sweep-dir", default=None, help="Directory of the sweep [default: sweeps/NAME].")
@click.option("--name", default=None, help="Sweep name (job names start with it) [default: sweep].")
@click.option(
    "--nodes", default=None, help=f"Node counts, {_LIST}: one Slurm array each (e.g. 1,2,4,16)."
)
@click.option("--ranks-per-node", default=None, help="MPI ranks per node [1].")
@click.option("--gpus-per-node", default=None, help="GPUs per node [0, or the profile's].")
@click.option("--cpus-per-task", default=None, help="CPUs per rank; sets OMP_NUM_THREADS [1].")
@click.option("--repeats", default=None, help="Runs of every configuration [1].")
@click.option("--model", default=None, help="Model of kfac-hpc train [mlp].")
@click.option("--dataset", default=None, help="Dataset of kfac-hpc train [digits].")
@click.option("--steps", default=None, help="Training steps per run.")
@click.option("--epochs", default=None, help="Training epochs per run.")
@click.option(
    "--scaling", default=None, help="strong (fixed global batch) or weak (fixed per-rank batch)."
)
@click.option("--lr", default=None, help="Learning rate.")
@click.option("--target-accuracy", default=None, help="Accuracy for time-to-target.")
@click.option("--checkpoint-every", default=None, help="Checkpoint interval in steps.")
@click.option(
    "--train-arg",
    "extra_args",
    multiple=True,
    help="Extra argument for kfac-hpc train (repeatable).",
)
@click.option("--optimizer", default=None, help=f"Axis: sgd, adam, adamw ({_LIST}).")
@click.option("--kfac", default=None, help=f"Axis: K-FAC on/off ({_LIST}, e.g. true,false).")
@click.option(
    "--grad-worker-fraction", default=None, help=f"Axis: K-FAC grad-worker fraction ({_LIST})."
)
@click.option("--factor-update-steps", default=None, help=f"Axis: K-FAC factor interval ({_LIST}).")
@click.option("--inv-update-steps", default=None, help=f"Axis: K-FAC inverse interval ({_LIST}).")
@click.option("--batch-size", default=None, help=f"Axis: batch size ({_LIST}).")
@click.option("--seed", default=None, help=f"Axis: random seeds ({_LIST}).")
@click.option("--max-concurrent", default=None, help="At most K tasks of an array at once (%K).")
@click.option(
    "--serial", is_flag=True, default=None, help="One point at a time: arrays chained, %1."
)
@click.option(
    "--profile",
    default=None,
    help="Site profile: shipped name (local, mpiexec, mpirun) or PATH.toml.",
)
@click.option("--time", default=None, help="Slurm time limit per point [the profile's].")
@click.option("--signal-seconds", default=None, help="USR2 this many seconds before the limit.")
@click.option(
    "--sbatch-arg", "sbatch_args", multiple=True, help="Extra sbatch option (repeatable)."
)
@click.option(
    "--template", type=click.Path(dir_okay=False), default=None, help="Own Jinja2 sbatch template."
)
@click.option(
    "--backend", type=click.Choice(["slurm", "local"]), default="slurm", show_default=True
)
@click.option(
    "--dry-run", is_flag=True, help="Write the scripts, print the sbatch commands, submit nothing."
)
@click.option(
    "--wait", is_flag=True, help="Slurm: follow the sweep to the end and print the report."
)
def sweep(**options: Any) -> None:
    """Expand a scaling sweep into Slurm job arrays (one per node count) and submit them,
    or run it locally with MPI ranks (--backend local)."""
    _fail_on_errors("sweep", _sweep)(**options)


def _sweep(
    sweep_file: str | None,
    sweep_dir: str | None,
    template: str | None,
    backend: str,
    dry_run: bool,
    wait: bool,
    **fields: Any,
) -> None:
    from kfac_hpc.sweep.spec import load_spec
    from kfac_hpc.sweep.submit import dry_run_lines, prepare_sweep, submit_sweep, write_scripts

    spec = load_spec(Path(sweep_file) if sweep_file else None, fields)
    directory = Path(sweep_dir) if sweep_dir else Path("sweeps") / spec.name
    prepared = prepare_sweep(spec, directory, backend, Path(template) if template else None)
    points = sum(len(s.points) for s in prepared.scripts)
    if dry_run:
        write_scripts(prepared)
        click.echo(
            f"# dry run: {points} point(s) in {len(prepared.scripts)} array(s); "
            f"scripts in {prepared.sweep_dir}/scripts"
        )
        click.echo("\n".join(dry_run_lines(prepared)))
        return
    if backend == "local" or wait:
        from kfac_hpc.workflows.sweep_flow import run_sweep

        click.echo(run_sweep(prepared), nl=False)
        unfinished = [p for p in read_manifest(prepared.sweep_dir).points if p.state != "done"]
        if unfinished:
            click.echo(
                f"kfac-hpc sweep: {len(unfinished)} point(s) did not finish; see kfac-hpc status "
                f"{prepared.sweep_dir}, then kfac-hpc resume",
                err=True,
            )
            sys.exit(1)
        return
    manifest = submit_sweep(prepared)
    for array in manifest.arrays:
        job = array.submissions[-1]["array_job_id"]
        click.echo(
            f"array {array.name}: {array.size} point(s) on {array.nodes} node(s) -> job {job}"
        )
    click.echo(f"{points} point(s) submitted; follow with: kfac-hpc status {prepared.sweep_dir}")


@click.command("status")
@click.argument("sweep_dir")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per point.")
def status(sweep_dir: str, as_json: bool) -> None:
    """State of every point of a sweep (squeue, sacct when available, run-dir markers)."""

    def run() -> None:
        from kfac_hpc.sweep.follow import status as sweep_status

        _, rows = sweep_status(_sweep_dir_arg(sweep_dir))
        if as_json:
            for row in rows:
                click.echo(json.dumps(asdict(row)))
            return
        row_format = "{:12}  {:>5}  {:9}  {:14}  {:>5}  {:14}  {}"
        click.echo(
            row_format.format("point", "nodes", "state", "job", "tries", "progress", "detail")
        )
        for r in rows:
            fields = (
                r.point_id,
                r.nodes,
                r.state,
                r.job_id or "-",
                r.attempts,
                r.progress,
                r.detail,
            )
            click.echo(row_format.format(*fields))
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.state] = counts.get(r.state, 0) + 1
        click.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))

    _fail_on_errors("status", run)()


@click.command("resume")
@click.argument("sweep_dir")
def resume(sweep_dir: str) -> None:
    """Resubmit only the failed, timed-out, cancelled and preempted points (preempted and
    timed-out ones continue from their checkpoint)."""

    def run() -> None:
        path = _sweep_dir_arg(sweep_dir)
        if read_manifest(path).backend == "local":
            from kfac_hpc.workflows.sweep_flow import resume_local

            ids = resume_local(path)
        else:
            from kfac_hpc.sweep.follow import resume_sweep

            ids = resume_sweep(path)
        click.echo(f"resubmitted {len(ids)} point(s)" + (f": {' '.join(ids)}" if ids else ""))

    _fail_on_errors("resume", run)()


@click.command("cancel")
@click.argument("sweep_dir")
def cancel(sweep_dir: str) -> None:
    """Cancel every unfinished point of a sweep (scancel)."""

    def run() -> None:
        from kfac_hpc.sweep.follow import cancel_sweep

        ids = cancel_sweep(_sweep_dir_arg(sweep_dir))
        click.echo(f"cancelled {len(ids)} point(s)")

    _fail_on_errors("cancel", run)()
