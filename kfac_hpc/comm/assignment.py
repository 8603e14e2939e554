"""Who does what in the distributed K-FAC (KAISA): the second-order work plan and its groups.

Ranks form a grid of rows of ``g = f·P`` consecutive ranks (f = grad-worker fraction, P = world
size). A row is a *grad-worker group*; a column ``{c, c+g, c+2g, ...}`` is a *receiver group*.
Each layer is given to one row: its A and G eigendecompositions/inverses are computed by ranks of
that row (the *inverse workers*), broadcast along the row, and every rank of the row (the layer's
*grad workers*) preconditions the layer's gradient and broadcasts it down its column.

- COMM-OPT (f = 1): one row of P ranks; second-order data goes to everyone, no gradient
  broadcasts.
- MEM-OPT (f = 1/P): P rows of one rank; second-order data stays on its worker, gradients are
  broadcast to all.
- HYBRID-OPT: in between.

Work is placed by a greedy longest-processing-time (LPT) schedule: layers, largest first, go to
the least loaded row, then each layer's A and G (together when colocated) to the least loaded rank
of that row. Cost of an n×n factor: n³ (``compute``, eigendecomposition time) or n² (``memory``,
bytes held). :class:`KAISAAssignment` is pure Python and deterministic, so every rank computes the
same plan; :class:`KAISAGroups` creates the torch process groups for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

# Defined once, with the job's choices (contracts/choices.py); re-exported here.
from kfac_hpc.contracts.choices import AssignmentStrategy, DistributionStrategy
from kfac_hpc.contracts.grad_workers import (
    parse_grad_worker_fraction,
    valid_grad_worker_fractions,
)

__all__ = [
    "AssignmentStrategy",
    "DistributionStrategy",
    "KAISAAssignment",
    "KAISAGroups",
    "LayerPlan",
    "lpt_schedule",
    "parse_grad_worker_fraction",
    "valid_grad_worker_fractions",
]

FACTORS = ("A", "G")


def lpt_schedule(costs: list[float], bins: int, loads: list[float] | None = None) -> list[int]:
    """Greedy LPT: items, largest first (ties: lower index first), each to the least loaded bin
    (ties: lowest bin). Returns the bin of each item; ``loads`` (if given) is updated in place.
    Its makespan is at most (4/3 − 1/(3·bins)) of the optimum (Graham 1969).
    """
    current = [0.0] * bins if loads is None else loads
    placed = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(bins), key=lambda b: (current[b], b))
        current[target] += costs[item]
        placed[item] = target
    return placed


@dataclass(frozen=True)
class LayerPlan:
    """The second-order work of one layer.

    ``a_worker``/``g_worker`` compute the eigendecomposition (or inverse) of A/G; both lie in
    grid row ``row``, whose ranks ``grad_workers`` hold the layer's second-order data and
    precondition its gradient. ``groups`` > 1: the layer has that many independent blocks
    (grouped Conv2d), all on the same workers.
    """

    name: str
    a_size: int
    g_size: int
    groups: int
    a_worker: int
    g_worker: int
    row: int
    grad_workers: tuple[int, ...]


class KAISAAssignment:
    """The deterministic KAISA plan for ``layers``: name -> (n_A, n_G) or (n_A, n_G, groups),
    in registration order (the same on every rank).

    ``colocate_factors`` puts a layer's A and G on one rank (always so under MEM-OPT, whose rows
    have one rank).
    """

    def __init__(
        self,
        layers: Mapping[str, tuple[int, ...]],
        world_size: int,
        grad_worker_fraction: str | float = 1.0,
        strategy: str | AssignmentStrategy = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
    ) -> None:
        self.world_size = world_size
        self.grad_worker_fraction = parse_grad_worker_fraction(grad_worker_fraction, world_size)
        self.strategy = _parse_strategy(strategy)
        self.colocate_factors = colocate_factors
        g = round(self.grad_worker_fraction * world_size)
        self.grad_worker_count = g
        self.rows: tuple[tuple[int, ...], ...] = tuple(
            tuple(range(r * g, (r + 1) * g)) for r in range(world_size // g)
        )
        self.columns: tuple[tuple[int, ...], ...] = tuple(
            tuple(range(c, world_size, g)) for c in range(g)
        )
        if g == world_size:
            self.distribution = DistributionStrategy.COMM_OPT
        elif g == 1:
            self.distribution = DistributionStrategy.MEM_OPT
        else:
            self.distribution = DistributionStrategy.HYBRID_OPT
        self._loads = [0.0] * world_size
        self.layers: dict[str, LayerPlan] = self._assign(
            {name: _layer_dims(name, dims) for name, dims in layers.items()}
        )

    def _assign(self, layers: dict[str, tuple[int, int, int]]) -> dict[str, LayerPlan]:
        names = list(layers)

        def cost(name: str, factor: str) -> float:
            n_a, n_g, groups = layers[name]
            return groups * self.strategy.cost(n_a if factor == "A" else n_g)

        rows = lpt_schedule([cost(n, "A") + cost(n, "G") for n in names], len(self.rows))
        workers: dict[tuple[str, str], int] = {}
        for row_index, row in enumerate(self.rows):
            mine = [name for name, r in zip(names, rows, strict=True) if r == row_index]
            items: list[tuple[str, tuple[str, ...]]]
            if self.colocate_factors:
                items = [(name, FACTORS) for name in mine]
            else:
                items = [(name, (f,)) for name in mine for f in FACTORS]
            costs = [sum(cost(name, f) for f in factors) for name, factors in items]
            row_loads = [self._loads[rank] for rank in row]
            for (name, factors), slot in zip(
                items, lpt_schedule(costs, len(row), row_loads), strict=True
            ):
                for factor in factors:
                    workers[name, factor] = row[slot]
            for slot, rank in enumerate(row):
                self._loads[rank] = row_loads[slot]
        return {
            name: LayerPlan(
                name=name,
                a_size=layers[name][0],
                g_size=layers[name][1],
                groups=layers[name][2],
                a_worker=workers[name, "A"],
                g_worker=workers[name, "G"],
                row=row,
                grad_workers=self.rows[row],
            )
            for name, row in zip(names, rows, strict=True)
        }

    def plan(self, layer: str) -> LayerPlan:
        """The plan of ``layer``; ``KeyError`` naming it when unknown."""
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer!r} is not in the assignment") from None

    def inverse_worker(self, layer: str, factor: str) -> int:
        """The rank computing the eigendecomposition/inverse of ``factor`` ("A" or "G")."""
        plan = self.plan(layer)
        if factor not in FACTORS:
            raise ValueError(f"factor {factor!r} must be 'A' or 'G'")
        return plan.a_worker if factor == "A" else plan.g_worker

    def is_grad_worker(self, layer: str, rank: int) -> bool:
        """Whether ``rank`` holds the layer's second-order data and preconditions its gradient."""
        return rank in self.plan(layer).grad_workers

    def grad_source(self, layer: str, rank: int) -> int:
        """The grad worker whose preconditioned gradient ``rank`` uses (itself if a worker):
        the member of the layer's row in ``rank``'s column."""
        return self.plan(layer).grad_workers[rank % self.grad_worker_count]

    def row_of(self, rank: int) -> int:
        return rank // self.grad_worker_count

    def column_of(self, rank: int) -> int:
        return rank % self.grad_worker_count

    def loads(self) -> list[float]:
        """Assigned second-order cost per rank (n³ or n² units)."""
        return list(self._loads)

    def __repr__(self) -> str:
        return (
            f"KAISAAssignment({self.distribution.value}, world_size={self.world_size}, "
            f"grad_worker_fraction={self.grad_worker_fraction:g}, "
            f"strategy={self.strategy.value}, colocate_factors={self.colocate_factors}, "
            f"layers={len(self.layers)})"
        )


