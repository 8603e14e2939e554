"""Run directories and sweep manifests -> tidy tables -> scaling metrics -> plots and reports.

Reads files only (docs/contracts.md): never imports torch, the job, the optimizer or the sweep.
``kfac-hpc collect`` and ``kfac-hpc report`` live in :mod:`kfac_hpc.analysis.cli`.
"""

from kfac_hpc.analysis.collect import Collection, collect
from kfac_hpc.analysis.schema import COMM_PHASES, PHASES, TABLE_SCHEMA

__all__ = ["COMM_PHASES", "PHASES", "TABLE_SCHEMA", "Collection", "collect"]
