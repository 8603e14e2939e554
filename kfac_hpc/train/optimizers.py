"""The first-order optimizer of the job and its learning-rate schedule (a function of the step)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kfac_hpc.train.config import TrainConfig

__all__ = ["learning_rate", "make_optimizer"]


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (momentum, L2), Adam (L2) or AdamW (decoupled decay) over the model's parameters."""
    params = list(model.parameters())
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def learning_rate(config: TrainConfig, step: int, steps_per_epoch: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Linear warm-up over ``warmup_epochs`` from lr/warm-up steps to ``lr``; then constant, step
    decay (x ``lr_decay_factor`` at each epoch of ``lr_decay_epochs``), or cosine to 0 at
    ``total_steps``.
    """
    warmup_steps = round(config.warmup_epochs * steps_per_epoch)
    if step < warmup_steps:
        return config.lr * (step + 1) / warmup_steps
    if config.lr_schedule == "step":
        epoch = step // steps_per_epoch
        passed = sum(1 for e in config.lr_decay_epochs if epoch >= e)
        return config.lr * config.lr_decay_factor**passed
    if config.lr_schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * config.lr * (1.0 + math.cos(math.pi * progress))
    return config.lr
