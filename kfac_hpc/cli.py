"""The ``kfac-hpc`` command: a thin click group whose subcommands live beside their code.

Subcommands are imported only when used, so ``kfac-hpc --help`` stays fast and a broken
optional dependency affects only the command that needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from kfac_hpc import __version__
from kfac_hpc.cli_errors import usage_error

# name -> "module:attribute" of a click command
COMMANDS: dict[str, str] = {
    "checkpoint": "kfac_hpc.checkpoint.inspect:checkpoint",
    "doctor": "kfac_hpc.runtime.doctor:doctor",
    "sweep": "kfac_hpc.sweep.cli:sweep",
    "status": "kfac_hpc.sweep.cli:status",
    "resume": "kfac_hpc.sweep.cli:resume",
    "cancel": "kfac_hpc.sweep.cli:cancel",
    "train": "kfac_hpc.train.cli:train",
    "script": "kfac_hpc.train.script_cli:script",
    "collect": "kfac_hpc.analysis.cli:collect_command",
    "report": "kfac_hpc.analysis.cli:report_command",
    "plan": "kfac_hpc.plan.cli:plan",
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        command: Any = getattr(importlib.import_module(module_name), attr)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        """Run the subcommand; click's flag-parsing errors of every subcommand leave by the one
        exit path (``kfac-hpc COMMAND: error: --flag: reason``, exit 2: cli_errors.py)."""
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise  # a group given no subcommand shows its help
        except click.UsageError as exc:
            usage_error(_command_name(exc.ctx, ctx), exc)


def _command_name(failed: click.Context | None, root: click.Context) -> str:
    """``sweep status`` for an error in ``kfac-hpc sweep status``."""
    names: list[str] = []
    while failed is not None and failed.parent is not None:
        names.append(failed.info_name or "")
        failed = failed.parent
    return " ".join(reversed(names)) or root.invoked_subcommand or "kfac-hpc"


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kfac-hpc")
def main() -> None:
    """Distributed K-FAC training and scaling studies on Slurm/MPI clusters.

    \b
    Typical use:
      kfac-hpc doctor                     check torch, MPI, Slurm, h5py, Parsl
      kfac-hpc train --run-dir RUN ...    one training run (under srun or mpiexec)
      kfac-hpc sweep --nodes 1,2,4 ...    a scaling sweep as Slurm job arrays
      kfac-hpc report SWEEP_DIR           tables and plots of a sweep
      kfac-hpc plan --hardware v100-edr   predicted step time per phase, P = 1 … 1,024
    """
