"""Saving and loading the K-FAC preconditioner: ``state_dict()`` / ``load_state_dict()`` (exact
inverses, layer-keyed, independent of the rank layout) and the checkpoint's view of them.

For a checkpoint (:class:`~kfac_hpc.contracts.method_state.Checkpointable`), the shared tree is
the state without second-order data (identical on every rank; under MEM-OPT/HYBRID-OPT its
factors are gathered from the ranks that keep them, so taking it is collective); each rank's shard
is the second-order data of the layers it is the first grad worker of, so the shards hold one copy
of everything whatever the strategy, and merging them layer by layer rebuilds the whole state at
any world size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kfac_hpc.comm import AsyncBroadcaster, KAISAAssignment
from kfac_hpc.contracts.method_state import MethodState, SavedState, UnitShapes
from kfac_hpc.optim.decomposition_methods import SecondOrderMethod
from kfac_hpc.optim.factors import LayerFactors
from kfac_hpc.optim.layer_state import FACTORS, LayerState
from kfac_hpc.optim.options import KFACOptions

__all__ = ["STATE_FORMAT", "KFACStateMixin", "merged_state"]

STATE_FORMAT = 1


def merged_state(saved: SavedState) -> dict[str, Any]:
    """A saved checkpoint state as one ``state_dict()``: every shard merged into its layer."""
    state = dict(saved.shared)
    layers = {name: dict(entries) for name, entries in state.get("layers", {}).items()}
    for shard in saved.shards:
        for name, entries in shard.items():
            layers.setdefault(name, {}).update(entries)
    state["layers"] = layers
    return state


class KFACStateMixin:
    """The state methods of :class:`~kfac_hpc.optim.preconditioner.KFACPreconditioner`."""

    label = "K-FAC"
    # checkpoint_state() tensors are never modified in place afterwards (see state_dict)
    state_by_reference = True
    state_group = "kfac_state"
    shard_group = "kfac_second_order"

    options: KFACOptions
    states: dict[str, LayerState]
    method: SecondOrderMethod
    assignment: KAISAAssignment
    rank: int
    steps: int
    skipped_factor_updates: int
    _capture: bool

    # ----------------------------------------------------------------- state dict
    def state_dict(self, include_second_order: bool = False) -> dict[str, Any]:
        """Plain nested state, keyed by layer name and independent of the rank layout.

        ``layers[name]`` holds ``A`` and ``G`` (layers that have factors); with
        ``include_second_order`` also what this rank holds of ``QA``/``dA``/``QG``/``dG``
        (eigen) or ``A_inv``/``G_inv`` (inverse). Under MEM-OPT/HYBRID-OPT the factors are
        gathered from the ranks that keep them: collective, every rank calls it. The tensors
        may be the preconditioner's own, which it never modifies in place (updates make new
        ones): copy one before modifying it.
        """
        layers = self._gathered_factors()
        if include_second_order:
            for name, entry in layers.items():
                entry.update(self._second_order_entries(self.states[name]))
        return self._header() | {"layers": layers}

    def _header(self) -> dict[str, Any]:
        """The state without its layers: counters, method, schedules."""
        schedules = {
            name: s.state_dict() for name, s in self.options.schedules.items() if s.is_stateful
        }
        return {
            "format": STATE_FORMAT,
            "steps": self.steps,
            "skipped_factor_updates": self.skipped_factor_updates,
            "compute_method": self.method.kind.value,
            "schedules": schedules,
        }

    def _gathered_factors(self) -> dict[str, dict[str, Tensor]]:
        """Copies of the running A and G of every layer that has them, on every rank: a
        factor kept by some ranks only comes from the first of them (one bucketed broadcast
        over the world; nothing is sent when every rank keeps every factor)."""
        broadcaster = AsyncBroadcaster()
        layers: dict[str, dict[str, Tensor]] = {}
        for name, state in self.states.items():
            factors = state.factors
            if not factors.present:
                continue
            layer = state.layer
            dtype = self.options.factor_dtype or layer.weight.dtype
            entry: dict[str, Tensor] = {}
            for key, shape in zip(FACTORS, layer.factor_shapes, strict=True):
                kept = factors.A if key == "A" else factors.G
                if kept is not None:
                    entry[key] = kept.detach()  # never modified in place: no copy needed
                else:
                    entry[key] = torch.empty(shape, dtype=dtype, device=layer.weight.device)
                if key in state.holders:
                    broadcaster.broadcast(entry[key], src=state.holders[key][0])
            layers[name] = entry
        broadcaster.wait()
        return layers

    def _second_order_entries(self, state: LayerState) -> dict[str, Tensor]:
        entries: dict[str, Tensor] = {}
        for key, data in state.second_order.items():
            names = self.method.state_keys(key)
            # each update makes new second-order tensors: references are stable
            entries.update(zip(names, data.tensors(), strict=True))
        return entries

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The exact inverse of :meth:`state_dict`; checks every shape first (nothing is
        changed when a check fails). Second-order data not in ``state`` is recomputed from
        the loaded factors at the next ``step()`` (or call ``recompute_second_order()``)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"K-FAC state format {state.get('format')!r} is not {STATE_FORMAT}")
        unknown = sorted(set(state["layers"]) - set(self.states))
        if unknown:
            raise ValueError(f"K-FAC state has layers this model lacks: {', '.join(unknown)}")
        for name, entry in state["layers"].items():
            self._check_shapes(name, entry)
        same_method = state.get("compute_method") == self.method.kind.value
        self.steps = int(state["steps"])
        self.skipped_factor_updates = int(state.get("skipped_factor_updates", 0))
        for name, schedule_state in state.get("schedules", {}).items():
            self.options.schedules[name].load_state_dict(schedule_state)
        keys = [k for f in FACTORS for k in self.method.state_keys(f)]
        for name, layer_state in self.states.items():
            layer_state.clear_second_order()
            factors = layer_state.factors = LayerFactors()
            entry = state["layers"].get(name)
            if entry is None:
                continue
            layer = layer_state.layer
            device, dtype = layer.weight.device, self.options.factor_dtype or layer.weight.dtype
            for key in FACTORS:  # only the factors this rank keeps (owner-only factors)
                kept = layer_state.keeps(key, self.rank)
                value = entry[key].to(device=device, dtype=dtype).clone() if kept else None
                setattr(factors, key, value)
            factors.updated = True
            if same_method and all(k in entry for k in keys):
                # Every rank sees the same state, so all agree on what is ready (a layer marked
                # missing on some ranks only would make them run collectives alone).
                layer_state.ready = True
                if self.assignment.is_grad_worker(name, self.rank):
                    self._load_second_order(layer_state, entry, device)
        self._capture = self.options.is_factor_step(self.steps)

    def _check_shapes(self, name: str, entry: dict[str, Tensor]) -> None:
        shapes = dict(zip(FACTORS, self.states[name].layer.factor_shapes, strict=True))
        for key, expected in shapes.items():
            got = tuple(entry[key].shape) if key in entry else None
            if got != expected:
                raise ValueError(
                    f"K-FAC state for layer {name}: factor {key} has shape {got}, the model "
                    f"needs {expected}"
                )

    def _load_second_order(
        self, state: LayerState, entry: dict[str, Tensor], device: torch.device
    ) -> None:
        dtype = self.options.inv_dtype
        for key in FACTORS:
            tensors = [
                entry[k].to(device=device, dtype=dtype).clone() for k in self.method.state_keys(key)
            ]
            state.second_order[key] = self.method.from_tensors(tensors)
        damping = self.options.value("damping", self.steps)
        state.outer = self.method.outer(state.second_order["A"], state.second_order["G"], damping)

    # ----------------------------------------------------------------- checkpoints
    def checkpoint_state(self, include_shard: bool = True) -> MethodState:
        """The state as the checkpoint stores it (see the module docstring)."""
        shared = self.state_dict(include_second_order=False)
        shard: dict[str, Any] = {}
        if include_shard:
            for name, state in self.states.items():
                primary = self.assignment.plan(name).grad_workers[0] == self.rank
                if name in shared["layers"] and state.second_order and primary:
                    shard[name] = self._second_order_entries(state)
        plans = {
            name: {
                "a_worker": int(plan.a_worker),
                "g_worker": int(plan.g_worker),
                "grad_workers": [int(r) for r in plan.grad_workers],
            }
            for name, plan in self.assignment.layers.items()
        }
        return MethodState(shared, shard, self.assignment.distribution.value, plans)

    def expected_shapes(self) -> UnitShapes:
        """{layer: {"A": shape, "G": shape}} of the registered layers."""
        shapes = {
            name: dict(zip(FACTORS, state.layer.factor_shapes, strict=True))
            for name, state in self.states.items()
        }
        return UnitShapes(("layers",), shapes, unit="layer", entry="factor")

    def load_checkpoint_state(self, saved: SavedState) -> None:
        """Load a checkpoint's state, second-order data of every saved rank included."""
        self.load_state_dict(merged_state(saved))

    def warm_start(self, saved: SavedState) -> int:
        """Load only the factors (A, G per layer) of ``saved``; everything else (step counters,
        schedules, second-order data) stays. Returns the number of layers set."""
        state = self._header()
        state["layers"] = {
            name: {f: entry[f] for f in FACTORS if f in entry}
            for name, entry in saved.shared.get("layers", {}).items()
        }
        self.load_state_dict(state)
        return len(state["layers"])
