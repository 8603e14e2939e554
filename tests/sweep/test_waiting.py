"""The one wait loop (`sweep --wait`, `status --watch`, the workflow's wait step): polls back
off from 2 s, doubling to 60 s, back to 2 s on every change; it ends when nothing is live on
two polls in a row, and never sleeps past its deadline. No test here sleeps: the clock and the
sleep are injected."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kfac_hpc
from kfac_hpc.contracts.states import PointState
from kfac_hpc.sweep.backends import backend_for
from kfac_hpc.sweep.prepare import new_manifest, prepare_sweep
from kfac_hpc.sweep.waiting import next_delay, poll_until_settled, wait_for_sweep
from tests.helpers.sweeps import spec


class FakeTime:
    """A clock that only moves when slept on; records every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_schedule_doubles_from_2_to_60_and_resets_on_a_change():
    delays, last = [], None
    for _ in range(8):
        last = next_delay(last, changed=False)
        delays.append(last)
    assert delays == [2, 4, 8, 16, 32, 60, 60, 60]
    assert next_delay(60, changed=True) == 2
    assert next_delay(5, changed=False, first_s=5, max_s=12) == 10
    assert next_delay(10, changed=False, first_s=5, max_s=12) == 12


def _script(states: list[str]):
    """An observation per poll, from ``states``: 'L…' is live, anything else ended; the
    string itself is what changes."""
    seen = iter(states)
    return lambda: next(seen)


def test_polls_back_off_reset_on_a_change_and_end_after_two_quiet_polls():
    fake = FakeTime()
    states = ["L1"] * 8 + ["L2"] * 3 + ["end"] * 2 + ["never read"]
    last = poll_until_settled(
        _script(states),
        lambda s: s.startswith("L"),
        lambda s: s,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert last == "end"
    # 8 polls of L1 (7 pauses after the first's 2 s), L2 resets to 2 s, the end resets again
    # and the second quiet poll comes 2 s later
    assert fake.sleeps == [2, 4, 8, 16, 32, 60, 60, 60, 2, 4, 8, 2]


def test_nothing_live_at_the_first_poll_ends_at_the_second():
    fake = FakeTime()
    last = poll_until_settled(
        _script(["done", "done"]), lambda s: False, lambda s: s, clock=fake.clock, sleep=fake.sleep
    )
    assert last == "done" and fake.sleeps == [2]


def test_a_deadline_cuts_the_last_pause_and_raises_after_the_last_poll():
    fake = FakeTime()
    polls: list[float] = []

    def observe() -> str:
        polls.append(fake.now - 1000)
        return "L"

    with pytest.raises(TimeoutError, match=r"^the sweep x still running after 10 s"):
        poll_until_settled(
            observe,
            lambda s: True,
            lambda s: s,
            timeout_s=10,
            what="the sweep x",
            clock=fake.clock,
            sleep=fake.sleep,
        )
    assert fake.sleeps == [2, 4, 4]  # 2 + 4 + (8 cut to the 4 s left)
    assert polls == [0, 2, 6, 10]  # the last poll at the deadline, never after it


def test_wait_for_sweep_polls_the_backend_and_shows_every_poll(tmp_path):
    prepared = prepare_sweep(
        spec(nodes="1", seed="1,2", model="mlp"), tmp_path / "sw", backend_for("local"), load=False
    )
    manifest = new_manifest(prepared)
    for point in manifest.points:
        point.state = PointState.RUNNING.value
    manifest.write(prepared.sweep_dir)
    fake, shown = FakeTime(), []

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        if len(fake.sleeps) == 3:  # the points end while the wait backs off
            for point in manifest.points:
                run_dir = prepared.sweep_dir / point.run_dir
                run_dir.mkdir(parents=True)
                (run_dir / "done").write_text("")

    final = wait_for_sweep(
        prepared.sweep_dir,
        on_poll=lambda m: shown.append({p.state for p in m.points}),
        clock=fake.clock,
        sleep=sleep,
    )
    assert {p.state for p in final.points} == {"done"}
    assert shown == [{"running"}] * 3 + [{"done"}] * 2
    assert fake.sleeps == [2, 4, 8, 2]


def test_only_the_wait_loop_sleeps_between_polls_of_a_sweep():
    """`sweep --wait`, `status --watch` and the workflow reach the one loop; no other module
    of the sweep or its workflows sleeps, except the pilot waiting for Parsl to name its job."""
    package = Path(kfac_hpc.__file__).parent
    sleepers = set()
    for path in [*(package / "sweep").rglob("*.py"), *(package / "workflows").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("time.sleep", "sleep"):
                sleepers.add(path.relative_to(package).as_posix())
    assert sleepers == {"sweep/waiting.py", "workflows/pilot.py"}
    for user in ("sweep/cli.py", "workflows/sweep_flow.py"):
        assert "wait_for_sweep(" in (package / user).read_text(), user
