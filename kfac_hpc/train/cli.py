"""``kfac-hpc train``: parse flags into a TrainConfig and run the job; nothing else.

Flags are generated from the TrainConfig fields (``--field-name``), so every field has a flag
and a help text; ``--time-limit`` and ``--checkpoint-every`` accept durations.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import click

from kfac_hpc.cli_errors import bad_input
from kfac_hpc.contracts import InputError, RunDir
from kfac_hpc.contracts.options import ALIASES, OPTIONS
from kfac_hpc.contracts.workload_names import KINDS, installed
from kfac_hpc.train.config import ConfigError, check_run_dir, field_help, load_config

__all__ = ["train"]

# Field -> the friendlier flag that sets it (``--time-limit`` for ``time_limit_s``).
_ALIAS_OF = {name: alias for alias, (names, _) in ALIASES.items() for name in names}


def _flag(name: str) -> str:
    return "--" + _ALIAS_OF.get(name, name).replace("_", "-")


# Options given once per item (``--model-arg a=1 --model-arg b=2``) or comma-separated.
_REPEATABLE = frozenset(f"{kind}_arg" for kind in KINDS)


def _joined(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> str | None:
    """A repeatable flag's items as one comma-separated value; None when not given."""
    del ctx, param
    return ",".join(value) if value else None


def _options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add one option per option of the table (aliases once), in reverse so help keeps order."""
    helps = field_help()
    for option in reversed([o for o in OPTIONS.values() if o.name not in _ALIAS_OF]):
        default = option.default if option.default not in (None, ()) else None
        shown = f" [default: {default}]" if default is not None else ""
        name, flag = option.name, option.flag
        if option.kind == "bool":
            decls = [f"{flag}/--no-{flag[2:]}"]
            command = click.option(*decls, name, default=None, help=helps[name] + shown)(command)
            continue
        text = helps[name] + (" (comma-separated)" if option.kind in ("strs", "ints") else shown)
        if name in KINDS and installed()[name]:
            text += f"; installed: {', '.join(installed()[name])}"
        kind = {"int": int, "float": float}.get(option.kind, str)
        if name in _REPEATABLE:
            each = click.option(
                flag, name, multiple=True, default=None, callback=_joined, help=text
            )
            command = each(command)
            continue
        command = click.option(flag, name, type=kind, default=None, help=text)(command)
    for alias in ("checkpoint_every", "time_limit"):
        command = click.option(_flag(alias), alias, type=str, help=ALIASES[alias][1])(command)
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


# The launchers' own rank variables, in the order kfac_hpc.runtime.launch trusts them (an MPI
# launcher's beat the Slurm step's it may inherit); read here without importing torch.
_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def launcher_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher's environment tells it before any process group
    exists; 0 when it tells none (a plain start, or a launcher only mpi4py knows)."""
    env = os.environ if env is None else env
    names = list(_RANK_VARIABLES)
    if "SLURM_STEP_ID" in env or "SLURM_STEP_NUM_TASKS" in env:  # inside srun
        names.append("SLURM_PROCID")
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return int(value) if value.isdigit() else 0
    return 0


def _bad_input(exc: InputError) -> NoReturn:
    """Exit 2 on every rank; the line once: from the rank the ranks agreed on (``quiet`` set
    by :func:`~kfac_hpc.train.job.agree_on_input`), else from the launcher's rank 0 (every rank
    parsed the same flags and files, so each would print the same line)."""
    quiet = getattr(exc, "quiet", None)
    flag = {"config": "--config", "run_dir": "--run-dir"}.get(exc.field, _flag(exc.field))
    bad_input("train", flag, exc.reason, quiet=quiet if quiet is not None else launcher_rank() != 0)


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
        if not run_dir.strip():
            raise ConfigError("run_dir", "empty; give a new or existing run directory")
        RunDir(run_dir).check_usable()
        check_run_dir(config, RunDir(run_dir).saved_config_hash(), run_dir)
    except InputError as exc:
        _bad_input(exc)
    # torch is imported only past validation, so bad flags fail fast
    from kfac_hpc.runtime import LaunchError
    from kfac_hpc.train.run import run_training

    try:
        code = run_training(config, run_dir, ignore_late_signals=True)
    except InputError as exc:
        _bad_input(exc)
    except LaunchError as exc:
        bad_input("train", "launch", str(exc))
    raise SystemExit(code)
