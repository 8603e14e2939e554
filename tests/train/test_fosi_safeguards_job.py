"""`kfac-hpc train --fosi`: a NaN loss stops the run at its step, with the reason in run.json,
and the safeguards' records are in run.json (in process, tiny runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.optim.fosi import FOSI

MLP = ["--dataset", "digits", "--model", "mlp", "--batch-size", "64", "--no-progress"]
RUN = ["--fosi", "--fosi-k", "2", "--lanczos-iters", "8", "--fosi-warmup", "1", "--ese-every", "4"]
RUN += ["--lr-schedule", "constant", "--lr", "0.05", "--log-every", "4"]


def _train(run_dir: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["train", "--run-dir", str(run_dir), *args])


@pytest.mark.parametrize("nan_step", [2, 6])  # between ESEs (at 1, 5, 9): not found by one
def test_a_nan_loss_stops_the_run_at_its_step_with_the_reason(tmp_path, monkeypatch, nan_step):
    step = FOSI.step

    def poisoned(self: FOSI, *args: Any, **kwargs: Any) -> Any:
        if self.step_count == nan_step:  # as if the loss were NaN: its gradient is
            for p in self.params:
                if p.grad is not None:
                    p.grad.fill_(math.nan)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(FOSI, "step", poisoned)
    run = tmp_path / "run"
    result = _train(run, *MLP, *RUN, "--steps", "12")
    assert result.exit_code == 1, result.output
    summary = json.loads((run / "run.json").read_text())
    assert summary["state"] == "error"
    assert f"the loss became non-finite at step {nan_step}" in summary["error"]
    assert "gradient" in summary["error"] and "--lr" in summary["error"]
    assert validate_run_dir(run) == []


def test_run_json_records_the_pairs_kept_and_the_rejected_subspaces(tmp_path):
    run = tmp_path / "run"
    result = _train(run, *MLP, *RUN, "--steps", "8")
    assert result.exit_code == 0, result.output
    summary = json.loads((run / "run.json").read_text())
    kept = summary["fosi_pairs_kept"]
    assert len(kept) == summary["ese_count"] == 2 and all(0 <= k <= 2 for k in kept)
    assert isinstance(summary["fosi_subspace_rejected_at_steps"], list)
    assert all(s in (1, 5) for s in summary["fosi_subspace_rejected_at_steps"])
    assert torch.tensor(summary["fosi_eigenvalues"]).numel() <= 2
