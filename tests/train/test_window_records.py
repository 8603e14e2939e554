"""A timing window with a curvature rank: rank 0 writes the curvature rank's row from the
seconds reported with its results; the window's loss and step seconds are the training ranks'."""

from __future__ import annotations

import torch

from kfac_hpc.contracts import RunDir
from kfac_hpc.train.records import WindowRecorder
from kfac_hpc.train.timing import PhaseTimer


def test_the_curvature_ranks_row_holds_the_reported_seconds(tmp_path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    # one training rank and one curvature rank: no process group needed
    recorder = WindowRecorder(run_dir, 0, 2, torch.device("cpu"), 64, 0, curvature_ranks=1)
    timer = PhaseTimer(phases=("forward", "ese"))
    timer.window_phases = [0.5, 0.0]  # four steps of 0.25 s, 0.5 s of them forward
    timer.window_step_s = [0.25] * 4
    recorder.add_loss(torch.tensor(8.0, dtype=torch.float64))  # a loss sum over four steps
    record = recorder.close(timer, 4, 0, 1.0, {"ese": 2.0})
    assert record["rank_phases_s"] == {"forward": [0.125, 0.0], "ese": [0.0, 0.5]}
    assert record["rank_step_s"] == [0.25, 0.5]  # the curvature rank's: its ESE seconds
    assert record["loss"] == 2.0  # the training rank's alone
    assert record["step_s"] == 0.25 and record["samples_per_s"] == 64 / 0.25
    assert record["phases_s"] == {"forward": 0.0625, "ese": 0.25}  # the mean over both ranks
    assert run_dir.read_metrics()[-1] == record
