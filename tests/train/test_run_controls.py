"""Stop conditions and warm starts of one plain run: time limit, target, --resume-from (in
process: what the job decides, not the process around it)."""

from __future__ import annotations

import json

from kfac_hpc.contracts import validate_run_dir

from .conftest import explain_here, read_json, train_here


def test_time_limit_ends_the_run_done_early(tmp_path):
    run_dir = tmp_path / "run"
    result = train_here(run_dir, "--epochs", "200", "--time-limit", "1s")
    assert result.exit_code == 0, explain_here(result)
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "done" and summary["end"] == "time_limit"
    assert 0 < summary["steps"] < 200 * 22
    assert summary["final_accuracy"] is not None  # evaluated at the stop
    assert validate_run_dir(run_dir) == []


def test_stop_at_target_stops_at_the_first_evaluation_reaching_it(tmp_path):
    run_dir = tmp_path / "run"
    result = train_here(run_dir, "--epochs", "10", "--target-accuracy", "0.5", "--stop-at-target")
    assert result.exit_code == 0, explain_here(result)
    summary = read_json(run_dir / "run.json")
    assert summary["end"] == "target" and summary["steps"] == summary["step_to_target"]
    assert summary["best_accuracy"] >= 0.5


def test_eval_every_steps_adds_evaluations_between_epoch_ends(tmp_path):
    """Digits, batch 64: 22 steps per epoch. Every 10 steps and every epoch end, each once;
    the time to target is the wall time of the first of them at or above the target."""
    run_dir = tmp_path / "run"
    result = train_here(
        run_dir, "--epochs", "2", "--eval-every-steps", "10", "--target-accuracy", "0.05"
    )
    assert result.exit_code == 0, explain_here(result)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [10, 20, 22, 30, 40, 44]
    summary = read_json(run_dir / "run.json")
    assert summary["step_to_target"] == 10
    assert summary["time_to_target_s"] == evals[0]["wall_s"]


def test_warm_starts_from_another_runs_checkpoint(tmp_path):
    first = tmp_path / "first"
    result = train_here(first, "--epochs", "1", "--checkpoint-every", "11")
    assert result.exit_code == 0, explain_here(result)
    second = tmp_path / "second"
    checkpoint = first / "checkpoints" / "ckpt-00000022.h5"
    result = train_here(second, "--epochs", "2", "--resume-from", str(checkpoint))
    assert result.exit_code == 0, explain_here(result)
    attempts = read_json(second / "run.json")["attempts"]
    assert attempts[0]["start_step"] == 22 and attempts[0]["end_step"] == 44
    # --init-factors takes only the K-FAC factors: the run itself starts at step 0
    third = tmp_path / "third"
    result = train_here(third, "--steps", "4", "--init-factors", str(checkpoint))
    assert result.exit_code == 0, explain_here(result)
    assert read_json(third / "run.json")["attempts"][0]["start_step"] == 0
    assert read_json(third / "config.json")["init_factors"] == str(checkpoint)
