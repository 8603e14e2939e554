"""BatchNorm running statistics recomputed at the current parameters, for a test evaluation.

A BatchNorm layer's running mean and variance are an exponential average over the last
~1/momentum training batches, each taken at the parameters of its own step. When the parameters
move fast (large steps, a second-order method's Newton step in a high-curvature subspace) the
average trails the network: an evaluation in eval mode then tests a network whose
normalization does not match its weights, and reports a loss well above the training loss.
:func:`recomputed_batchnorm` replaces the running statistics, for the duration of a ``with``
block, by the plain average over a few batches at the current parameters (no gradient, no
parameter change), and puts the training statistics back on exit, so training continues exactly
as it would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["batchnorm_layers", "recomputed_batchnorm"]


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm layers that keep running statistics."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


@contextmanager
def recomputed_batchnorm(
    model: nn.Module,
    inputs: Iterable[torch.Tensor],
    forward: Callable[[torch.Tensor], Any] | None = None,
) -> Iterator[int]:
    """Inside the block, every BatchNorm layer's running mean and variance are the average over
    the batches of ``inputs`` (one train-mode ``forward(x)`` each, default ``model(x)``, without
    gradients) of that batch's mean and unbiased variance; on exit the previous statistics,
    batch counts and momenta return, and the model its previous train/eval mode. Yields how
    many batches were used (0 when the model has no BatchNorm layer: nothing is run or
    changed). ``ValueError`` when ``inputs`` is empty and there is a layer to recompute."""
    layers = batchnorm_layers(model)
    if not layers:
        yield 0
        return
    saved = [
        (m.momentum, {name: buffer.clone() for name, buffer in m.named_buffers(recurse=False)})
        for m in layers
    ]
    was_training = model.training
    used = 0
    try:
        for m in layers:
            m.reset_running_stats()
            m.momentum = None  # a cumulative (plain) average over the batches
        model.train()
        with torch.no_grad():
            for x in inputs:
                (forward or model)(x)
                used += 1
        if used == 0:
            raise ValueError("recomputed_batchnorm: inputs gave no batch; pass at least one")
        yield used
    finally:
        for m, (momentum, buffers) in zip(layers, saved, strict=True):
            m.momentum = momentum
            for name, value in buffers.items():
                getattr(m, name).copy_(value)
        model.train(was_training)
