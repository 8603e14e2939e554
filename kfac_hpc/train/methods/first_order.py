"""First-order only: the job's optimizer (SGD, Adam, AdamW) on the averaged gradients."""

from __future__ import annotations

from typing import Any

from kfac_hpc.train.methods.base import CurvatureLoss, Method, MethodSetup
from kfac_hpc.train.methods.registry import register
from kfac_hpc.train.optimizers import make_optimizer
from kfac_hpc.train.timing import PhaseTimer

__all__ = ["FirstOrder"]


class FirstOrder(Method):
    """``optimizer.step()``, timed as the ``optimizer`` phase."""

    name = "first_order"
    phases = ("optimizer",)

    def __init__(self, setup: MethodSetup) -> None:
        super().__init__(make_optimizer(setup.config, setup.model), setup.grad_scaler)

    def step(self, timer: PhaseTimer, curvature_loss: CurvatureLoss) -> None:
        self.optimizer_step()
        timer.lap("optimizer")

    def run_facts(self) -> dict[str, Any]:
        return {"kfac": False, "grad_worker_fraction": 1.0}


register(FirstOrder.name, FirstOrder)
