"""A rank that raises, or a run whose loss diverges, ends cleanly on every launcher path:
`error` marker, exit 1."""

from __future__ import annotations

import re

import pytest
import torch

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.train.faults import ENV

from .conftest import explain, explain_here, metrics, read_json, run_plain, run_ranks, train_here


def _check_error(run_dir, rank, step):
    message = (run_dir / "error").read_text()
    assert f"injected fault on rank {rank} at step {step}" in message
    assert not (run_dir / "done").exists()
    summary = read_json(run_dir / "run.json")
    assert summary["state"] == "error" and summary["error"] == message.strip()
    assert validate_run_dir(run_dir) == []


def test_plain_run_that_raises_leaves_error(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_plain(run_dir, "--epochs", "2", env={ENV: "rank=0,step=3"})
    assert proc.returncode == 1, explain(proc)
    _check_error(run_dir, 0, 3)


@pytest.mark.mpi
def test_one_mpiexec_rank_raising_ends_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    # the collective timeout bounds how long the healthy rank may wait; run_ranks' own
    # timeout (240 s) turns a hang into a failure
    proc = run_ranks(
        2, run_dir, "--epochs", "2", "--collective-timeout-s", "60", env={ENV: "rank=1,step=5"}
    )
    assert proc.returncode != 0, explain(proc)
    _check_error(run_dir, 1, 5)


def test_retry_after_an_error_clears_the_marker(tmp_path):
    """In process (the job's own bookkeeping; the process's exit is the test above's)."""
    run_dir = tmp_path / "run"
    failed = train_here(run_dir, "--steps", "6", env={ENV: "rank=0,step=3"})
    assert failed.exit_code == 1, explain_here(failed)
    assert (run_dir / "error").exists()
    retry = train_here(run_dir, "--steps", "6")
    assert retry.exit_code == 0, explain_here(retry)
    assert (run_dir / "done").exists() and not (run_dir / "error").exists()
    assert validate_run_dir(run_dir) == []
    assert [a["end"] for a in read_json(run_dir / "run.json")["attempts"]] == ["error", "done"]


# A learning rate of 10^4 without K-FAC drives the small CNN's loss to inf/NaN within a few steps.
DIVERGING = ("--no-kfac", "--lr", "1e4", "--steps", "40")


def _check_diverged(run_dir, proc, world_size):
    assert proc.returncode == 1, explain(proc)
    assert read_json(run_dir / "config.json")["world_size"] == world_size
    message = (run_dir / "error").read_text()
    assert "TrainingDiverged" in message and "non-finite" in message and "--lr" in message
    assert "Traceback" not in proc.stderr  # a diverged run is the user's input, not a bug
    assert not (run_dir / "done").exists()
    assert read_json(run_dir / "run.json")["state"] == "error"
    trained = metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    assert max((r["step"] for r in trained), default=0) < 40  # it stopped, not trained on
    assert validate_run_dir(run_dir) == []
    return message


def test_a_diverging_run_stops_with_an_error_and_checkpoints_only_finite_states(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_plain(run_dir, *DIVERGING, "--checkpoint-every", "1")
    message = _check_diverged(run_dir, proc, 1)
    found = re.search(r"parameters are non-finite at step (\d+); no checkpoint", message)
    assert found, message
    saved = [load_checkpoint(p) for p in sorted((run_dir / "checkpoints").glob("*.h5"))]
    # the latest checkpoint is the step before the divergence (the 2 newest are kept)
    assert [c.step for c in saved][-1:] == [int(found[1]) - 1], message
    for checkpoint in saved:
        tensors = [t for params in checkpoint.tree["model"].values() for t in params.values()]
        assert tensors and all(torch.isfinite(t).all() for t in tensors), checkpoint.path


@pytest.mark.mpi
def test_every_rank_stops_when_rank_0_sees_the_loss_diverge(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_ranks(2, run_dir, *DIVERGING)
    message = _check_diverged(run_dir, proc, 2)
    assert "loss became non-finite in the window ending at step" in message
