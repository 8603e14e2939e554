"""``kfac-hpc script SCRIPT [ARGS]... [--run-dir DIR]``: run a training script that uses
:class:`kfac_hpc.Run` as one rank of a sweep point (``kfac-hpc sweep --script`` starts it under
the point's launcher, which gives the rank environment).

The script runs in this process as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``, its folder
first on ``sys.path``, as ``python SCRIPT ARGS`` would run it. ``--run-dir DIR`` as the last two
arguments (where the sweep's launchers put it) is not passed on: it becomes
``KFAC_HPC_RUN_DIR``, the run directory ``kfac_hpc.Run`` writes.
"""

from __future__ import annotations

import os
import runpy
import sys

import click

from kfac_hpc.cli_errors import guard
from kfac_hpc.contracts.environment import RUN_DIR_ENV
from kfac_hpc.contracts.scripts import check_script

__all__ = ["script"]


@click.command(
    "script",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("path", metavar="SCRIPT")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@guard("script")
def script(path: str, args: tuple[str, ...]) -> None:
    """Run SCRIPT (a Python file using kfac_hpc.Run) with ARGS as a sweep point's rank; a
    trailing `--run-dir DIR` sets its run directory (KFAC_HPC_RUN_DIR)."""
    argv = list(args)
    if len(argv) >= 2 and argv[-2] == "--run-dir":
        os.environ[RUN_DIR_ENV] = os.path.abspath(argv[-1])
        argv = argv[:-2]
    resolved = check_script(path, "SCRIPT")
    sys.argv = [str(resolved), *argv]
    sys.path.insert(0, str(resolved.parent))
    runpy.run_path(str(resolved), run_name="__main__")
