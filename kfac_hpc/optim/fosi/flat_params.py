"""One flat buffer for the parameters, each parameter a view of its piece.

FOSI works on the parameters laid end to end (sharding.py). Instead of copying them into a
flat vector and back at every step, the buffer ``values`` holds them and every parameter's
``.data`` is re-pointed to its piece (``p.data = values[a:b].view_as(p)``): the Parameter
objects stay the same (the model, ``model.load_state_dict``, hooks and user references keep
working), and an update written into the buffer is the parameters' new values.

Gradients are not kept in a buffer of their own: after ``zero_grad(set_to_none=True)`` (the
job's, and torch's default) the backward pass allocates new gradients anyway, so
:meth:`FlatParameters.gradients` concatenates them once per step, and a persistent buffer would
only add n numbers to the peak of the backward pass.
"""

from __future__ import annotations

import torch

__all__ = ["FlatParameters"]


class FlatParameters:
    """``params`` (one dtype and device) as views of one flat buffer ``values`` ``(n,)``."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        ref = params[0]
        n = sum(self.sizes)
        self.values = torch.empty(n, dtype=ref.dtype, device=ref.device)
        self._value_views = [v.view_as(p) for v, p in zip(self.values.split(self.sizes), params,
                                                          strict=True)]  # fmt: skip
        self._value_ptrs = [v.data_ptr() for v in self._value_views]
        self.adopt()

    def adopt(self) -> None:
        """Copy the parameters' current values into the buffer and point them at it."""
        with torch.no_grad():  # a copy first: some parameters may view the buffer already
            self.values.copy_(torch.cat([p.detach().reshape(-1) for p in self.params]))
        for p, view in zip(self.params, self._value_views, strict=True):
            p.data = view

    def check(self) -> None:
        """Re-adopt the parameters when some ``.data`` was replaced (``module.to``, an
        assignment to ``p.data``): their values are kept."""
        if [p.data_ptr() for p in self.params] != self._value_ptrs:
            self.adopt()

    def gradients(self) -> torch.Tensor:
        """The gradients laid end to end, ``(n,)`` (a new tensor; a missing one as zeros)."""
        return torch.cat(
            [torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1)
             for p in self.params]
        )  # fmt: skip