def _layer_dims(name: str, dims: tuple[int, ...]) -> tuple[int, int, int]:
    """(n_A, n_G, groups) from (n_A, n_G) or (n_A, n_G, groups), validated."""
    if len(dims) not in (2, 3) or any(int(d) != d or d < 1 for d in dims):
        raise ValueError(f"layer {name!r}: sizes {dims!r} must be (n_A, n_G[, groups]) >= 1")
    return int(dims[0]), int(dims[1]), int(dims[2]) if len(dims) == 3 else 1


def _parse_strategy(value: str | AssignmentStrategy) -> AssignmentStrategy:
    if isinstance(value, AssignmentStrategy):
        return value
    try:
        return AssignmentStrategy(str(value).lower())
    except ValueError:
        raise ValueError(
            f"assignment_strategy={value!r} must be one of: compute (n³), memory (n²)"
        ) from None


class KAISAGroups:
    """The torch process groups of a plan, from this rank's point of view.

    :meth:`create` must run on every rank (``dist.new_group`` is collective and is called in the
    same order everywhere: rows, then columns); groups of one rank are not created, the world
    group is reused for a row or column spanning all ranks.
    """

    def __init__(
        self,
        assignment: KAISAAssignment,
        rank: int,
        row_group: ProcessGroup | None,
        column_group: ProcessGroup | None,
    ) -> None:
        self.assignment = assignment
        self.rank = rank
        self._row_group = row_group
        self._column_group = column_group

    @property
    def row_group(self) -> ProcessGroup | None:
        """This rank's grad-worker group; ``None`` when it has one rank (or no process group)."""
        return self._row_group

    @property
    def column_group(self) -> ProcessGroup | None:
        """This rank's receiver group; ``None`` when it has one rank (or no process group)."""
        return self._column_group

    @classmethod
    def create(cls, assignment: KAISAAssignment, rank: int | None = None) -> KAISAGroups:
        """Create the row and column groups; ``rank`` defaults to ``dist.get_rank()`` (0 when
        torch.distributed is not initialised)."""
        initialised = dist.is_available() and dist.is_initialized()
        if initialised and dist.get_world_size() != assignment.world_size:
            raise ValueError(
                f"the assignment is for {assignment.world_size} ranks but the process group has "
                f"{dist.get_world_size()}"
            )
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        own_row = assignment.rows[assignment.row_of(rank)]
        own_column = assignment.columns[assignment.column_of(rank)]
        mine: dict[tuple[int, ...], ProcessGroup | None] = {}
        for ranks in (*assignment.rows, *assignment.columns):
            if len(ranks) == 1 or not initialised:
                group = None
            elif len(ranks) == assignment.world_size:
                group = dist.group.WORLD
            else:
                group = dist.new_group(list(ranks))
            if rank in ranks:
                mine[ranks] = group
        return cls(assignment, rank, mine[own_row], mine[own_column])

    def second_order_broadcasts(self, layer: str) -> list[tuple[str, int, ProcessGroup]]:
        """The broadcasts of second-order data this rank takes part in for ``layer``:
        ``[("A", src, group), ("G", src, group)]`` along the layer's row, or ``[]`` when the
        row has one rank or this rank is not in it."""
        plan = self.assignment.plan(layer)
        if len(plan.grad_workers) == 1 or self.rank not in plan.grad_workers:
            return []
        if self._row_group is None:
            return []  # no process group: a single process simulating a rank
        return [("A", plan.a_worker, self._row_group), ("G", plan.g_worker, self._row_group)]

    def grad_broadcast(self, layer: str) -> tuple[int, ProcessGroup] | None:
        """``(src, group)`` of the broadcast of ``layer``'s preconditioned gradient down this
        rank's column, or ``None`` when columns have one rank (COMM-OPT)."""
        if self._column_group is None:
            return None
        return self.assignment.grad_source(layer, self.rank), self._column_group
