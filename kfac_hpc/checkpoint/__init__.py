"""HDF5 checkpoints of the whole training state: atomic, verified, re-shardable, no pickle.

The job uses :func:`capture_training_state` + :class:`CheckpointManager` to save,
:meth:`CheckpointManager.load_latest` / :func:`load_checkpoint` + :func:`restore_training_state`
to resume and :func:`init_factors_from` for ``--init-factors``. A training method hands its state
over as plain trees (:class:`~kfac_hpc.contracts.method_state.MethodState`). Schema and protocols:
docs/checkpoint.md.
"""

from kfac_hpc.checkpoint.async_writer import AsyncCheckpointWriter
from kfac_hpc.checkpoint.manager import (
    CheckpointManager,
    SkippedCheckpoint,
    find_checkpoint,
    init_factors_from,
    load_checkpoint,
    read_checkpoint,
)
from kfac_hpc.checkpoint.training_state import (
    SCHEMA_VERSION,
    CheckpointError,
    CheckpointMismatchError,
    DataPosition,
    LoadedCheckpoint,
    RestoredState,
    TrainingState,
    capture_training_state,
    check_restorable,
    restore_training_state,
)

__all__ = [
    "SCHEMA_VERSION",
    "AsyncCheckpointWriter",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "DataPosition",
    "LoadedCheckpoint",
    "RestoredState",
    "SkippedCheckpoint",
    "TrainingState",
    "capture_training_state",
    "check_restorable",
    "find_checkpoint",
    "init_factors_from",
    "load_checkpoint",
    "read_checkpoint",
    "restore_training_state",
]
