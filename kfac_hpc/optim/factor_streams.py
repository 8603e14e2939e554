"""The per-step reduction of the factor statistics, as two ordered streams: every layer's A
(submitted from its forward hook) and every layer's G (from its output-gradient hook).

Each stream has its own reducer on its own process group and submits layers in one fixed order
(A: registration order, the usual order of forward; G: its reverse, the order of backward),
never in hook order: a layer whose hook has fired waits for the layers before it in that order
(until :meth:`FactorStreams.submit_rest` in ``step()`` at the latest). The bucket layout and the
order of collectives in each group are then a function of the registered layers only, the
same on every rank, even when a layer's hook fires on some ranks only; two groups let the A
stream run ahead of the G stream on one rank and behind it on another.

A statistic reduced to one rank only (its owner under MEM-OPT/HYBRID-OPT) is dropped on the
other ranks as soon as it is submitted, so a rank ends the step holding only what it owns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from kfac_hpc.comm import FactorAllreducer
from kfac_hpc.optim.layer_state import FACTORS, LayerState

__all__ = ["OWNER_BUCKET_CAP_MB", "FactorStreams"]

# Buckets reduced to one owner stay small: they are launched (and their statistics released on
# the other ranks) while the forward and backward passes go on, instead of piling up.
OWNER_BUCKET_CAP_MB = 1.0


class _Stream:
    """One factor kind's layers in their fixed order, submitted as they become ready."""

    def __init__(
        self,
        key: str,
        order: list[LayerState],
        reducer: FactorAllreducer,
        rank: int,
        dtype: torch.dtype | None,
    ) -> None:
        self.key = key
        self.dtype = dtype  # of the factors (None: the layer's weight dtype)
        self.order = order
        self.reducer = reducer
        self.rank = rank
        self.cursor = 0
        self.ready: set[str] = set()
        self.fired: set[str] = set()  # layers that carried this rank's real statistics

    def mark_ready(self, state: LayerState) -> None:
        self.ready.add(state.name)
        while self.cursor < len(self.order) and self.order[self.cursor].name in self.ready:
            state = self.order[self.cursor]
            self.fired.add(state.name)
            self._submit(state)
            self.cursor += 1

    def submit_rest(self, accumulation_steps: int) -> None:
        """Submit every layer not yet submitted; one without statistics travels as zeros."""
        for state in self.order[self.cursor :]:
            factors = state.factors
            if factors.pending(self.key) is not None:
                self.fired.add(state.name)
            else:
                layer = state.layer
                shape = layer.factor_shapes[FACTORS.index(self.key)]
                dtype = self.dtype or layer.weight.dtype
                zeros = torch.zeros(shape, dtype=dtype, device=layer.weight.device)
                factors.set_pending(self.key, zeros, accumulation_steps)
            self._submit(state)
        self.cursor = len(self.order)

    def flags(self, device: torch.device) -> Tensor:
        """1.0 for every layer (in order) whose statistics this rank contributed."""
        return torch.tensor(
            [float(s.name in self.fired) for s in self.order], dtype=torch.float64, device=device
        )

    def _submit(self, state: LayerState) -> None:
        tensor = state.factors.pending(self.key)
        assert tensor is not None
        dst = state.reduce_dst(self.key)
        self.reducer.submit(f"{state.name}/{self.key}", tensor, dst=dst)
        state.submitted.add(self.key)
        if dst is not None and dst != self.rank:
            state.factors.drop_pending(self.key)  # the reducer holds what still travels

    def reset(self) -> None:
        self.cursor = 0
        self.ready.clear()
        self.fired.clear()


class FactorStreams:
    """The A and G streams of one preconditioner, plus the count of ranks behind each layer."""

    def __init__(
        self,
        states: list[LayerState],
        bucket_cap_mb: float,
        symmetric: bool,
        world_size: int,
        rank: int,
        dtype: torch.dtype | None,
    ) -> None:
        owner_cap = min(bucket_cap_mb, OWNER_BUCKET_CAP_MB)
        # G (and the counts) on the default group; A on a group of its own (see the docstring).
        a_group = dist.new_group(list(range(world_size))) if world_size > 1 else None
        self.reducer_a = FactorAllreducer(bucket_cap_mb, a_group, symmetric, owner_cap)
        self.reducer = FactorAllreducer(bucket_cap_mb, None, symmetric, owner_cap)
        self.world_size = world_size
        self.states = states
        self.a = _Stream("A", states, self.reducer_a, rank, dtype)
        self.g = _Stream("G", list(reversed(states)), self.reducer, rank, dtype)
        self._counts = torch.zeros(0, dtype=torch.float64)

    @property
    def buckets_in_flight(self) -> int:
        """Buckets of both streams launched and not yet waited for."""
        return self.reducer_a.buckets_in_flight + self.reducer.buckets_in_flight

    def submit_rest(self, accumulation_steps: int) -> None:
        """Submit every layer not yet submitted in both streams, then the per-layer counts
        of ranks that contributed A and G (one small allreduce)."""
        self.a.submit_rest(accumulation_steps)
        self.g.submit_rest(accumulation_steps)
        device = self.states[0].layer.weight.device if self.states else torch.device("cpu")
        self._counts = torch.stack([self.a.flags(device), self.g.flags(device)])
        self.reducer.submit("__ranks_with_layer__", self._counts, symmetric=False)

    def wait(self) -> list[LayerState]:
        """Wait for both streams; rescale a layer seen by k of P ranks from sum/P to sum/k.
        Returns the layers to commit: a layer some stream got from no rank is dropped."""
        self.reducer_a.wait()
        self.reducer.wait()
        counts = (self._counts * self.world_size).round().tolist()
        live: list[LayerState] = []
        for state, count_a, count_g in zip(self.states, counts[0], counts[1][::-1], strict=True):
            if count_a == 0 or count_g == 0:
                state.factors.clear_pending()
                continue
            live.append(state)
            for key, count in (("A", count_a), ("G", count_g)):
                pending = state.factors.pending(key)
                if pending is not None and count < self.world_size:
                    pending.mul_(self.world_size / count)
        self.a.reset()
        self.g.reset()
        return live
