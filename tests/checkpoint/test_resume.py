"""Bitwise resume: N steps, save, M more steps == N+M uninterrupted steps, bit for bit (CPU)."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_jobs import assert_bitwise, factors, final_state, run_tiny

N, TOTAL = 5, 8  # inverses every 3 steps: the checkpoint falls between two inverse updates


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resumed_run_equals_uninterrupted_run_bit_for_bit(tmp_path, world, optimizer):
    common = ["--steps", str(TOTAL), "--optimizer", optimizer, "--kfac", "--inv-every", "3"]
    # The uninterrupted run also leaves a checkpoint after step N (saving changes nothing).
    straight = tmp_path / "straight"
    run_tiny(world, straight, *common, "--save-every", str(N))
    ckpt = straight / "checkpoints" / f"ckpt-{N:08d}.h5"
    assert ckpt.is_file()

    resumed = tmp_path / "resumed"
    lines = run_tiny(world, resumed, *common, "--resume-from", str(ckpt))
    assert {x["resumed_from"] for x in lines} == {N}
    assert {x["step"] for x in lines} == {TOTAL}

    a, b = final_state(straight), final_state(resumed)
    assert_bitwise(a["params"], b["params"])
    assert_bitwise(factors(a), factors(b))
    assert a["kfac"]["steps"] == b["kfac"]["steps"] == TOTAL
