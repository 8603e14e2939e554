"""Names and versions shared by every analysis module: phases, states, schema versions."""

from __future__ import annotations

from kfac_hpc.contracts.phases import COMM_PHASES, PHASES

__all__ = ["COMM_PHASES", "PHASES", "RUN_SCHEMA", "TABLE_SCHEMA"]

# Version of the run-directory files this collector understands (docs/contracts.md).
RUN_SCHEMA = 1
# Version of the tables ``collect`` writes; bump it when a column changes meaning or goes away.
TABLE_SCHEMA = 1


# Row states of the runs table.
DONE = "done"
FAILED = "failed"  # the job ended badly: error marker, Slurm timeout/cancel/failure
INCOMPLETE = "incomplete"  # not finished yet: pending, running, preempted awaiting requeue
MISSING = "missing"  # the manifest lists the point but its run directory is absent
INVALID = "invalid"  # files contradict each other or cannot be read
STATES: tuple[str, ...] = (DONE, FAILED, INCOMPLETE, MISSING, INVALID)

# Manifest point states (docs/contracts.md) grouped by what they mean for a row.
MANIFEST_FAILED = frozenset({"failed", "timeout", "cancelled"})
MANIFEST_UNFINISHED = frozenset({"pending", "submitted", "running", "preempted", "requeued"})
