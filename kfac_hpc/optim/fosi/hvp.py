"""Hessian-vector products of a closure's loss with respect to a list of parameters.

Two autodiff routes, same product:

* double backward: the closure runs once, its gradient is built with ``create_graph=True``,
  and every product is one more backward through that graph;
* forward-over-reverse (``torch.func.jvp`` of ``torch.func.grad``): needs the module, whose
  parameters are swapped for the transformed ones with ``torch.func.functional_call``; every
  product runs the closure once (forward + backward with tangents, no graph kept between
  products).

``mode="auto"`` is double backward. Measured side by side on CPU
(``benchmarks/bench_hvp_routes.py``, docs/fosi.md "Hessian-vector products"), it took
0.14–0.69x the seconds of forward-over-reverse per product on the bench MLP, the MNIST-1D CNN
and the transformer, and its ESE peaked no higher; it also works where torch's forward-mode AD
does not (mse_loss's backward, BatchNorm's in-place running-statistic update under
``torch.func``), so no product is lost to a failed first try. Forward-over-reverse is there when
asked for by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["HessianVectorProduct", "HvpMode"]

# The routes are defined once, as the choices of FOSI's ``hvp`` and the job's --fosi-hvp
# (contracts/choices.HVP_MODES); this Literal spells them for type checkers only
# (tests/contracts/test_one_home.py checks they are the same values).
HvpMode = Literal["auto", "forward-over-reverse", "double-backward"]
Closure = Callable[[], torch.Tensor]


class _ClosureModule(nn.Module):
    """Runs the closure as its forward, so that ``functional_call`` swaps the parameters of
    ``model`` (its only submodule) while the closure calls it."""

    def __init__(self, model: nn.Module, closure: Closure) -> None:
        super().__init__()
        self.model = model
        # kept in a tuple: a closure that is itself a module must not become a second,
        # tied submodule (functional_call would then not restore the parameters)
        self._closure = (closure,)

    def forward(self) -> torch.Tensor:
        return self._closure[0]()


class HessianVectorProduct:
    """``H v`` of the loss ``closure()`` (the curvature batch) at the current parameters.

    ``v`` and the result are flat ``(n,)`` tensors in the order of ``params``; a parameter the
    loss does not reach has a zero Hessian row.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        closure: Closure,
        model: nn.Module | None,
        mode: HvpMode,
    ) -> None:
        self.params = list(params)
        self.closure = closure
        self.model = model
        self.mode_used: str = "double-backward" if mode == "auto" else mode
        if self.mode_used == "forward-over-reverse" and model is None:
            raise ValueError("hvp: 'forward-over-reverse' needs model=; pass the module")
        self._grads: tuple[torch.Tensor, ...] | None = None
        self.loss: torch.Tensor | None = None  # the closure's loss (last evaluation)

    def _split(self, v: torch.Tensor) -> list[torch.Tensor]:
        sizes = [p.numel() for p in self.params]
        return [c.view_as(p) for c, p in zip(v.split(sizes), self.params, strict=True)]

    def _flat(self, parts: Sequence[torch.Tensor | None]) -> torch.Tensor:
        return torch.cat(
            [
                (torch.zeros_like(p) if h is None else h).reshape(-1)
                for h, p in zip(parts, self.params, strict=True)
            ]
        )

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        if self.mode_used == "forward-over-reverse":
            return self._forward_over_reverse(v)
        return self._double_backward(v)

    def _forward_over_reverse(self, v: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        wrapper = _ClosureModule(self.model, self.closure)
        by_id = {id(p): name for name, p in self.model.named_parameters()}
        names = [f"model.{by_id[id(p)]}" for p in self.params]

        def loss_of(values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            loss = torch.func.functional_call(wrapper, dict(zip(names, values, strict=True)), ())
            return loss, loss.detach()

        primals = tuple(p.detach() for p in self.params)
        grad_of = torch.func.grad(loss_of, has_aux=True)
        with torch.enable_grad():
            out: Any = torch.func.jvp(grad_of, (primals,), (tuple(self._split(v)),), has_aux=True)
        _, hv, self.loss = out  # (gradient, its directional derivative, aux: the loss)
        return self._flat(hv)

    def _double_backward(self, v: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            if self._grads is None:
                loss = self.closure()
                self.loss = loss.detach()
                grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
                self._grads = tuple(
                    torch.zeros_like(p, requires_grad=True) if g is None else g
                    for g, p in zip(grads, self.params, strict=True)
                )
            hv = torch.autograd.grad(
                self._grads,
                self.params,
                grad_outputs=self._split(v),
                retain_graph=True,
                allow_unused=True,
            )
        return self._flat(hv)
