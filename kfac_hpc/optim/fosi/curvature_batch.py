"""The sub-sampled curvature batch of an ESE: the leading rows of the step's batch.

With ``curvature_fraction`` f < 1, FOSI calls its closure as ``closure(f)``; the closure returns
the mean loss over :func:`leading_rows` of its batch (the first ⌈f·N⌉ samples, at least one).
The batch is already a random draw, so its leading rows are an unbiased, deterministic subset:
every rank and every product of one ESE differentiate the same samples.
"""

from __future__ import annotations

import math

import torch

__all__ = ["leading_rows", "subset_size"]


def subset_size(rows: int, fraction: float) -> int:
    """⌈fraction · rows⌉, at least 1 (``fraction`` in (0, 1])."""
    return max(1, math.ceil(fraction * rows - 1e-9))


def leading_rows(fraction: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first :func:`subset_size` rows of each tensor (one batch: the same rows of its
    inputs and labels); the tensors themselves when ``fraction`` is 1."""
    if fraction >= 1.0:
        return tensors
    keep = subset_size(len(tensors[0]), fraction)
    return tuple(t[:keep] for t in tensors)
