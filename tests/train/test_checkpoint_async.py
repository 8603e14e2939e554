"""``--checkpoint-async`` in the job: preemption and exit wait for the write in flight, the run
resumes from it, and at 2 ranks every rank's part reaches the file."""

from __future__ import annotations

import signal

import h5py
import pytest

from kfac_hpc.checkpoint import read_checkpoint
from kfac_hpc.checkpoint.files import read_latest
from kfac_hpc.contracts import validate_run_dir

from .conftest import explain, read_json, run_plain, run_ranks, start_until_checkpoint

ARGS = ("--epochs", "6", "--checkpoint-every", "10", "--checkpoint-async")
TOTAL_STEPS = 6 * 22


def test_preempted_async_run_exits_75_with_its_checkpoint_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_until_checkpoint(run_dir, *ARGS)
    proc.send_signal(signal.SIGUSR2)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    first = read_json(run_dir / "run.json")["attempts"][0]
    latest = read_latest(run_dir / "checkpoints")
    assert latest is not None
    # The checkpoint of the agreed stop step was complete before the process exited.
    assert read_checkpoint(latest).step == first["end_step"]
    proc2 = run_plain(run_dir, *ARGS)
    assert proc2.returncode == 0, explain(proc2)
    assert validate_run_dir(run_dir) == []
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "done" and summary["steps"] == TOTAL_STEPS
    assert summary["attempts"][1]["start_step"] == first["end_step"]
    final = read_latest(run_dir / "checkpoints")
    assert final is not None and read_checkpoint(final).step == TOTAL_STEPS


@pytest.mark.mpi
def test_two_ranks_write_async_checkpoints_with_every_rank_part(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_ranks(2, run_dir, "--epochs", "2", "--checkpoint-every", "10", "--checkpoint-async")
    assert proc.returncode == 0, explain(proc)
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "done" and summary["world_size"] == 2
    latest = read_latest(run_dir / "checkpoints")
    assert latest is not None and read_checkpoint(latest).step == 44
    with h5py.File(latest, "r") as h5:
        assert sorted(h5["ranks"]) == ["0", "1"]
