"""Parsl configurations of the workflows.

- :func:`local_config` (the local backend): no Slurm at all. Each point is an MPI app of
  Parsl's ``MPIExecutor`` on a ``LocalProvider`` block; the executor's ``$PARSL_MPI_PREFIX`` is
  the venv's ``mpiexec`` (MPICH hydra) with the point's rank count. ``max_concurrent`` points
  run at once.
- :func:`login_config` (the Slurm backend, and any backend whose scheduler holds the points):
  Parsl does not make job arrays, so the arrays are rendered and submitted by kfac-hpc itself;
  the workflow's own steps (submit, wait, collect, report) only call the scheduler's commands
  and read files, so they run in a thread pool on the login node.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from pathlib import Path

from parsl.config import Config
from parsl.executors import MPIExecutor, ThreadPoolExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider

__all__ = ["local_config", "login_config"]

# The strategy's first poll otherwise waits ~5 s before starting the first block.
_STRATEGY_PERIOD_S = 0.5


def local_config(run_dir: Path, max_concurrent: int = 1) -> Config:
    """MPIExecutor on this host. Parsl's MPI executor needs a node file to know the hosts
    (``PBS_NODEFILE`` is the one it reads without a scheduler): we write one naming this host."""
    run_dir.mkdir(parents=True, exist_ok=True)
    nodefile = run_dir / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\n")
    os.environ["PBS_NODEFILE"] = str(nodefile)
    venv_bin = str(Path(sys.executable).parent)
    # interchange.py and mpiexec live in the venv's bin: the submitting process and the
    # workers need it first on PATH even when the venv is not activated.
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    executor = MPIExecutor(
        label="local_mpi",
        address="127.0.0.1",
        mpi_launcher="mpiexec",
        max_workers_per_block=max_concurrent,
        provider=LocalProvider(
            launcher=SimpleLauncher(),
            init_blocks=1,
            min_blocks=0,
            max_blocks=1,
            worker_init=f'export PATH={shlex.quote(venv_bin)}:"$PATH"',
        ),
    )
    return Config(
        executors=[executor],
        strategy_period=_STRATEGY_PERIOD_S,
        run_dir=str(run_dir),
        initialize_logging=False,
    )


def login_config(run_dir: Path) -> Config:
    """The login-node side of a sweep: a few threads that submit, poll and collect."""
    return Config(
        executors=[ThreadPoolExecutor(label="login", max_threads=2)],
        strategy_period=_STRATEGY_PERIOD_S,
        run_dir=str(run_dir),
        initialize_logging=False,
    )
