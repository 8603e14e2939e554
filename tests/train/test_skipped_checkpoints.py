"""A checkpoint the resume passes over is said in the job's own voice (one line, no Python
warning) and recorded in run.json; a checkpoint whose step was rewritten is passed over, never
resumed from with another step's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from kfac_hpc.checkpoint.files import checkpoint_name
from kfac_hpc.checkpoint.inspect import checkpoint

from .conftest import MLP_ADAM, explain, explain_here, read_json, run_plain, train_here

MLP = [*MLP_ADAM, "--steps", "8", "--keep-checkpoints", "3"]


@pytest.fixture
def finished(mlp_checkpoints: Path) -> Path:
    """A finished 8-step run with checkpoints at steps 3, 6 and 8 (shared: read only)."""
    return mlp_checkpoints


@pytest.fixture
def resumable(finished: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "done").unlink()
    return run


def _start_step(run: Path) -> int:
    lines = [json.loads(line) for line in (run / ".attempts.jsonl").read_text().splitlines()]
    return [e for e in lines if e["event"] == "start"][-1]["start_step"]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 4096):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_skipped_checkpoint_is_a_log_line_and_a_run_json_record(resumable):
    newest = resumable / "checkpoints" / checkpoint_name(8)
    _corrupt(newest)
    proc = run_plain(resumable, *MLP, "--checkpoint-every", "3")
    assert proc.returncode == 0, explain(proc)
    assert _start_step(resumable) == 6
    lines = [line for line in proc.stderr.splitlines() if "skipped checkpoint" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kfac-hpc train: skipped checkpoint {newest}: "), lines
    assert "Warning" not in proc.stderr and "job.py" not in proc.stderr, proc.stderr
    (entry,) = read_json(resumable / "run.json")["skipped_checkpoints"]
    assert (entry["attempt"], entry["file"]) == (1, newest.name)
    assert entry["reason"] and entry["reason"] in lines[0]

    # A later attempt resumes from a good file: the earlier attempt's record stays.
    (resumable / "done").unlink()
    proc = run_plain(resumable, *MLP, "--checkpoint-every", "3")
    assert proc.returncode == 0, explain(proc)
    assert "skipped checkpoint" not in proc.stderr
    assert read_json(resumable / "run.json")["skipped_checkpoints"] == [entry]


def test_a_run_without_skips_records_an_empty_list(finished):
    assert read_json(finished / "run.json")["skipped_checkpoints"] == []


def test_a_rewritten_step_is_skipped_not_resumed_from(resumable):
    """The review's case: step 8's file edited to say step 35 (every HDF5 checksum valid)."""
    newest = resumable / "checkpoints" / checkpoint_name(8)
    with h5py.File(newest, "r+") as h5:
        h5.attrs["step"] = np.int64(35)
    result = CliRunner().invoke(checkpoint, ["verify", str(newest)])
    assert result.exit_code == 1 and "integrity checksum mismatch" in result.output
    resumed = train_here(resumable, *MLP, "--checkpoint-every", "3")
    assert resumed.exit_code == 0, explain_here(resumed)
    assert _start_step(resumable) == 6  # not 35
    (entry,) = read_json(resumable / "run.json")["skipped_checkpoints"]
    assert entry["file"] == newest.name and "integrity" in entry["reason"]


def test_a_deleted_model_dataset_fails_verify_and_is_skipped(resumable):
    newest = resumable / "checkpoints" / checkpoint_name(8)
    with h5py.File(newest, "r+") as h5:
        module = next(name for name in h5["model"] if "weight" in h5["model"][name])
        del h5["model"][module]["weight"]
    result = CliRunner().invoke(checkpoint, ["verify", str(resumable)])
    assert result.exit_code == 1, result.output
    assert f"corrupt: {newest}" in result.output and "a resume takes this file" in result.output
    resumed = train_here(resumable, *MLP, "--checkpoint-every", "3")
    assert resumed.exit_code == 0, explain_here(resumed)
    assert _start_step(resumable) == 6
    assert f"kfac-hpc train: skipped checkpoint {newest}" in resumed.stderr
