"""kfac-hpc: distributed K-FAC for PyTorch and the tooling to run scaling studies on HPC
clusters."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["FOSI", "KFACPreconditioner", "Run", "__version__", "recomputed_batchnorm"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import kfac_hpc` (the CLI, the analysis tools) does not import torch.
    if name == "KFACPreconditioner":
        from kfac_hpc.optim import KFACPreconditioner

        return KFACPreconditioner
    if name == "FOSI":
        from kfac_hpc.optim import FOSI

        return FOSI
    if name == "Run":
        from kfac_hpc.train.script_run import Run

        return Run
    if name == "recomputed_batchnorm":
        from kfac_hpc.train.batchnorm import recomputed_batchnorm

        return recomputed_batchnorm
    raise AttributeError(f"module 'kfac_hpc' has no attribute {name!r}")
