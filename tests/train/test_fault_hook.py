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


def test_an_ese_hold_ends_when_training_rank_0_begins_its_step(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, "rank=2,step=3,hold=ese,until=9,hold_s=600")
    plan = fault_plan()
    assert plan == FaultPlan(2, 3, hold_s=600.0, ese_until=9)
    signalled = SimpleNamespace(requested=False)
    plan.check(2, 3, 3, 0, signalled)  # not a raise plan: the step loop goes on
    plan.hold_ese(1, 3, tmp_path)  # another rank's ESE, another step's: not held
    plan.hold_ese(2, 13, tmp_path)
    held = threading.Thread(target=plan.hold_ese, args=(2, 3, tmp_path))
    held.start()
    held.join(timeout=0.3)
    assert held.is_alive(), "the ESE was released before step 9 began"
    plan.release(1, 9, tmp_path)  # only training rank 0 releases
    plan.release(0, 8, tmp_path)
    assert held.is_alive() and not list(tmp_path.iterdir())
    plan.release(0, 9, tmp_path)
    held.join(timeout=60)
    assert not held.is_alive(), "the hold did not end when step 9 began"


def test_an_ese_held_past_its_bound_raises(tmp_path) -> None:
    plan = FaultPlan(2, 3, hold_s=0.05, ese_until=9)
    with pytest.raises(InjectedFault, match="never began step 9"):
        plan.hold_ese(2, 3, tmp_path)
