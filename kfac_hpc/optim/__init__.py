"""The methods' optimizers: the K-FAC preconditioner (layers, factors, second-order data,
schedules, orchestration) and FOSI / DHO2 (optim/fosi/)."""

from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.optim.options import AssignmentStrategy, ComputeMethod, KFACApprox, KFACOptions
from kfac_hpc.optim.preconditioner import PHASES, KFACPreconditioner
from kfac_hpc.optim.schedules import MultiStepSchedule, ScheduledValue

__all__ = [
    "FOSI",
    "PHASES",
    "AssignmentStrategy",
    "ComputeMethod",
    "KFACApprox",
    "KFACOptions",
    "KFACPreconditioner",
    "MultiStepSchedule",
    "ScheduledValue",
]
