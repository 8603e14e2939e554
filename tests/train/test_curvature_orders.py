"""A curvature rank waits for training rank 0's orders with the process group's timeout;
rank 0 keeps it waiting through spells longer than that with ``ALIVE`` orders (real
``mpiexec -n 2`` ranks over gloo, tests/helpers/rank_scripts/curvature_orders.py)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from tests.helpers.launch import RANK_SCRIPTS, parse_rank_records, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "curvature_orders.py"


def _waiting_rank(mode: str) -> dict[str, Any]:
    """What rank 1, the curvature rank, reported (in ``silent`` mode rank 0 may be ended by
    the peer's leaving, so only rank 1's record is required)."""
    out = run_mpi(2, [sys.executable, str(SCRIPT), mode], timeout=180)
    records = {r["rank"]: r for r in parse_rank_records(out.stdout)}
    assert {r["world_size"] for r in records.values()} == {2}, out.stderr[-3000:]
    assert 1 in records, f"status {out.returncode}:\n{out.stderr[-3000:]}"
    return records[1]


def test_alive_orders_carry_a_curvature_rank_through_a_long_quiet_spell() -> None:
    """2.5 timeouts without an ESE or a meeting: the curvature rank gets ALIVE orders (at
    least two: one per half timeout) and then FINISH, and its wait never fails."""
    waiting = _waiting_rank("alive")
    assert waiting["failed"] is None, waiting["failed"]
    orders = waiting["orders"]
    assert orders[-1] == "FINISH" and set(orders[:-1]) == {"ALIVE"}, orders
    assert len(orders) - 1 >= 2, orders


def test_without_alive_orders_the_wait_ends_with_the_timeout() -> None:
    """The control: the same spell without ticks fails the curvature rank's receive (so the
    test above passes because of ALIVE, not because the wait has no bound)."""
    waiting = _waiting_rank("silent")
    assert "timed out" in (waiting["failed"] or "").lower() and waiting["orders"] == [], waiting
