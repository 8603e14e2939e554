"""kfac-hpc: distributed K-FAC for PyTorch, and the tooling for scaling studies on HPC clusters."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
