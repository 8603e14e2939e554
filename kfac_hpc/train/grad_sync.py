"""Data-parallel gradient averaging, with the job's stop flags riding along for free.

All gradients are flattened into one buffer with a few extra float slots for flags that every
rank must agree on (time limit reached, checkpoint due by the clock, preemption signal
received); one allreduce sums the lot, so agreeing on such a decision costs no extra
collective. For a method that reduces the gradients itself (FOSI: a reduce-scatter), only the
flags are summed. ``group``: the ranks that train (a method's curvature ranks take no step,
so they are in none of the step's collectives); the world by default.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientAllreduce"]


class GradientAllreduce:
    """Average ``.grad`` of every parameter over ranks and sum a few flags."""

    def __init__(self, model: nn.Module, world_size: int, group: Any = None) -> None:
        """``world_size``: the ranks of ``group`` (None: the world)."""
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world_size = world_size
        self.group = group

    def __call__(self, flags: list[float], gradients: bool = True) -> list[float]:
        """Average gradients in place (``gradients=False``: leave each rank's own, the method
        reduces them); return the flags summed over ranks."""
        if self.world_size == 1:
            return flags
        device = self.params[0].device
        if not gradients:
            summed = torch.tensor(flags, dtype=torch.float64, device=device)
            if flags:
                dist.all_reduce(summed, group=self.group)
            return summed.tolist()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        extra = torch.tensor(flags, dtype=grads[0].dtype, device=device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [extra])
        dist.all_reduce(flat, group=self.group)
        summed_flags = flat[-len(flags) :].tolist() if flags else []
        flat.div_(self.world_size)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            n = g.numel()
            if p.grad is None:
                p.grad = flat[offset : offset + n].view_as(p).clone()
            else:
                p.grad.copy_(flat[offset : offset + n].view_as(g))
            offset += n
        return summed_flags
