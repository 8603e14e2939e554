"""Preemption: USR2 on one rank only → both ranks checkpoint at the same step and exit 75;
the restart resumes by itself and ends equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal

import pytest

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.checkpoint.files import read_latest
from kfac_hpc.train.preemption import REQUEUE_EXIT_CODE, PreemptionHandler, parse_signal
from tests.helpers.tiny_jobs import assert_bitwise, factors, final_state, run_tiny

TOTAL, SIGNAL_AT = 9, 4
COMMON = ["--steps", str(TOTAL), "--kfac", "--inv-every", "3"]


@pytest.mark.mpi
def test_usr2_on_one_rank_checkpoints_both_at_one_step_and_requeues(tmp_path):
    run = tmp_path / "run"
    lines = run_tiny(
        2,
        run,
        *COMMON,
        "--signal-at",
        str(SIGNAL_AT),
        "--signal-rank",
        "1",
        expect_rc=REQUEUE_EXIT_CODE,
    )
    assert [(x["step"], x["end"]) for x in sorted(lines, key=lambda x: x["rank"])] == [
        (SIGNAL_AT, "preempted"),
        (SIGNAL_AT, "preempted"),
    ]
    latest = read_latest(run / "checkpoints")
    assert latest is not None and latest.name == f"ckpt-{SIGNAL_AT:08d}.h5"
    ckpt = load_checkpoint(latest)
    assert ckpt.step == SIGNAL_AT and ckpt.world_size == 2
    assert sorted(ckpt.tree["ranks"]) == ["0", "1"]  # both ranks' RNG states are in the file

    # The requeued job: same command, resumes from the run directory by itself.
    lines = run_tiny(2, run, *COMMON)
    assert {(x["resumed_from"], x["step"], x["end"]) for x in lines} == {(SIGNAL_AT, TOTAL, "done")}

    straight = tmp_path / "straight"
    run_tiny(2, straight, *COMMON)
    assert_bitwise(final_state(straight)["params"], final_state(run)["params"])
    assert_bitwise(factors(final_state(straight)), factors(final_state(run)))


def test_handler_sets_flag_on_signal_and_restores_previous_handler():
    previous = signal.getsignal(signal.SIGUSR2)
    handler = PreemptionHandler(signals=("usr2", "SIGTERM"))
    with handler:
        assert not handler.should_stop()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.should_stop() and handler.received == signal.SIGUSR2
    assert signal.getsignal(signal.SIGUSR2) == previous


def test_flag_summed_over_ranks_stops_a_rank_that_got_no_signal():
    quiet, signalled = PreemptionHandler(), PreemptionHandler()
    signalled.requested = True  # what its signal handler sets
    summed = quiet.local_flag() + signalled.local_flag()  # the job's allreduce (SUM) of flags
    assert (quiet.local_flag(), signalled.local_flag()) == (0.0, 1.0)
    assert quiet.agreed(summed) and signalled.agreed(summed)
    assert quiet.requested  # it stays decided
    assert not PreemptionHandler().agreed(0.0)


def test_signal_names_are_validated():
    assert parse_signal("USR2") == parse_signal("SIGUSR2") == parse_signal(12) == signal.SIGUSR2
    with pytest.raises(ValueError, match="unknown signal 'USR3'"):
        parse_signal("USR3")
