"""Names and versions shared by every analysis module: phases, row states, schema versions."""

from __future__ import annotations

from kfac_hpc.contracts.phases import COMM_PHASES
from kfac_hpc.contracts.phases import REPORTED_PHASES as PHASES
from kfac_hpc.contracts.rundir import SCHEMA_VERSION
from kfac_hpc.contracts.states import PointState

__all__ = ["COMM_PHASES", "PHASES", "ROW_STATE", "RUN_SCHEMA", "STATES", "TABLE_SCHEMA"]

# Version of the run-directory files this collector understands (the job's, one definition).
RUN_SCHEMA = SCHEMA_VERSION
# Version of the tables ``collect`` writes; bump it when a column changes meaning or goes away.
TABLE_SCHEMA = 1


# Row states of the runs table.
DONE = "done"
FAILED = "failed"  # the job ended badly: error marker, Slurm timeout/cancel/failure
INCOMPLETE = "incomplete"  # not finished yet: pending, running, preempted awaiting requeue
MISSING = "missing"  # the manifest lists the point but its run directory is absent
INVALID = "invalid"  # files contradict each other or cannot be read
STATES: tuple[str, ...] = (DONE, FAILED, INCOMPLETE, MISSING, INVALID)

# The row of a point in each state (every PointState: a new state needs a row here).
ROW_STATE: dict[PointState, str] = {
    PointState.PENDING: INCOMPLETE,
    PointState.SUBMITTED: INCOMPLETE,
    PointState.RUNNING: INCOMPLETE,
    PointState.REQUEUED: INCOMPLETE,
    PointState.PREEMPTED: INCOMPLETE,
    PointState.DONE: DONE,
    PointState.FAILED: FAILED,
    PointState.TIMEOUT: FAILED,
    PointState.CANCELLED: FAILED,
}
