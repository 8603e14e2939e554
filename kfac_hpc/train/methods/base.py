"""The interface the job runs a training method through (docs/train.md, "Writing a method").

A method turns the gradients of a step (already averaged over ranks, in ``.grad``, unless
the method reduces them itself: ``reduces_gradients``) into a parameter update. The job owns
everything else: data, forward, backward, the gradient allreduce, the learning rate (set on
``method.optimizer`` before every step), evaluation, checkpoints, records and preemption. A
method declares the timing phases its step charges, its own state for the checkpoint (plain
trees, :class:`~kfac_hpc.contracts.method_state.Checkpointable`) and what it adds to ``run.json``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from kfac_hpc.contracts.method_state import Checkpointable
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.timing import PhaseTimer

__all__ = ["CurvatureLoss", "Method", "MethodSetup", "TrainingDiverged"]

# The loss of the current step's batch, recomputed with a fresh autograd graph (no backward
# run): for methods that need curvature (Hessian-vector products) on some steps. Called with a
# fraction f in (0, 1], it is the loss of the batch's leading ⌈f·N⌉ rows (FOSI's
# curvature_fraction, optim/fosi/curvature_batch.py).
CurvatureLoss = Callable[..., torch.Tensor]


class TrainingDiverged(ArithmeticError):
    """The loss, the parameters or a method's curvature became non-finite: the run stops, that
    state unsaved, and ends ``error`` with this message (no traceback: the user's settings, not
    a bug). A method's ``step`` raises it for what only the method sees."""


@dataclass(frozen=True)
class MethodSetup:
    """What a method factory gets: the resolved config, the model (on its device, not wrapped),
    the world size, and the loss scaler of ``--precision fp16`` (None otherwise)."""

    config: TrainConfig
    model: nn.Module
    world_size: int
    grad_scaler: torch.amp.GradScaler | None = None


class Method(ABC):
    """One training method of the job. Subclasses set ``name`` and ``phases``."""

    name: ClassVar[str]
    # The phases the step charges time to, by docs/contracts.md's names or new ones (a new one
    # is recorded in metrics.jsonl and run.json like the others).
    phases: ClassVar[tuple[str, ...]]

    def __init__(
        self, optimizer: torch.optim.Optimizer, grad_scaler: torch.amp.GradScaler | None = None
    ) -> None:
        # The first-order optimizer: the job sets its learning rate before every step and
        # checkpoints its state_dict().
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler

    def optimizer_step(self) -> None:
        """``optimizer.step()``; under loss scaling the scaler's, which skips a step whose
        gradients (already unscaled by the job) hold an inf or NaN."""
        if self.grad_scaler is None:
            self.optimizer.step()
        else:
            self.grad_scaler.step(self.optimizer)

    @abstractmethod
    def step(self, timer: PhaseTimer, curvature_loss: CurvatureLoss) -> None:
        """Update the parameters from ``.grad``; charge time with ``timer.lap(phase)`` (the
        clock runs from the end of the gradient allreduce). Collective where the method is."""

    @property
    def state(self) -> Checkpointable | None:
        """The method's own state for the checkpoint beyond the optimizer's (None: none)."""
        return None

    @property
    def checkpointed_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose ``state_dict()`` the job checkpoints as state shared by every
        rank; None when ``state`` holds it (a sharded optimizer that re-shards itself)."""
        return self.optimizer

    @property
    def reduces_gradients(self) -> bool:
        """True when ``step`` averages the ranks' gradients itself from each rank's own
        ``.grad`` (FOSI: a reduce-scatter of the coordinates each rank updates); the job then
        skips its gradient allreduce and only sums its flags."""
        return False

    @property
    def curvature_ranks(self) -> int:
        """How many of the world's last ranks take no training step: they serve the curvature
        work the training ranks request (:meth:`curvature_request`, :meth:`serve`); 0: none."""
        return 0

    @property
    def is_curvature_rank(self) -> bool:
        """Whether this rank is one of the :attr:`curvature_ranks`."""
        return False

    @property
    def training_group(self) -> Any:
        """The process group of the training ranks, over which every step's collectives run
        (None: the whole world)."""
        return None

    def curvature_request(self) -> int | None:
        """Training ranks, before a step: the number of the curvature request that the step
        will make of the curvature ranks (its snapshot sent by the step), or None."""
        return None

    def serve(self, step: int, number: int, curvature_loss: CurvatureLoss) -> None:
        """A curvature rank: serve request ``number``, made at step ``step`` (whose batch
        ``curvature_loss`` computes the loss of)."""
        raise NotImplementedError(f"method {self.name} has no curvature ranks")

    def drain_curvature_phases(self) -> dict[str, float]:
        """Training ranks: the seconds of each phase the curvature ranks reported with the
        results received since the last call (the curvature ranks' rows of a timing window)."""
        return {}

    def synchronize(self) -> None:
        """Make every rank's model the training model before a checkpoint, and before an
        evaluation without curvature ranks (with them an evaluation is the training ranks'
        alone); collective, for methods whose ranks may hold other parameters."""
        return None

    @property
    def strategy(self) -> str | None:
        """How the method spreads its work over ranks, recorded in checkpoints (None: n/a)."""
        return None

    def run_facts(self) -> dict[str, Any]:
        """Fields the method adds to ``run.json``."""
        return {}

    def check_checkpoint(self, saved_config: Mapping[str, Any]) -> None:
        """Raise ``CheckpointMismatchError`` (naming the setting) when a checkpoint saved
        under ``saved_config`` (its run's config) cannot be resumed with this run's settings;
        called before anything is loaded."""
        return None

    def resumed(self, saved_config: Mapping[str, Any]) -> None:
        """The checkpoint saved under ``saved_config`` is loaded (every rank): say what of it
        the method re-estimates or drops for this run's settings."""
        return None
