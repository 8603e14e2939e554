"""The quality a run must reach for its time-to-target: an accuracy or a loss."""

from __future__ import annotations

from dataclasses import dataclass

# Each metric a target can name, and whether a higher value is better.
HIGHER_IS_BETTER: dict[str, bool] = {"accuracy": True, "loss": False}


@dataclass(frozen=True)
class Target:
    """A quality to reach: ``metric`` (``accuracy``, higher is better; ``loss``, lower is
    better) and its ``value``."""

    metric: str
    value: float

    def __post_init__(self) -> None:
        if self.metric not in HIGHER_IS_BETTER:
            raise ValueError(f"target metric {self.metric!r} is not one of accuracy, loss")

    @property
    def lower_is_better(self) -> bool:
        return not HIGHER_IS_BETTER[self.metric]

    def reached(self, accuracy: float | None, loss: float | None) -> bool:
        """Whether an evaluation's ``accuracy`` or ``loss`` (the target's metric) reaches it."""
        value = loss if self.lower_is_better else accuracy
        if value is None:
            return False
        return value <= self.value if self.lower_is_better else value >= self.value
