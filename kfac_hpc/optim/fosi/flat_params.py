"""One flat buffer for the parameters and one for their gradients, the parameters viewing it.

FOSI works on the parameters laid end to end (sharding.py). Instead of copying them into a
flat vector and back at every step, the buffer ``values`` holds them and every parameter's
``.data`` is re-pointed to its piece (``p.data = values[a:b].view_as(p)``): the Parameter
objects stay the same (the model, ``model.load_state_dict``, hooks and user references keep
working), and an update written into the buffer is the parameters' new values.

Gradients arrive wherever autograd puts them (``zero_grad(set_to_none=True)`` lets the next
backward pass allocate new tensors): :meth:`FlatParameters.gradients` copies them into the
buffer ``grads`` (a missing one as zeros) and re-points ``p.grad`` to its piece, so that a
backward pass that accumulates into existing gradients writes the buffer directly, and a step
whose gradients are all still views copies nothing.
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
        self.grads = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        self._value_views = [v.view_as(p) for v, p in zip(self.values.split(self.sizes), params,
                                                          strict=True)]  # fmt: skip
        self._grad_views = [g.view_as(p) for g, p in zip(self.grads.split(self.sizes), params,
                                                         strict=True)]  # fmt: skip
        self._value_ptrs = [v.data_ptr() for v in self._value_views]
        self._grad_ptrs: list[int | None] = [g.data_ptr() for g in self._grad_views]
        self._grad_ptr_set = set(self._grad_ptrs)
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
        """The gradients in the flat buffer ``grads`` (``(n,)``, a missing one as zeros), the
        parameters' ``.grad`` pointed at it."""
        grads = [p.grad for p in self.params]
        ptrs = [None if g is None else g.data_ptr() for g in grads]
        if ptrs == self._grad_ptrs:
            return self.grads
        with torch.no_grad():
            if any(p is None or p in self._grad_ptr_set for p in ptrs):
                for g, view in zip(grads, self._grad_views, strict=True):
                    if g is None:
                        view.zero_()
                    elif g.data_ptr() != view.data_ptr():
                        view.copy_(g)
            else:  # all new tensors (zero_grad(set_to_none=True)): one pass
                torch.cat([g.reshape(-1) for g in grads if g is not None], out=self.grads)
        for p, view in zip(self.params, self._grad_views, strict=True):
            p.grad = view
        return self.grads
