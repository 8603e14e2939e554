"""``kfac-hpc train``: parse flags into a TrainConfig and run the job; nothing else.

Flags are generated from the TrainConfig fields (``--field-name``), so every field has a flag
and a help text; ``--time-limit`` and ``--checkpoint-every`` accept durations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import click

from kfac_hpc.train.config import (
    ConfigError,
    TrainConfig,
    check_run_dir,
    field_help,
    load_config,
)
from kfac_hpc.train.rundir import RunDir

__all__ = ["train"]

EXIT_BAD_INPUT = 2
# Fields set through a friendlier flag than their own name.
_ALIASES = {
    "time_limit_s": "time_limit",
    "checkpoint_every_steps": "checkpoint_every",
    "checkpoint_every_min": "checkpoint_every",
}
_EXTRA_HELP = {
    "time_limit": "stop training after this wall time (90s, 30m, 2h, HH:MM:SS); the run ends "
    "done, with a final evaluation",
    "checkpoint_every": "checkpoint every N steps (an integer) or every duration (10m, 1h)",
}


def _flag(name: str) -> str:
    return "--" + _ALIASES.get(name, name).replace("_", "-")


def _type(annotation: str) -> Any:
    base = annotation.replace(" | None", "")
    return {"int": int, "float": float}.get(base, str)


def _options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add one option per TrainConfig field (aliases once), in reverse so help keeps order."""
    helps = field_help()
    fields = [f for f in dataclasses.fields(TrainConfig) if f.name not in _ALIASES]
    for f in reversed(fields):
        annotation = str(f.type)
        default = f.default if f.default not in (None, ()) else None
        shown = f" [default: {default}]" if default is not None else ""
        flag = _flag(f.name)
        if annotation == "bool":
            decls = [f"{flag}/--no-{flag[2:]}"]
            command = click.option(*decls, f.name, default=None, help=helps[f.name] + shown)(
                command
            )
            continue
        if annotation.startswith("tuple"):
            text = helps[f.name] + " (comma-separated)"
        else:
            text = helps[f.name] + shown
        command = click.option(flag, f.name, type=_type(annotation), default=None, help=text)(
            command
        )
    for alias in ("checkpoint_every", "time_limit"):
        command = click.option(_flag(alias), alias, type=str, help=_EXTRA_HELP[alias])(command)
    return command


class _OneLineErrors(click.Command):
    """Flag parsing errors as one line (no usage block), exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if not isinstance(exc, click.NoSuchOption):
                exc.ctx = None
            raise


def _bad_input(exc: ConfigError) -> None:
    flag = {"config": "--config", "run_dir": "--run-dir"}.get(exc.field, _flag(exc.field))
    click.echo(f"kfac-hpc train: {flag}: {exc.reason}", err=True)
    raise SystemExit(EXIT_BAD_INPUT)


@click.command(cls=_OneLineErrors)
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="the run directory: config.json, metrics.jsonl, run.json, checkpoints/, markers; "
    "an existing one is resumed from its latest checkpoint",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file of settings (keys are the flag names with underscores); flags override it",
)
@_options
def train(run_dir: str, config_file: str | None, **flags: Any) -> None:
    """One training run: trains, times every phase on every rank, checkpoints, resumes.

    Start it plainly, under `mpiexec -n N`, or under `srun --mpi=pmi2` (ranks come from the
    launcher). Exit codes: 0 done, 1 failed (RUN_DIR/error holds the message), 2 bad input
    (nothing written), 75 preempted (checkpoint written; requeue to resume).
    See docs/train.md for the run directory's files.
    """
    try:
        config = load_config(config_file, flags)
        check_run_dir(config, RunDir(run_dir).saved_config_hash(), run_dir)
    except ConfigError as exc:
        _bad_input(exc)
    # torch is imported only past validation, so bad flags fail fast
    from kfac_hpc.runtime import LaunchError
    from kfac_hpc.train.run import run_training

    try:
        code = run_training(config, run_dir)
    except ConfigError as exc:
        _bad_input(exc)
    except LaunchError as exc:
        click.echo(f"kfac-hpc train: launch: {exc}", err=True)
        raise SystemExit(EXIT_BAD_INPUT) from None
    raise SystemExit(code)
