"""Parsl configurations of the workflows.

- :func:`local_config` (the local backend): no Slurm at all. Each point is an MPI app of
  Parsl's ``MPIExecutor`` on a ``LocalProvider`` block; the executor's ``$PARSL_MPI_PREFIX`` is
  the venv's ``mpiexec`` (MPICH hydra) with the point's rank count. ``max_concurrent`` points
  run at once.
- :func:`login_config` (the Slurm backend, and any backend whose scheduler holds the points):
  Parsl does not make job arrays, so the arrays are rendered and submitted by kfac-hpc itself;
  the workflow's own steps (submit, wait, collect, report) only call the scheduler's commands
  and read files, so they run in a thread pool on the login node.
- :func:`pilot_config` (the parsl-slurm backend): one ``SlurmProvider`` block of
  :class:`PilotShape` nodes whose ``MPIExecutor`` starts each point as a job step (srun, or
  MPICH's mpiexec) on the nodes it gives that point.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from parsl.config import Config
from parsl.executors import MPIExecutor, ThreadPoolExecutor
from parsl.launchers import SimpleLauncher
from parsl.providers import LocalProvider, SlurmProvider

__all__ = [
    "PilotShape",
    "local_config",
    "login_config",
    "pilot_config",
    "pilot_provider",
    "pilot_test_script",
]

# The strategy's first poll otherwise waits ~5 s before starting the first block.
_STRATEGY_PERIOD_S = 0.5


def _venv_on_path() -> str:
    """Put the venv's bin (interchange.py, mpiexec) first on PATH; returns it."""
    venv_bin = str(Path(sys.executable).parent)
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    return venv_bin


def local_config(run_dir: Path, max_concurrent: int = 1) -> Config:
    """MPIExecutor on this host. Parsl's MPI executor needs a node file to know the hosts
    (``PBS_NODEFILE`` is the one it reads without a scheduler): we write one naming this host."""
    run_dir.mkdir(parents=True, exist_ok=True)
    nodefile = run_dir / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\n")
    os.environ["PBS_NODEFILE"] = str(nodefile)
    # interchange.py and mpiexec live in the venv's bin: the submitting process and the
    # workers need it first on PATH even when the venv is not activated.
    venv_bin = _venv_on_path()
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


@dataclass(frozen=True)
class PilotShape:
    """The one allocation of a pilot: ``nodes`` for ``walltime`` (HH:MM:SS), ``workers``
    points at once, the site's launcher and scheduler options (from the sweep's profile).
    ``address``: where the workers reach this process (None: Parsl tries every address)."""

    nodes: int
    workers: int
    walltime: str
    ranks_per_node: int
    cpus_per_task: int
    gpus_per_node: int | None
    signal_seconds: int
    launcher: str
    srun_mpi: str
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    setup: tuple[str, ...]
    sbatch_args: tuple[str, ...]
    address: str | None


def pilot_provider(shape: PilotShape) -> SlurmProvider:
    """The SlurmProvider of the pilot's one block (its ``scheduler_options`` are the block's
    ``#SBATCH`` lines after nodes, time and tasks per node, as Parsl writes them)."""
    venv_bin = _venv_on_path()
    options = [
        f"#SBATCH --ntasks-per-node={shape.ranks_per_node}",
        f"#SBATCH --cpus-per-task={shape.cpus_per_task}",
        # Without B: Slurm signals every job step, i.e. every running point, not this shell.
        f"#SBATCH --signal=USR2@{shape.signal_seconds}",
        *(f"#SBATCH {arg}" for arg in shape.sbatch_args),
    ]
    worker_init = [
        f'export PATH={shlex.quote(venv_bin)}:"$PATH"',
        # srun reads it: a stray pmix from the login shell keeps MPICH ranks from starting.
        f"export SLURM_MPI_TYPE={shlex.quote(shape.srun_mpi)}",
        *shape.setup,
    ]
    return SlurmProvider(
        nodes_per_block=shape.nodes,
        init_blocks=1,
        min_blocks=0,
        max_blocks=1,
        walltime=shape.walltime,
        partition=shape.partition,
        account=shape.account,
        qos=shape.qos,
        constraint=shape.constraint,
        gpus_per_node=shape.gpus_per_node,
        scheduler_options="\n".join(options),
        worker_init="\n".join(worker_init),
        launcher=SimpleLauncher(),
    )


def pilot_test_script(shape: PilotShape) -> str:
    """A batch script with the pilot block's ``#SBATCH`` lines (as Parsl's SlurmProvider
    writes them) that does nothing: for ``sbatch --test-only`` before the sweep starts."""
    provider = pilot_provider(shape)
    head = [
        "#!/bin/bash",
        f"#SBATCH --nodes={provider.nodes_per_block}",
        f"#SBATCH --time={shape.walltime}",
        "#SBATCH --ntasks-per-node=1",
    ]
    return "\n".join([*head, provider.scheduler_options, "true", ""])


def pilot_config(run_dir: Path, shape: PilotShape) -> Config:
    """MPIExecutor on one SlurmProvider block; ``strategy="none"``: that one block and no
    other, so a sweep (or a resume) is exactly one allocation."""
    run_dir.mkdir(parents=True, exist_ok=True)
    executor = MPIExecutor(
        label="pilot",
        address=shape.address,
        mpi_launcher=shape.launcher,
        max_workers_per_block=shape.workers,
        provider=pilot_provider(shape),
    )
    return Config(
        executors=[executor],
        strategy="none",
        strategy_period=_STRATEGY_PERIOD_S,
        run_dir=str(run_dir),
        initialize_logging=False,
    )
