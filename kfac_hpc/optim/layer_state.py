"""Everything the preconditioner keeps about one registered layer, in one object."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from kfac_hpc.optim.decomposition_methods import SecondOrder
from kfac_hpc.optim.factors import LayerFactors
from kfac_hpc.optim.layers import KFACLayer

__all__ = ["FACTORS", "LayerState"]

FACTORS = ("A", "G")


@dataclass
class LayerState:
    """One layer's module view, factors, captured tensors and second-order data.

    ``second_order`` holds what this rank keeps of the layer's eigen/inverse data ("A" and
    "G"; only on its grad workers); ``ready`` says the data exists on its grad workers, and is
    the same on every rank, so all ranks take the same collective decisions. ``holders`` are
    the ranks that keep each running factor ("A"/"G"; empty: every rank), i.e. the ranks that
    decompose it under MEM-OPT and HYBRID-OPT.
    """

    layer: KFACLayer
    factors: LayerFactors = field(default_factory=LayerFactors)
    inputs: list[Tensor] = field(default_factory=list)  # inputs whose A is not computed yet
    grads: list[Tensor] = field(default_factory=list)
    second_order: dict[str, SecondOrder] = field(default_factory=dict)
    outer: Tensor | None = None
    ready: bool = False
    warned: bool = False  # a failed decomposition was reported
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.layer.name

    def keeps(self, key: str, rank: int) -> bool:
        """Whether ``rank`` keeps the running factor ``key`` ("A" or "G")."""
        return key not in self.holders or rank in self.holders[key]

    def reduce_dst(self, key: str) -> int | None:
        """The one rank factor ``key`` is reduced to, or None to allreduce it."""
        ranks = self.holders.get(key, ())
        return ranks[0] if len(ranks) == 1 else None

    def holds_both(self) -> bool:
        return all(key in self.second_order for key in FACTORS)

    def clear_second_order(self) -> None:
        self.second_order.clear()
        self.outer = None
        self.ready = False

    def second_order_bytes(self) -> int:
        tensors = [t for data in self.second_order.values() for t in data.tensors()]
        if self.outer is not None:
            tensors.append(self.outer)
        return sum(t.numel() * t.element_size() for t in tensors)
