"""`kfac-hpc train --fosi` with the cheaper ESE's options (in process, tiny runs): the job's
curvature closure hands the ESE the leading rows of its batch, a warm-started run completes,
and a fraction outside (0, 1] is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import kfac_hpc.train.step as step_module
from kfac_hpc.cli import main
from kfac_hpc.contracts import validate_run_dir

MLP = ["--dataset", "digits", "--model", "mlp", "--batch-size", "64", "--no-progress"]
RUN = ["--fosi", "--fosi-k", "2", "--lanczos-iters", "8", "--fosi-warmup", "1", "--ese-every", "4"]
RUN += ["--lr-schedule", "constant", "--lr", "0.05", "--log-every", "4", "--steps", "8"]


def _train(run_dir: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["train", "--run-dir", str(run_dir), *args])


def test_the_jobs_ese_differentiates_the_leading_quarter_of_the_batch(tmp_path, monkeypatch):
    seen: list[tuple[float, int, int]] = []
    real = step_module.leading_rows

    def spy(fraction: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = real(fraction, *tensors)
        seen.append((fraction, len(tensors[0]), len(rows[0])))
        return rows

    monkeypatch.setattr(step_module, "leading_rows", spy)
    run = tmp_path / "run"
    result = _train(run, *MLP, *RUN, "--fosi-curvature-fraction", "0.25", "--fosi-warm-start")
    assert result.exit_code == 0, result.output
    summary = json.loads((run / "run.json").read_text())
    assert summary["ese_count"] == 2
    assert seen and {s for s in seen} == {(0.25, 64, 16)}
    assert validate_run_dir(run) == []


@pytest.mark.parametrize("value", ["0", "1.5", "-0.25", "nan"])
def test_a_fraction_outside_0_1_exits_2_naming_the_flag(tmp_path, value):
    run = tmp_path / "run"
    result = _train(run, *MLP, *RUN, "--fosi-curvature-fraction", value)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--fosi-curvature-fraction" in lines[0], result.output
    assert "(0, 1]" in lines[0]
    assert not run.exists()


def test_the_adaptive_schedule_and_the_float32_basis_are_recorded_in_run_json(tmp_path):
    run = tmp_path / "run"
    args = ["--fosi-adaptive-ese", "--fosi-lanczos-dtype", "training", "--ese-every", "2"]
    args += ["--fosi-hvp", "double-backward"]
    result = _train(run, *MLP, *RUN, *args, "--steps", "10")
    assert result.exit_code == 0, result.output
    summary = json.loads((run / "run.json").read_text())
    assert summary["fosi_adaptive_ese"] is True and summary["fosi_lanczos_dtype"] == "training"
    count = summary["ese_count"]
    intervals, movements = summary["fosi_ese_intervals"], summary["fosi_subspace_movement"]
    assert count >= 2 and len(intervals) == count and len(movements) == count - 1
    assert all(0.0 <= m <= 1.0 for m in movements)
    assert all(i in (2, 4, 8, 16) for i in intervals)  # from --ese-every to 8x it
    assert summary["fosi_memory_bytes"]["lanczos_basis_bytes"] == 8 * 4 * 26_122  # float32
    assert validate_run_dir(run) == []


def test_partial_reorthogonalization_is_recorded_in_run_json(tmp_path):
    run = tmp_path / "run"
    result = _train(run, *MLP, *RUN, "--fosi-reorthogonalize", "partial")
    assert result.exit_code == 0, result.output
    summary = json.loads((run / "run.json").read_text())
    assert summary["fosi_reorthogonalize"] == "partial"
    steps = summary["fosi_lanczos_steps"]
    assert 0 <= summary["fosi_reorthogonalized_steps"] < steps == 8
    assert validate_run_dir(run) == []


@pytest.mark.parametrize(
    ("flag", "value", "choices"),
    [("--fosi-lanczos-dtype", "float16", "float64, training"),
     ("--fosi-reorthogonalize", "some", "full, partial")],
)  # fmt: skip
def test_an_unknown_choice_exits_2_naming_the_flag(tmp_path, flag, value, choices):
    run = tmp_path / "run"
    result = _train(run, *MLP, *RUN, flag, value)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], result.output
    assert choices in lines[0]
    assert not run.exists()
