"""The base optimizer (SGD, Adam, ...) run on this rank's coordinates only (ZeRO-1).

The user's base optimizer names the class, the parameter groups and their hyperparameters; it
is never stepped itself and holds no state. A copy of its class runs on one flat 1-D tensor per
parameter group holding this rank's coordinates of that group (possibly none), so its state
(momentum buffers, Adam moments) exists only for the slice. Those tensors are views of the
rank's coordinates of FOSI's flat parameter buffer (flat_params.py): a step updates them in
place, with no copy in or out. Hyperparameters are copied from the
user's groups before every step, so learning-rate schedulers attached to the base keep working.

With one rank the flat tensors hold whole groups and the element-wise base updates are the
same floating-point operations as on the original parameters, so the result is bit for bit that
of the base optimizer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from kfac_hpc.optim.fosi.sharding import CoordinateShard

__all__ = ["ADAPTIVE_BASES", "ShardedBase", "weight_decay_vector"]

# Bases whose update is normalised per coordinate: FOSI does not rescale their update (c = 1).
ADAPTIVE_BASES: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
)


def weight_decay_vector(
    base: torch.optim.Optimizer, group_bounds: list[tuple[int, int]], shard: CoordinateShard
) -> torch.Tensor:
    """Per coordinate of ``shard``, the weight decay of its parameter group, float64
    ``(n_r,)``: the ESE adds it to the Hessian, the step to the gradient it splits."""
    out = torch.zeros(shard.size, dtype=torch.float64)
    for (a, b), group in zip(group_bounds, base.param_groups, strict=True):
        lo, hi = max(a, shard.start), min(b, shard.stop)
        if hi > lo:
            out[lo - shard.start : hi - shard.start] = float(group.get("weight_decay", 0.0))
    return out


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


class ShardedBase:
    """``base``'s class on this rank's slices of the flat parameter vector.

    ``group_bounds``: ``[a, b)`` of every parameter group in flat coordinates; ``values``: this
    rank's coordinates ``(n_r,)``, which :meth:`step` updates in place.
    """

    def __init__(
        self,
        base: torch.optim.Optimizer,
        shard: CoordinateShard,
        group_bounds: list[tuple[int, int]],
        values: torch.Tensor,
    ) -> None:
        self.base = base
        self.shard = shard
        self.group_bounds = group_bounds
        # [a, b) of each group's piece in this rank's local coordinates (empty when disjoint)
        self.pieces = [
            (
                max(a, shard.start) - shard.start,
                max(min(b, shard.stop), max(a, shard.start)) - shard.start,
            )
            for a, b in group_bounds
        ]
        self.values = values
        self.slices = []
        for a, b in self.pieces:
            leaf = torch.empty(0, dtype=values.dtype, device=values.device, requires_grad=True)
            leaf.data = values[a:b]
            self.slices.append(leaf)
        self._decay: tuple[tuple[float, ...], torch.dtype, torch.Tensor] | None = None
        groups = [
            {**_hyper(g), "params": [x]}
            for g, x in zip(base.param_groups, self.slices, strict=True)
        ]
        optimizer_class: Any = type(base)  # SGD, Adam, ...: each takes (groups, **defaults)
        self.optimizer: torch.optim.Optimizer = optimizer_class(groups)

    @property
    def adaptive(self) -> bool:
        return isinstance(self.base, ADAPTIVE_BASES)

    def effective_step(self) -> float:
        """The largest steady-state step size of the base over its groups: lr(1 − dampening)/
        (1 − momentum) for the SGD family (a heavy ball's velocity sums a constant gradient to
        1/(1 − momentum) times it); infinite for a momentum of 1 or more."""
        steps = []
        for group in self.base.param_groups:
            momentum = float(group.get("momentum", 0.0))
            lr = float(group["lr"]) * (1.0 - float(group.get("dampening", 0.0)))
            steps.append(lr / (1.0 - momentum) if momentum < 1.0 else math.inf)
        return max(steps)

    def weight_decay(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Per local coordinate, the weight decay of its group, ``(n_r,)`` of ``dtype``; None
        when every group's is 0. Rebuilt only when a group's weight decay changed."""
        decays = tuple(float(g.get("weight_decay", 0.0)) for g in self.base.param_groups)
        if self._decay is None or self._decay[:2] != (decays, dtype):
            vector = weight_decay_vector(self.base, self.group_bounds, self.shard).to(dtype)
            self._decay = (decays, dtype, vector)
        return self._decay[2] if any(decays) else None

    def step(self, grad: torch.Tensor) -> None:
        """The base optimizer's update of this rank's coordinates (``values``, in place) given
        the gradient ``grad`` (``(n_r,)``) it should see; its state advances."""
        for (a, b), x, mine, user in zip(
            self.pieces, self.slices, self.optimizer.param_groups, self.base.param_groups,
            strict=True,
        ):  # fmt: skip
            mine.update(_hyper(user))
            x.grad = grad[a:b]  # a view: torch optimizers do not write into gradients
        self.optimizer.step()

    def state_bytes(self) -> int:
        """Bytes of the base optimizer state on this rank."""
        return sum(
            v.element_size() * v.numel()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def _is_coordinate_state(self, index: int, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.shape == self.slices[index].shape
            and (value.dim() == 1)
        )

    def full_state(self) -> dict[str, Any]:
        """The state with every per-coordinate tensor gathered whole (collective): ``state``
        ``{group index: {name: (n_g,) tensor or scalar}}`` and ``param_groups``."""
        local = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for index in range(len(self.slices)):
            entry = local["state"].get(index, {})
            names = sorted(entry)
            state[index] = {}
            for name in names:
                value = entry[name]
                if self._is_coordinate_state(index, value):
                    value = self._gather_group(index, value)
                state[index][name] = value
        return {"state": state, "param_groups": [_hyper(g) for g in local["param_groups"]]}

    def _gather_group(self, index: int, piece: torch.Tensor) -> torch.Tensor:
        if self.shard.world == 1:
            return piece.clone()
        a, b = self.group_bounds[index]
        sizes = []
        for r in range(self.shard.world):
            other = CoordinateShard(self.shard.n, self.shard.world, r)
            sizes.append(max(0, min(b, other.stop) - max(a, other.start)))
        width = max(sizes)
        padded = torch.nn.functional.pad(piece.detach(), (0, width - piece.numel())).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.shard.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])

    def load_full_state(self, full: dict[str, Any]) -> None:
        """Take this rank's slices of a :meth:`full_state` saved at any world size; the
        hyperparameters go into the user's base groups too."""
        state: dict[int, dict[str, Any]] = {}
        for index, entry in full["state"].items():
            a, b = self.group_bounds[int(index)]
            lo, hi = self.pieces[int(index)]
            start = self.shard.start + lo - a
            state[int(index)] = {
                name: (
                    value[start : start + hi - lo].clone()
                    if isinstance(value, torch.Tensor)
                    and value.dim() == 1
                    and value.numel() == b - a
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                )
                for name, value in entry.items()
            }
        groups = [{**g, "params": [i]} for i, g in enumerate(full["param_groups"])]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for user, loaded in zip(self.base.param_groups, full["param_groups"], strict=True):
            user.update(loaded)
