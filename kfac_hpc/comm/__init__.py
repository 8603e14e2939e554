"""Communication of the distributed K-FAC: bucketed factor reduction, broadcasts, and the KAISA
work plan (who computes which second-order data, who preconditions which gradient, and the
process groups for that)."""

from kfac_hpc.comm.assignment import (
    AssignmentStrategy,
    DistributionStrategy,
    KAISAAssignment,
    KAISAGroups,
    LayerPlan,
    lpt_schedule,
    parse_grad_worker_fraction,
    valid_grad_worker_fractions,
)
from kfac_hpc.comm.collectives import AsyncBroadcaster, FactorAllreducer, any_rank, group_size

__all__ = [
    "AssignmentStrategy",
    "AsyncBroadcaster",
    "DistributionStrategy",
    "FactorAllreducer",
    "KAISAAssignment",
    "KAISAGroups",
    "LayerPlan",
    "any_rank",
    "group_size",
    "lpt_schedule",
    "parse_grad_worker_fraction",
    "valid_grad_worker_fractions",
]
