"""SGD (or Adam/AdamW) + K-FAC: the preconditioner rewrites ``.grad``, then the optimizer steps."""

from __future__ import annotations

from typing import Any

from torch import nn

from kfac_hpc.contracts.method_state import Checkpointable
from kfac_hpc.optim import PHASES as KFAC_PHASES
from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.train.methods.base import CurvatureLoss, Method, MethodSetup
from kfac_hpc.train.methods.registry import register
from kfac_hpc.train.optimizers import make_optimizer
from kfac_hpc.train.timing import PhaseTimer

__all__ = ["KFACMethod"]


class KFACMethod(Method):
    """The distributed K-FAC preconditioner before the first-order optimizer's step."""

    name = "kfac"
    phases = (*KFAC_PHASES, "optimizer")

    def __init__(self, setup: MethodSetup) -> None:
        optimizer = make_optimizer(setup.config, setup.model)
        super().__init__(optimizer, setup.grad_scaler)

        def current_lr(_step: int) -> float:  # the KL clip uses the job's learning rate
            return float(optimizer.param_groups[0]["lr"])

        self.preconditioner = KFACPreconditioner(
            setup.model,
            lr=current_lr,
            synchronize_timings=setup.config.cuda_sync,
            grad_scaler=setup.grad_scaler,
            **setup.config.kfac_options(),
        )
        self._skipped = _unpreconditioned(setup.model, set(self.preconditioner.layers))
        self._fraction = setup.config.grad_worker_fraction
        self._share = setup.config.grad_worker_share(setup.world_size)

    def step(self, timer: PhaseTimer, curvature_loss: CurvatureLoss) -> None:
        self.preconditioner.step()
        timer.add(self.preconditioner.last_timings)
        timer.skip()  # already charged to the K-FAC phases
        self.optimizer_step()
        timer.lap("optimizer")

    @property
    def state(self) -> Checkpointable:
        return self.preconditioner

    @property
    def strategy(self) -> str:
        return self._fraction

    def run_facts(self) -> dict[str, Any]:
        return {
            "kfac": True,
            "grad_worker_fraction": self._share,
            "kfac_skipped_modules": self._skipped,
        }


def _unpreconditioned(model: nn.Module, registered: set[str]) -> dict[str, str]:
    """Module name -> class of every module with trainable parameters of its own that K-FAC
    leaves to the first-order optimizer (embeddings, normalization layers, ``--skip-layers``)."""
    return {
        name or type(module).__name__: type(module).__name__
        for name, module in model.named_modules()
        if (name or type(module).__name__) not in registered
        and any(p.requires_grad for p in module.parameters(recurse=False))
    }


register(KFACMethod.name, KFACMethod)
