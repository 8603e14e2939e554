"""Where a sweep's points run: the backends and their registry.

- ``base``    the :class:`SweepBackend` interface
- ``slurm``   job arrays through ``sbatch``; state from ``squeue``/``sacct``/``scontrol``; the
              sbatch command lines, the submission and Slurm's checks of a sweep
- ``local``   local MPI ranks through the Parsl workflow ``kfac_hpc.workflows.local``
- ``pilot``   one Slurm allocation for every point, through ``kfac_hpc.workflows.pilot``

A backend module is imported on first use (the Parsl ones import Parsl only when they run
points). The backends drive the workflows, never the reverse: no workflow imports a backend.
A new backend is one class plus one line in ``_REGISTRY``.
"""

from __future__ import annotations

import importlib

from kfac_hpc.sweep.backends.base import SweepBackend
from kfac_hpc.sweep.errors import SweepInputError

__all__ = ["BACKEND_NAMES", "SweepBackend", "backend_for"]

# name -> "module:class"
_REGISTRY: dict[str, str] = {
    "slurm": "kfac_hpc.sweep.backends.slurm:SlurmBackend",
    "local": "kfac_hpc.sweep.backends.local:LocalBackend",
    "parsl-slurm": "kfac_hpc.sweep.backends.pilot:ParslSlurmBackend",
}
BACKEND_NAMES = tuple(_REGISTRY)


def backend_for(name: str) -> SweepBackend:
    """The backend called ``name``; SweepInputError naming the registered ones otherwise."""
    target = _REGISTRY.get(name)
    if target is None:
        raise SweepInputError("backend", f"{name!r} is not one of {', '.join(_REGISTRY)}")
    module, attr = target.split(":")
    backend: SweepBackend = getattr(importlib.import_module(module), attr)()
    return backend
