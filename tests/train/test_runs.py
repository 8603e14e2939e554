"""Real runs of the small CNN on digits: 1 rank plainly, 2 and 4 ranks under mpiexec."""

from __future__ import annotations

import pytest

from kfac_hpc.contracts import PHASES, validate_run_dir

from .conftest import explain, metrics, read_json, run_plain, run_ranks

ACCURACY = 0.9  # reached after 3 epochs with K-FAC (about 0.97 measured)


def _check_finished(run_dir, world_size):
    assert validate_run_dir(run_dir) == []
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "done" and (run_dir / "done").exists()
    assert summary["world_size"] == world_size
    assert summary["final_accuracy"] >= ACCURACY
    assert summary["target_accuracy"] == ACCURACY
    # time to target: the first evaluation at or above the target, in run wall time
    evals = [r for r in metrics(run_dir) if r["kind"] == "eval"]
    first = next(r for r in evals if r["accuracy"] >= ACCURACY)
    assert summary["time_to_target_s"] == first["wall_s"]
    assert summary["step_to_target"] == first["step"]
    trains = [r for r in metrics(run_dir) if r["kind"] == "train"]
    assert all(len(r["rank_step_s"]) == world_size for r in trains)
    assert all(len(r["rank_phases_s"][p]) == world_size for r in trains for p in PHASES)
    return summary


def test_one_rank_reaches_the_accuracy(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_plain(run_dir, "--epochs", "3", "--target-accuracy", str(ACCURACY))
    assert proc.returncode == 0, explain(proc)
    summary = _check_finished(run_dir, 1)
    assert summary["phases_s"]["factor_compute"] > 0  # K-FAC phases are measured
    assert proc.stdout.count("epoch ") == 3  # one progress line per epoch


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_mpiexec_ranks_reach_the_accuracy(tmp_path, ranks):
    run_dir = tmp_path / "run"
    proc = run_ranks(ranks, run_dir, "--epochs", "3", "--target-accuracy", str(ACCURACY))
    assert proc.returncode == 0, explain(proc)
    summary = _check_finished(run_dir, ranks)
    assert summary["launcher"] == "pmi"
    assert summary["per_rank_batch_size"] == 64 // ranks
    assert proc.stdout.count("epoch ") == 3  # rank 0 only


@pytest.mark.mpi
def test_weak_scaling_keeps_the_per_rank_batch(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_ranks(2, run_dir, "--scaling", "weak", "--batch-size", "32", "--steps", "6")
    assert proc.returncode == 0, explain(proc)
    summary, config = read_json(run_dir / "run.json"), read_json(run_dir / "config.json")
    for record in (summary, config):
        assert (record["global_batch_size"], record["per_rank_batch_size"]) == (64, 32)
    assert summary["steps"] == 6 and validate_run_dir(run_dir) == []
