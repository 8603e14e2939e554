"""Hyperparameters that may change over training: a number, a callable of the step, or a
scheduler object.

A value is always *computed from the step*, never mutated in place, so asking twice for the
same step gives the same answer (no compounding) and a checkpoint only needs the scheduler's
own ``state_dict()`` (if it has one) plus the preconditioner's step counter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Hyperparameter", "MultiStepSchedule", "ScheduledValue", "StatefulSchedule"]


@runtime_checkable
class StatefulSchedule(Protocol):
    """A scheduler object: called with the step, with state saved in checkpoints."""

    def __call__(self, step: int) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


Hyperparameter = float | int | Callable[[int], float] | StatefulSchedule


class MultiStepSchedule:
    """``initial * gamma ** (number of milestones <= step)``: e.g. damping that decays, or an
    update interval that grows ×10 at chosen steps (KAISA's dynamic update decoupling)."""

    def __init__(self, initial: float, milestones: Sequence[int], gamma: float) -> None:
        self.initial = float(initial)
        self.milestones = sorted(int(m) for m in milestones)
        self.gamma = float(gamma)

    def __call__(self, step: int) -> float:
        passed = sum(1 for m in self.milestones if m <= step)
        return self.initial * self.gamma**passed

    def state_dict(self) -> dict[str, Any]:
        return {"initial": self.initial, "milestones": list(self.milestones), "gamma": self.gamma}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.initial = float(state["initial"])
        self.milestones = [int(m) for m in state["milestones"]]
        self.gamma = float(state["gamma"])

    def __repr__(self) -> str:
        return f"MultiStepSchedule({self.initial}, {self.milestones}, {self.gamma})"


class ScheduledValue:
    """One named hyperparameter, resolved at a step and checked against its valid range.

    ``check`` returns None when a value is valid, else the text of the valid range; a
    scheduled value that leaves its range raises ``ValueError`` naming the option.
    """

    def __init__(
        self, name: str, source: Hyperparameter, check: Callable[[float], str | None]
    ) -> None:
        if isinstance(source, bool) or not (isinstance(source, int | float) or callable(source)):
            raise ValueError(
                f"{name} must be a number, a callable of the step or a scheduler object, "
                f"got {source!r}"
            )
        self.name = name
        self.source = source
        self._check = check
        if isinstance(source, int | float):
            self._validate(float(source))

    def _validate(self, value: float) -> float:
        problem = self._check(value)
        if problem is not None:
            raise ValueError(f"{self.name} must be {problem}, got {value!r}")
        return value

    def __call__(self, step: int) -> float:
        """The value at ``step`` (the preconditioner's step counter, starting at 0)."""
        if isinstance(self.source, int | float):
            return float(self.source)
        return self._validate(float(self.source(step)))

    @property
    def is_stateful(self) -> bool:
        return isinstance(self.source, StatefulSchedule)

    def state_dict(self) -> dict[str, Any] | None:
        """The scheduler object's state, or None for numbers and plain callables."""
        if isinstance(self.source, StatefulSchedule):
            return self.source.state_dict()
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None and isinstance(self.source, StatefulSchedule):
            self.source.load_state_dict(state)

    def __repr__(self) -> str:
        return repr(self.source) if not callable(self.source) else f"<schedule {self.source!r}>"
