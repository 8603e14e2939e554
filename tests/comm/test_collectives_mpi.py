"""Multi-rank checks of kfac_hpc.comm with real processes (mpiexec, gloo).

One job per world size runs every check (tests/helpers/rank_scripts/comm_checks.py); each test below
asserts that one check passed on every rank of a job of the expected world size.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.launch import RANK_SCRIPTS, run_mpi
from tests.helpers.rank_records import CheckReport

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "comm_checks.py"
WORLD_SIZES = (2, 4)
_reports: dict[int, CheckReport] = {}


def report(world_size: int) -> CheckReport:
    """What the ranks of one job of ``world_size`` ranks reported (started once per session)."""
    if world_size not in _reports:
        out = run_mpi(world_size, [sys.executable, str(SCRIPT)], timeout=400)
        _reports[world_size] = CheckReport.from_job(world_size, out)
    return _reports[world_size]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_ran_every_check(world_size: int) -> None:
    report(world_size).assert_finished()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed_allreduce_equals_plain_allreduce(world_size: int) -> None:
    """Many tensor sizes and bucket caps (0 = one collective per tensor ... 25 MiB), float32
    (rtol 1e-5) and float64 (rtol 1e-12); integer-valued data must match exactly."""
    report(world_size).assert_passed("bucketed_equals_plain")
    report(world_size).assert_passed("bucketed_exact_on_integers")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucket_is_launched_as_soon_as_it_is_full(world_size: int) -> None:
    report(world_size).assert_passed("bucket_launches_when_full")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_upper_triangle_packing_rebuilds_full_symmetric_matrices(world_size: int) -> None:
    report(world_size).assert_passed("triangle_packing")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_to_owner_writes_the_mean_only_on_the_owner(world_size: int) -> None:
    report(world_size).assert_passed("reduce_to_owner")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_to_owner_without_write_back_hands_the_owner_its_mean(world_size: int) -> None:
    """The caller zeroes its tensors right after submitting: the owner still takes the exact
    mean (packed triangle or flat), rebuilt whole; no other rank has one to take."""
    report(world_size).assert_passed("reduce_to_owner_taken_whole")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_owner_buckets_open_and_in_flight_are_bounded(world_size: int) -> None:
    report(world_size).assert_passed("owner_buckets_bounded")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_any_rank_flag_is_agreed_by_all_ranks(world_size: int) -> None:
    report(world_size).assert_passed("any_rank")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_broadcasts_from_every_rank(world_size: int) -> None:
    report(world_size).assert_passed("world_broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed_broadcast_delivers_every_tensor(world_size: int) -> None:
    """Bucket caps 0 ... 25 MiB, two dtypes, several senders, non-contiguous receivers."""
    report(world_size).assert_passed("bucketed_broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduction_flag_and_broadcast_within_a_subgroup(world_size: int) -> None:
    """Groups of even and odd ranks (of one rank each at world size 2: no-ops)."""
    report(world_size).assert_passed("subgroup_reduction_and_broadcast")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_kaisa_groups_carry_second_order_data_and_gradients(world_size: int) -> None:
    """For every valid grad-worker fraction (COMM/HYBRID/MEM-OPT), colocated or not: second-order
    data reaches exactly the layer's grad workers, every rank gets every gradient."""
    names = [n for n in report(world_size).checks() if n.startswith("kaisa_flow_")]
    fractions = {n.split("_")[2] for n in names}
    assert len(fractions) == (2 if world_size == 2 else 3), names
    for name in names:
        report(world_size).assert_passed(name)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_check_failing_on_one_rank_ends_the_job_with_its_report(failing_rank: int) -> None:
    """One rank fails before the check's first collective while the other waits in it: the
    job ends (no wait for the gloo timeout), the failing rank's reason is what the test
    reports, and the checks before it still count as passed."""
    out = run_mpi(
        2,
        [sys.executable, str(SCRIPT)],
        env={"KFAC_HPC_FAIL_CHECK_ON_RANK": f"triangle_packing@{failing_rank}"},
        timeout=400,
    )
    failed = CheckReport.from_job(2, out)
    assert out.returncode != 0
    failed.assert_passed("bucket_launches_when_full")
    with pytest.raises(AssertionError, match=f"(?s)rank {failing_rank}: .*injected failure"):
        failed.assert_passed("triangle_packing")
    with pytest.raises(AssertionError, match="stopped at check 'triangle_packing'"):
        failed.assert_passed("reduce_to_owner")
    with pytest.raises(AssertionError, match="finished"):
        failed.assert_finished()
