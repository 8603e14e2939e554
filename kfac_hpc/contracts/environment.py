"""Environment variables a launcher sets for the job it starts: the name is shared here, so the
launcher (the sweep's local backend) and the job's rank discovery (``kfac_hpc.runtime.launch``)
agree on it without importing each other."""

from __future__ import annotations

__all__ = ["EMULATED_NODES", "RUN_DIR_ENV"]

# The number of nodes a launcher emulates on one host: the local sweep backend runs an N-node
# point's ranks on this machine and sets it to N; the job then reports N nodes (docs/sweep.md).
EMULATED_NODES = "KFAC_HPC_EMULATED_NODES"

# The run directory of a point whose job is the user's own script (``kfac-hpc sweep --script``):
# the sweep's launcher sets it, ``kfac_hpc.Run`` reads it (docs/workloads.md).
RUN_DIR_ENV = "KFAC_HPC_RUN_DIR"
