"""Checkpoints a run cannot use: the user's (--resume-from, --init-factors) are bad input
(one line naming the file, exit 2, nothing written); the run dir's own are skipped for an older
one that fits, and none is deleted before the resume has loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

from kfac_hpc.checkpoint.files import list_checkpoints

from .conftest import MLP_ADAM, explain_here, train_here

MLP = ["--model", "mlp", "--no-progress"]


@pytest.fixture
def adam_ckpt(mlp_checkpoints: Path) -> Path:
    """A finished 8-step Adam run with checkpoints at steps 3, 6 and 8 (shared: read only)."""
    return mlp_checkpoints


def _one_line_exit_2(result, flag: str, name: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, explain_here(result)
    assert len(lines) == 1 and flag in lines[0] and name in lines[0], result.stderr
    assert "Traceback" not in result.output


def _unusable_files(tmp_path: Path, adam_run: Path) -> dict[str, Path]:
    files = {
        "empty": b"",
        "text": b"step = 3\n",
        "garbage": bytes(range(256)) * 40,
    }
    out = {}
    for name, data in files.items():
        out[name] = tmp_path / f"{name}.h5"
        out[name].write_bytes(data)
    good = list_checkpoints(adam_run / "checkpoints")[0]
    out["truncated"] = tmp_path / "truncated.h5"
    out["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    out["not_a_checkpoint"] = tmp_path / "plain.h5"
    with h5py.File(out["not_a_checkpoint"], "w") as h5:
        h5["x"] = [1, 2, 3]
    out["other_optimizer"] = good  # Adam state given to an SGD run
    return out


@pytest.mark.parametrize(
    "kind", ["empty", "text", "garbage", "truncated", "not_a_checkpoint", "other_optimizer"]
)
def test_unusable_resume_from_is_bad_input(tmp_path, adam_ckpt, kind):
    path = _unusable_files(tmp_path, adam_ckpt)[kind]
    run = tmp_path / "run"
    result = train_here(run, *MLP, "--steps", "6", "--resume-from", str(path))
    _one_line_exit_2(result, "--resume-from", path.name)
    assert not run.exists()


@pytest.mark.parametrize("kind", ["empty", "garbage", "truncated", "not_a_checkpoint"])
def test_unusable_init_factors_is_bad_input(tmp_path, adam_ckpt, kind):
    path = _unusable_files(tmp_path, adam_ckpt)[kind]
    run = tmp_path / "run"
    result = train_here(run, *MLP, "--steps", "6", "--init-factors", str(path))
    _one_line_exit_2(result, "--init-factors", path.name)
    assert not run.exists()


def test_checkpoint_of_another_model_is_bad_input(tmp_path, adam_ckpt):
    good = list_checkpoints(adam_ckpt / "checkpoints")[0]
    run = tmp_path / "run"
    result = train_here(run, "--model", "small_cnn", "--steps", "6", "--resume-from", str(good))
    _one_line_exit_2(result, "--resume-from", good.name)
    assert not run.exists()


def _start_step(run: Path) -> int:
    """The step the last attempt started from (the job's own attempt log)."""
    lines = [json.loads(line) for line in (run / ".attempts.jsonl").read_text().splitlines()]
    return [e for e in lines if e["event"] == "start"][-1]["start_step"]


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 4096):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_newest_with_keep_1_keeps_the_good_one_and_resumes_from_it(tmp_path, adam_ckpt):
    run = tmp_path / "run"
    shutil.copytree(adam_ckpt, run)
    (run / "done").unlink()
    newest = list_checkpoints(run / "checkpoints")[0]  # steps 8, 6, 3
    _corrupt(newest)
    result = train_here(run, *MLP_ADAM, "--steps", "8", "--keep-checkpoints", "1")
    assert result.exit_code == 0, explain_here(result)
    assert _start_step(run) == 6
    assert (run / "done").exists()


def _drop_dataset(path: Path) -> None:
    """Delete one K-FAC factor from a checkpoint: every remaining checksum stays valid."""
    with h5py.File(path, "r+") as h5:
        layer = next(iter(h5["kfac_state/layers"].values()))
        del layer["G"]


def test_missing_dataset_fails_verify_and_the_restart_falls_back(tmp_path, adam_ckpt):
    from click.testing import CliRunner

    from kfac_hpc.checkpoint.inspect import checkpoint

    run = tmp_path / "run"
    shutil.copytree(adam_ckpt, run)
    (run / "done").unlink()
    newest = list_checkpoints(run / "checkpoints")[0]
    _drop_dataset(newest)
    result = CliRunner().invoke(checkpoint, ["verify", str(newest)])
    assert result.exit_code == 1 and "lacks A or G" in result.output, result.output
    result = train_here(run, *MLP_ADAM, "--steps", "8")
    assert result.exit_code == 0, explain_here(result)
    assert _start_step(run) == 6


def test_latest_that_is_a_directory_falls_back(tmp_path, adam_ckpt):
    from click.testing import CliRunner

    from kfac_hpc.checkpoint.inspect import checkpoint

    run = tmp_path / "run"
    shutil.copytree(adam_ckpt, run)
    (run / "done").unlink()
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").mkdir()
    result = CliRunner().invoke(checkpoint, ["inspect", str(run)])  # the file a resume takes
    assert result.exit_code == 0 and "step:        8" in result.output, result.output
    result = train_here(run, *MLP_ADAM, "--steps", "8")
    assert result.exit_code == 0, explain_here(result)
    assert _start_step(run) == 8


def test_directory_in_place_of_the_next_checkpoint_skips_it(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "ckpt-00000002.h5").mkdir(parents=True)
    with pytest.warns(UserWarning, match="ckpt-00000002.h5 exists and is not a file"):
        result = train_here(run, *MLP, "--steps", "4", "--checkpoint-every", "2")
    assert result.exit_code == 0, explain_here(result)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt-00000004.h5"]
