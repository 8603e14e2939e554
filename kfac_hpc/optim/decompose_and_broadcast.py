"""The second-order update of the K-FAC preconditioner: each layer's inverse workers decompose
its factors, the results go to its grad workers, and every rank learns which layers are ready.

Collective: every rank runs :meth:`SecondOrderUpdate.run` at the same steps; the layers that
are ready are the same on every rank, so all take the same collective decisions afterwards.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager

from kfac_hpc.comm import AsyncBroadcaster, KAISAAssignment, KAISAGroups
from kfac_hpc.optim.decomposition_methods import SecondOrder, SecondOrderMethod
from kfac_hpc.optim.host_threads import map_side_by_side
from kfac_hpc.optim.layer_state import FACTORS, LayerState

__all__ = ["SecondOrderUpdate"]

Timed = Callable[[str], AbstractContextManager[None]]

# Factors up to this width are decomposed side by side on CPUs, one intra-op thread each;
# wider ones (ResNet-50's 4608) gain more from every thread (docs/kfac.md, "Performance notes").
SIDE_BY_SIDE_MAX_N = 1024


class SecondOrderUpdate:
    """Computes and distributes second-order data over the layers' states."""

    def __init__(
        self,
        states: dict[str, LayerState],
        method: SecondOrderMethod,
        assignment: KAISAAssignment,
        groups: KAISAGroups,
        rank: int,
    ) -> None:
        self.states = states
        self.method = method
        self.assignment = assignment
        self.groups = groups
        self.rank = rank

    def run(self, damping: float, timed: Timed) -> None:
        """Recompute, distribute and mark ready every layer that has factors; ``timed(phase)``
        times a block as ``inverse_compute`` or ``inverse_comm``."""
        with timed("inverse_compute"):
            ready = self._compute_own(damping)
        with timed("inverse_comm"):
            self._broadcast(ready)
        with timed("inverse_compute"):
            for state in self.states.values():
                state.outer, state.ready = None, False
            for state in ready:
                state.ready = True
                if state.holds_both():
                    a, g = state.second_order["A"], state.second_order["G"]
                    state.outer = self.method.outer(a, g, damping)

    def missing(self) -> bool:
        """Whether a layer has factors but no second-order data yet (e.g. after its first
        factor update came late, or after loading a checkpoint without second-order data)."""
        return any(s.factors.present and not s.ready for s in self.states.values())

    def _compute_own(self, damping: float) -> list[LayerState]:
        """Decompose the factors this rank is the inverse worker of; return the layers whose
        second-order data exists (on the grad workers) after the broadcasts."""
        ready: list[LayerState] = []
        work: list[tuple[LayerState, str]] = []  # (layer, a factor this rank decomposes)
        for state in self.states.values():
            if not state.factors.present:
                continue
            ready.append(state)
            plan = self.assignment.plan(state.name)
            workers = (plan.a_worker, plan.g_worker)
            mine = [
                key for key, worker in zip(FACTORS, workers, strict=True) if worker == self.rank
            ]
            if not mine:
                continue
            assert self.assignment.is_grad_worker(state.name, self.rank), (
                "an inverse worker is always a grad worker"
            )
            assert all(state.keeps(key, self.rank) for key in mine), "an inverse worker keeps"
            work += [(state, key) for key in mine]
        computed = self._decompose(work, damping)
        for (state, key), data in zip(work, computed, strict=True):
            state.second_order[key] = data if data is not None else self._fallback(state, key)
        return ready

    def _decompose(
        self, work: list[tuple[LayerState, str]], damping: float
    ) -> list[SecondOrder | None]:
        """The second-order data of every (layer, factor) of ``work``, in its order. On CPUs
        factors up to ``SIDE_BY_SIDE_MAX_N`` wide run side by side, one intra-op thread each,
        largest first (:mod:`host_threads`); wider ones run one at a time on every thread."""

        def compute(item: tuple[LayerState, str]) -> SecondOrder | None:
            state, key = item
            # one factor at a time: the inverse method's π-damping of a layer whose two
            # factors are both this rank's is computed twice (two traces: negligible)
            return self.method.compute(state.factors.A, state.factors.G, damping, [key])[key]

        if not work:
            return []
        shapes = [_shape(*item) for item in work]  # (n, n) or (groups, n, n)
        # largest first, by groups·n³: what a decomposition costs
        order = sorted(
            range(len(work)), key=lambda i: -math.prod(shapes[i][:-1]) * shapes[i][-1] ** 2
        )
        wide = [i for i in order if shapes[i][-1] > SIDE_BY_SIDE_MAX_N]
        narrow = [i for i in order if shapes[i][-1] <= SIDE_BY_SIDE_MAX_N]
        device = work[0][0].layer.weight.device  # where its factors are
        results = dict(zip(wide, (compute(work[i]) for i in wide), strict=True))
        side_by_side = map_side_by_side(compute, [work[i] for i in narrow], device)
        results.update(zip(narrow, side_by_side, strict=True))
        return [results[i] for i in range(len(work))]

    def _fallback(self, state: LayerState, key: str) -> SecondOrder:
        """The previous data (else the identity) when every decomposition attempt failed."""
        previous = state.second_order.get(key)
        if not state.warned:
            state.warned = True
            kept = "keeping the previous one" if previous else "using the identity"
            warnings.warn(
                f"K-FAC: {self.method.failing_op} of factor {key} of layer {state.name} failed "
                f"in {self.method.dtype}, float64 and with jitter; {kept} (warned once per layer)",
                RuntimeWarning,
                stacklevel=5,
            )
        if previous is not None:
            return previous
        shape = _shape(state, key)
        return self.method.identity(shape, state.layer.weight.device)

    def _broadcast(self, ready: list[LayerState]) -> None:
        broadcaster = AsyncBroadcaster()
        for state in ready:
            for key, src, group in self.groups.second_order_broadcasts(state.name):
                if src != self.rank:
                    shape = _shape(state, key)
                    state.second_order[key] = self.method.empty(shape, state.layer.weight.device)
                for tensor in state.second_order[key].tensors():
                    broadcaster.broadcast(tensor, src, group)
        broadcaster.wait()


def _shape(state: LayerState, key: str) -> tuple[int, ...]:
    """The shape of a layer's factor ``key`` ("A" or "G")."""
    return state.layer.factor_shapes[FACTORS.index(key)]
