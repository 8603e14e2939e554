"""The hidden test hook of kfac_hpc.train.faults: raise at a step, or hold for a preemption."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kfac_hpc.train.faults import ENV, FaultPlan, InjectedFault, fault_plan


def test_the_plan_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "rank=0,step=12,hold=preempt,world=2,hold_s=5")
    assert fault_plan() == FaultPlan(0, 12, hold_for_preemption=True, hold_s=5.0, world_size=2)
    monkeypatch.setenv(ENV, "rank=1,step=3")
    assert fault_plan() == FaultPlan(1, 3)
    monkeypatch.delenv(ENV)
    assert fault_plan() is None


def test_a_raise_plan_raises_only_on_its_rank_and_step() -> None:
    plan, signalled = FaultPlan(1, 3), SimpleNamespace(requested=False)
    plan.check(0, 2, 3, 0, signalled)
    plan.check(1, 2, 2, 0, signalled)
    with pytest.raises(InjectedFault, match="rank 1 at step 3"):
        plan.check(1, 2, 3, 0, signalled)


def test_a_hold_ends_when_the_preemption_signal_arrives() -> None:
    plan = FaultPlan(0, 12, hold_for_preemption=True, hold_s=600.0)
    signalled = SimpleNamespace(requested=False)
    held = threading.Thread(target=plan.check, args=(0, 2, 12, 0, signalled))
    held.start()
    held.join(timeout=0.3)
    assert held.is_alive(), "the hold returned before any signal"
    signalled.requested = True  # what the USR2 handler does
    held.join(timeout=60)
    assert not held.is_alive(), "the hold did not end on the signal"


@pytest.mark.parametrize(
    ("rank", "world_size", "step", "start_step"),
    [(1, 2, 12, 0), (0, 4, 12, 0), (0, 2, 11, 0), (0, 2, 12, 12)],
    ids=["other rank", "other world size", "other step", "resumed at the step"],
)
def test_a_hold_does_not_apply_elsewhere(
    rank: int, world_size: int, step: int, start_step: int
) -> None:
    plan = FaultPlan(0, 12, hold_for_preemption=True, hold_s=600.0, world_size=2)
    plan.check(rank, world_size, step, start_step, _NeverAsked())


class _NeverAsked:
    """A preemption handler that fails the test if a hold asks it whether a signal came."""

    @property
    def requested(self) -> bool:
        raise AssertionError("the plan held here")
