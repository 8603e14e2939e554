"""A rank that raises ends the run cleanly on every launcher path: `error` marker, exit 1."""

from __future__ import annotations

import pytest

from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.train.faults import ENV

from .conftest import explain, read_json, run_plain, run_ranks


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
    run_dir = tmp_path / "run"
    failed = run_plain(run_dir, "--steps", "6", env={ENV: "rank=0,step=3"})
    assert failed.returncode == 1
    retry = run_plain(run_dir, "--steps", "6")
    assert retry.returncode == 0, explain(retry)
    assert (run_dir / "done").exists() and not (run_dir / "error").exists()
    assert validate_run_dir(run_dir) == []
    assert [a["end"] for a in read_json(run_dir / "run.json")["attempts"]] == ["error", "done"]
