"""Per-rank second-order work of a K-FAC configuration, written out from the assignment (the
oracle the cost model's mean-over-ranks phases are checked against)."""

from __future__ import annotations

from kfac_hpc.plan.model import CostModel, PlanConfig, kfac_assignment


def rank_work(model: CostModel, cfg: PlanConfig) -> tuple[list[float], list[float]]:
    """(eigendecomposition seconds, preconditioning seconds) of each rank, uncontended: a
    layer's A on its A worker, its G on its G worker (each factor's own eigh time × groups),
    and every layer of a row on each rank of that row."""
    assignment = kfac_assignment(model.shape, cfg)
    eigh, precondition = [0.0] * cfg.ranks, [0.0] * cfg.ranks
    for n, layer in enumerate(model.shape.layers):
        plan = assignment.plan(f"{n}")
        eigh[plan.a_worker] += model.compute.eigh_s(layer.n_a) * layer.groups
        eigh[plan.g_worker] += model.compute.eigh_s(layer.n_g) * layer.groups
        for rank in plan.grad_workers:
            precondition[rank] += model.compute.precondition_s(layer)
    return eigh, precondition


def spread(work: list[float]) -> float:
    """The busiest rank's lead over the mean."""
    return max(work) - sum(work) / len(work)
