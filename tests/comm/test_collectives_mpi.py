"""Multi-rank checks of kfac_hpc.comm with real processes (mpiexec, gloo).

One job per world size runs every check (tests/comm/dist_comm_checks.py); each test below
asserts one check on every rank, and that the job really had the expected world size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import parse_rank_records, run_mpi

pytestmark = pytest.mark.mpi

SCRIPT = Path(__file__).with_name("dist_comm_checks.py")
WORLD_SIZES = (2, 4)
_results: dict[int, list[dict[str, Any]]] = {}


def results(world_size: int) -> list[dict[str, Any]]:
    """Per-rank reports of one job of ``world_size`` ranks (started once per session)."""
    if world_size not in _results:
        out = run_mpi(world_size, [sys.executable, str(SCRIPT)], timeout=240)
        assert out.returncode == 0, f"ranks failed:\n{out.stdout}\n{out.stderr[-4000:]}"
        lines = parse_rank_records(out.stdout)
        _results[world_size] = sorted(lines, key=lambda r: r["rank"])
    reports = _results[world_size]
    assert [r["rank"] for r in reports] == list(range(world_size))
    assert all(r["world_size"] == world_size for r in reports)
    return reports


def assert_check(world_size: int, name: str) -> None:
    reports = results(world_size)
    assert all(name in r["checks"] for r in reports), f"check {name} did not run"
    failures = {r["rank"]: r["checks"][name] for r in reports if r["checks"][name] is not None}
    assert not failures, "\n".join(f"rank {k}: {v}" for k, v in failures.items())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed_allreduce_equals_plain_allreduce(world_size: int) -> None:
    """Many tensor sizes and bucket caps (0 = one collective per tensor ... 25 MiB), float32
    (rtol 1e-5) and float64 (rtol 1e-12); integer-valued data must match exactly."""
    assert_check(world_size, "bucketed_equals_plain")
    assert_check(world_size, "bucketed_exact_on_integers")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucket_is_launched_as_soon_as_it_is_full(world_size: int) -> None:
    assert_check(world_size, "bucket_launches_when_full")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_upper_triangle_packing_rebuilds_full_symmetric_matrices(world_size: int) -> None:
    assert_check(world_size, "triangle_packing")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_to_owner_writes_the_mean_only_on_the_owner(world_size: int) -> None:
    assert_check(world_size, "reduce_to_owner")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_to_owner_without_write_back_hands_the_owner_its_mean(world_size: int) -> None:
    """The caller zeroes its tensors right after submitting: the owner still takes the exact
    mean (packed triangle or flat), rebuilt whole; no other rank has one to take."""
    assert_check(world_size, "reduce_to_owner_taken_whole")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_owner_buckets_open_and_in_flight_are_bounded(world_size: int) -> None:
    assert_check(world_size, "owner_buckets_bounded")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_any_rank_flag_is_agreed_by_all_ranks(world_size: int) -> None:
    assert_check(world_size, "any_rank")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_broadcasts_from_every_rank(world_size: int) -> None:
    assert_check(world_size, "world_broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed_broadcast_delivers_every_tensor(world_size: int) -> None:
    """Bucket caps 0 ... 25 MiB, two dtypes, several senders, non-contiguous receivers."""
    assert_check(world_size, "bucketed_broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduction_flag_and_broadcast_within_a_subgroup(world_size: int) -> None:
    """Groups of even and odd ranks (of one rank each at world size 2: no-ops)."""
    assert_check(world_size, "subgroup_reduction_and_broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_kaisa_groups_carry_second_order_data_and_gradients(world_size: int) -> None:
    """For every valid grad-worker fraction (COMM/HYBRID/MEM-OPT), colocated or not: second-order
    data reaches exactly the layer's grad workers, every rank gets every gradient."""
    names = [n for n in results(world_size)[0]["checks"] if n.startswith("kaisa_flow_")]
    fractions = {n.split("_")[2] for n in names}
    assert len(fractions) == (2 if world_size == 2 else 3), names
    for name in names:
        assert_check(world_size, name)
