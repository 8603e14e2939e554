"""A training method's state as the checkpoint stores it: plain trees, no objects.

Torch-free and importing nothing of the package, so the methods (``kfac_hpc.optim``, the job's
methods) and the checkpoint layer share it without importing each other. A tree is nested
``dict``s with ``str`` keys whose leaves are tensors, numbers, strings, ``None`` or lists of them.

Re-sharding: a method writes, on every rank, the part of its state only some ranks hold as that
rank's *shard*; on load it gets every saved rank's shard back (in saved rank order) and rebuilds
its state from them for the current world size. See docs/checkpoint.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["Checkpointable", "MethodState", "SavedState", "UnitShapes"]

Tree = dict[str, Any]


@dataclass
class MethodState:
    """What one rank hands the checkpoint.

    ``shared`` is identical on every rank (rank 0 writes it); ``shard`` is what this rank
    writes besides (``{}`` for nothing); ``strategy`` names how the state is spread over ranks
    (a checkpoint header attribute); ``assignment`` records which rank held what (informative:
    a load never needs it).
    """

    shared: Tree
    shard: Tree = field(default_factory=dict)
    strategy: str | None = None
    assignment: Tree = field(default_factory=dict)


@dataclass
class SavedState:
    """A method's state read back: ``shared`` and every saved rank's shard, in rank order."""

    shared: Tree
    shards: list[Tree]


@dataclass(frozen=True)
class UnitShapes:
    """The shapes a live method needs, checked before anything is loaded.

    The subtree of ``shared`` at ``path`` is ``{unit: {entry: tensor}}`` (K-FAC: layer ->
    factor); ``shapes`` is ``{unit: {entry: shape}}``. An empty saved subtree is accepted (saved
    before the first update); otherwise units must match both ways and every shape must agree.
    ``unit`` and ``entry`` name them in error messages.
    """

    path: tuple[str, ...]
    shapes: dict[str, dict[str, tuple[int, ...]]]
    unit: str = "unit"
    entry: str = "entry"


class Checkpointable(Protocol):
    """A method's state, as the checkpoint layer sees it (the K-FAC preconditioner is one)."""

    label: str  # for messages ("K-FAC")
    state_group: str  # the checkpoint group of the shared tree ("kfac_state")
    shard_group: str  # the group of each rank's shard under ranks/<r>/

    def checkpoint_state(self, include_shard: bool = True) -> MethodState:
        """This rank's state; without ``include_shard`` the shard is left empty."""
        ...

    def expected_shapes(self) -> UnitShapes:
        """The shapes this live method needs."""
        ...

    def load_checkpoint_state(self, saved: SavedState) -> None:
        """Take a saved state (shapes already checked) as the whole state."""
        ...

    def warm_start(self, saved: SavedState) -> int:
        """Take only what a warm start uses of another run's state; returns the units set."""
        ...
