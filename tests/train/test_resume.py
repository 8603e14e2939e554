"""A run killed mid-way (SIGKILL) or preempted (SIGUSR2) and started again finishes the run;
SIGUSR2 on one of two ranks stops both at one step (the flag rides in the gradient allreduce)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.contracts import validate_run_dir

from .conftest import (
    explain,
    rank_pids,
    read_json,
    run_plain,
    run_ranks,
    start_until_checkpoint,
    train_cmd,
)

ARGS = ("--epochs", "10", "--checkpoint-every", "10")
TOTAL_STEPS = 10 * 22


def _restart_and_finish(run_dir):
    proc = run_plain(run_dir, *ARGS)
    assert proc.returncode == 0, explain(proc)
    assert validate_run_dir(run_dir) == []
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "done" and summary["steps"] == TOTAL_STEPS
    assert summary["restarts"] == 1 and len(summary["attempts"]) == 2
    first, second = summary["attempts"]
    assert 0 < second["start_step"] <= first["end_step"] and second["end"] == "done"
    assert summary["wall_s"] >= first["wall_s"] + second["wall_s"] - 1e-6
    assert summary["final_accuracy"] > 0.9
    return first, second


def test_killed_run_resumes_from_its_latest_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_until_checkpoint(run_dir, *ARGS)
    proc.kill()
    proc.communicate(timeout=60)
    assert not (run_dir / "done").exists()
    first, second = _restart_and_finish(run_dir)
    assert first["end"] == "killed"
    assert second["start_step"] % 10 == 0  # from the latest periodic checkpoint


def test_preempted_run_exits_75_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_until_checkpoint(run_dir, *ARGS)
    proc.send_signal(signal.SIGUSR2)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert (run_dir / "preempted").exists() and not (run_dir / "done").exists()
    assert read_json(run_dir / "run.json")["state"] == "preempted"
    first, second = _restart_and_finish(run_dir)
    assert first["end"] == "preempted"
    assert second["start_step"] == first["end_step"]  # checkpointed at the agreed step
    assert not (run_dir / "preempted").exists()


@pytest.mark.mpi
def test_usr2_on_one_of_two_ranks_stops_both_at_one_step_with_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = ("--steps", "400", "--checkpoint-every", "10", "--no-progress")
    mpiexec = str(Path(train_cmd(run_dir)[0]).parent / "mpiexec")
    proc = start_until_checkpoint(run_dir, *args, launcher=(mpiexec, "-n", "2"))
    pids = rank_pids(run_dir)
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGUSR2)  # rank 0 gets no signal: it learns it from the allreduce
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "preempted" and summary["world_size"] == 2
    stopped = summary["steps"]
    assert 10 <= stopped < 400
    assert summary["attempts"][0]["end"] == "preempted"
    assert summary["attempts"][0]["end_step"] == stopped
    assert load_checkpoint(run_dir).step == stopped  # both ranks saved at the agreed step
    again = run_ranks(2, run_dir, *args)
    assert again.returncode == 0, explain(again)
    resumed = read_json(run_dir / "run.json")
    assert resumed["state"] == "done" and resumed["steps"] == 400
    assert resumed["attempts"][1]["start_step"] == stopped
