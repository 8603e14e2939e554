"""One exact, fast check that tensors hold no inf or NaN (factor statistics, gradients,
decompositions, parameters)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["all_finite"]


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite. A finite sum proves it (an inf or NaN
    element makes the sum inf or NaN), so one summing pass per tensor, about ten times cheaper
    than a max-norm on CPUs, settles the usual case; only a non-finite sum (a non-finite
    element, or a sum of finite ones that overflowed) is decided by the exact max-norm."""
    if not tensors:
        return True
    sums = [t.detach().sum(dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]
    finite = torch.isfinite(torch.stack(sums))
    if bool(finite.all()):
        return True
    suspects = [t for t, ok in zip(tensors, finite.tolist(), strict=True) if not ok]
    return all(
        bool(torch.isfinite(torch.linalg.vector_norm(t.detach(), float("inf")))) for t in suspects
    )
