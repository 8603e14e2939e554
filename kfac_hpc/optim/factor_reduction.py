"""The per-step reduction of the factor statistics: each layer's A and G, submitted from its
output-gradient hook in one fixed order, reduced to the ranks that keep them.

Layers are submitted in reverse registration order (the usual order of backward), never in
hook order: a layer whose hook has fired waits for the layers before it in that order (until
:meth:`FactorReduction.submit_rest` in ``step()`` at the latest). The bucket layout and the
order of collectives are then a function of the registered layers only, the same on every
rank, even when a layer's hook fires on some ranks only.

A statistic reduced to one rank (its owner under MEM-OPT/HYBRID-OPT) is dropped on every rank,
the owner included, as soon as it is submitted: only its packed upper triangle travels, the
open owner buckets of all owners together hold at most ``OWNER_BUCKET_CAP_MB``, and on the
owner the reduced triangle stays packed (half the bytes) until ``wait()`` in ``step()``
rebuilds the full matrix, after the backward pass has freed its activations. So while the
backward pass runs a rank holds no full statistics at all, only about a bucket being filled,
the buckets in flight and its own layers' reduced triangles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kfac_hpc.comm import FactorAllreducer
from kfac_hpc.optim.layer_state import FACTORS, LayerState

__all__ = ["OWNER_BUCKET_CAP_MB", "OWNER_IN_FLIGHT_MB", "FactorReduction"]

# Buckets reduced to one owner stay small (all owners' open buckets together): they are launched
# (and their statistics released) while the backward pass goes on, instead of piling up until
# step().
OWNER_BUCKET_CAP_MB = 1.0
# ... and at most this much of them is in flight: with ranks that lag in the collectives (e.g.
# gloo threads sharing few cores) launched buckets would otherwise pile up during backward.
OWNER_IN_FLIGHT_MB = 1.0


class FactorReduction:
    """The layers' statistics in their fixed order, submitted as they become ready, plus the
    count of ranks that contributed each layer."""

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
        self.reducer = FactorAllreducer(
            bucket_cap_mb, None, symmetric, owner_cap, max(OWNER_IN_FLIGHT_MB, owner_cap)
        )
        self.order = list(reversed(states))
        self.world_size = world_size
        self.rank = rank
        self.dtype = dtype  # of the factors (None: each layer's weight dtype)
        self.cursor = 0
        self.ready: set[str] = set()
        self.fired: set[str] = set()  # layers that carried this rank's real statistics
        self._flags = torch.zeros(0, dtype=torch.float64)

    @property
    def buckets_in_flight(self) -> int:
        """Buckets launched and not yet waited for."""
        return self.reducer.buckets_in_flight

    def mark_ready(self, state: LayerState) -> None:
        """``state`` has its statistics of this step: submit it and every ready layer after
        it in the fixed order (full buckets launch at once: overlaps the backward pass)."""
        self.ready.add(state.name)
        while self.cursor < len(self.order) and self.order[self.cursor].name in self.ready:
            self.fired.add(self.order[self.cursor].name)
            self._submit(self.order[self.cursor])
            self.cursor += 1

    def submit_rest(self, accumulation_steps: int) -> None:
        """Submit every layer not yet submitted: one that saw no batch on this rank travels as
        zeros; then the flags of the layers each rank contributed (one small allreduce)."""
        for state in self.order[self.cursor :]:
            factors = state.factors
            if factors.pending_a is not None and factors.pending_g is not None:
                self.fired.add(state.name)
            else:
                layer = state.layer
                dtype = self.dtype or layer.weight.dtype
                for key, shape in zip(FACTORS, layer.factor_shapes, strict=True):
                    zeros = torch.zeros(shape, dtype=dtype, device=layer.weight.device)
                    factors.set_pending(key, zeros, accumulation_steps)
            self._submit(state)
        self.cursor = len(self.order)
        device = self.order[0].layer.weight.device if self.order else torch.device("cpu")
        self._flags = torch.tensor(
            [float(s.name in self.fired) for s in self.order], dtype=torch.float64, device=device
        )
        self.reducer.submit("__ranks_with_layer__", self._flags, symmetric=False)

    def wait(self) -> list[LayerState]:
        """Wait for the reduction; a layer seen by k of P ranks holds sum/P: make it sum/k.
        Returns the layers to commit (a layer no rank saw is dropped)."""
        self.reducer.wait()
        counts = (self._flags * self.world_size).round().tolist()
        live: list[LayerState] = []
        for state, count in zip(self.order, counts, strict=True):
            for key in FACTORS:
                if state.reduce_dst(key) == self.rank:
                    state.factors.swap_pending(key, self.reducer.take(f"{state.name}/{key}"))
            if count == 0:
                state.factors.clear_pending()
                continue
            live.append(state)
            for key in FACTORS:
                pending = state.factors.pending(key)
                if pending is not None and count < self.world_size:
                    pending.mul_(self.world_size / count)
        self.cursor = 0
        self.ready.clear()
        self.fired.clear()
        return live

    def _submit(self, state: LayerState) -> None:
        for key in FACTORS:
            tensor: Tensor | None = state.factors.pending(key)
            assert tensor is not None
            dst = state.reduce_dst(key)
            # Toward one owner only the upper triangle travels (factors are exactly symmetric):
            # the packed copy is half the bytes, and every rank frees the full matrix now.
            if dst is None:
                self.reducer.submit(f"{state.name}/{key}", tensor)
                continue
            self.reducer.submit(
                f"{state.name}/{key}", tensor, dst=dst, symmetric=True, write_back=False
            )
            state.factors.swap_pending(key, None)  # the reducer holds what still travels
