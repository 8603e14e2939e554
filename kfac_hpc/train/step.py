"""One training step of the job, and one evaluation pass.

A step: data -> forward -> backward -> gradient allreduce -> learning rate -> the method's
update. Decisions every rank must share (stop for the time limit or a preemption signal,
checkpoint by the clock) ride on the gradient allreduce as flags. A method that reduces the
gradients itself (``reduces_gradients``) gets each rank's own; only the flags are summed then.

The loss is the cross-entropy of class logits (N, C), or of sequence logits (N, T, C) against
next-token labels (N, T), flattened to N·T rows (the mean over every token). Forward and loss
run under the job's :class:`~kfac_hpc.train.precision.Precision` (autocast, loss scaling).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.optim.fosi.curvature_batch import leading_rows
from kfac_hpc.train.data import ShardedBatches
from kfac_hpc.train.grad_sync import GradientAllreduce
from kfac_hpc.train.methods import CurvatureLoss, Method
from kfac_hpc.train.precision import Precision
from kfac_hpc.train.timing import PhaseTimer

__all__ = ["EVAL_BATCH", "TrainStep", "evaluate"]

EVAL_BATCH = 512


class TrainStep:
    """The step of one job: its model, data, gradient allreduce and method."""

    def __init__(
        self,
        model: nn.Module,
        batches: ShardedBatches,
        device: torch.device,
        method: Method,
        world_size: int,
        precision: Precision | None = None,
    ) -> None:
        """``world_size``: every rank; the step's collectives run over the method's training
        ranks (all but its ``curvature_ranks``)."""
        self.model = model
        self.batches = batches
        self.device = device
        self.method = method
        trainers = world_size - method.curvature_ranks
        self.grad_sync = GradientAllreduce(model, trainers, method.training_group)
        self.precision = precision or Precision("fp32", device)
        self.loss_fn = batches.source.loss

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            return self.loss_fn(self.model(x), y)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels) of optimizer step ``step``, on the device."""
        epoch, index = divmod(step, self.batches.steps_per_epoch)
        x, y = self.batches.batch(epoch, index)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def curvature_loss(self, x: torch.Tensor, y: torch.Tensor) -> CurvatureLoss:
        """The loss of the batch ``(x, y)`` (or of its leading rows), for curvature work."""
        return lambda fraction=1.0: self._loss(*leading_rows(fraction, x, y))

    def __call__(
        self, step: int, lr: float, flags: list[float], timer: PhaseTimer
    ) -> tuple[torch.Tensor, list[float]]:
        """Optimizer step ``step`` at learning rate ``lr``; returns (loss, the flags summed over
        the training ranks)."""
        x, y = self.batch(step)
        timer.lap("data")
        loss = self._loss(x, y)
        timer.lap("forward")
        optimizer = self.method.optimizer
        optimizer.zero_grad(set_to_none=True)
        self.precision.backward(loss)
        timer.lap("backward")
        flags = self.grad_sync(flags, gradients=not self.method.reduces_gradients)
        self.precision.unscale(optimizer)
        timer.lap("grad_allreduce")
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.method.step(timer, self.curvature_loss(x, y))
        self.precision.update()
        return loss, flags


def evaluate(
    model: nn.Module,
    batches: ShardedBatches,
    device: torch.device,
    world_size: int,
    precision: Precision | None = None,
    group: Any = None,
) -> tuple[float, float]:
    """(mean loss, accuracy) over every rank's share of the test set, per target position
    (a sample's class, or each token of a sequence; each output of a regression, whose
    accuracy is 0); the loss is the workload's. Collective over the ``world_size`` ranks of
    ``group`` (None: the world), which share the test set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    loss_fn = batches.source.loss
    precision = precision or Precision("fp32", device)
    with torch.no_grad():
        for idx in batches.test_batches(EVAL_BATCH, world_size):
            x, y = batches.source.test(idx)
            x, y = x.to(device), y.to(device)
            with precision.autocast():
                logits = model(x)
            totals[0] += loss_fn(logits.float(), y).double() * y.numel()
            if not y.is_floating_point():  # a regression (reconstruction) has no accuracy
                totals[1] += (logits.argmax(-1) == y).sum()
            totals[2] += y.numel()
    model.train()
    if world_size > 1:
        dist.all_reduce(totals, group=group)
    loss, correct, count = totals.tolist()
    return loss / max(count, 1.0), correct / max(count, 1.0)
