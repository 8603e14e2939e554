"""`kfac-hpc train` as a command: help for every flag, bad input is one line, exit 2, no files."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from kfac_hpc.train.config import TrainConfig

from .conftest import KFAC_HPC, clean_env


def _train(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KFAC_HPC, "train", *args], env=clean_env(), capture_output=True, text=True, timeout=timeout
    )


def test_help_names_every_setting():
    proc = _train("--help")
    assert proc.returncode == 0
    flags = {"--time-limit", "--checkpoint-every", "--kfac / --no-kfac", "--run-dir", "--config"}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in ("time_limit_s", "checkpoint_every_steps", "checkpoint_every_min"):
            name = f.name.replace("_", "-")
            flags.add(f"--{name} / --no-{name}" if f.type == "bool" else f"--{name}")
    missing = [f for f in flags if f not in proc.stdout]
    assert not missing, missing
    assert "Exit codes" in proc.stdout


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--model", "vgg"], "--model"),
        (["--epochs", "abc"], "--epochs"),
        (["--batch-size", "0"], "--batch-size"),
        (["--factor-sample-fraction", "1.5"], "--factor-sample-fraction"),
        (["--checkpoint-every", "soon"], "--checkpoint-every"),
        (["--dataset", "cifar10"], "--data-path"),
        (["--resume-from", "/nonexistent.h5"], "--resume-from"),
        (["--batch-size", "5000"], "--batch-size"),  # larger than digits: seen at launch
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, flag):
    run_dir = tmp_path / "run"
    proc = _train("--run-dir", str(run_dir), *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], proc.stderr
    assert not run_dir.exists()


def test_toml_errors_name_the_key(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("epochs = 'many'\n")
    proc = _train("--run-dir", str(tmp_path / "run"), "--config", str(config))
    assert proc.returncode == 2 and "--epochs" in proc.stderr


def test_a_run_dir_of_another_experiment_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    first = _train("--run-dir", str(run_dir), "--steps", "2", "--batch-size", "64")
    assert first.returncode == 0, first.stderr
    second = _train("--run-dir", str(run_dir), "--steps", "2", "--batch-size", "32")
    assert second.returncode == 2 and "--run-dir" in second.stderr
    again = _train("--run-dir", str(run_dir), "--steps", "2", "--batch-size", "64")
    assert again.returncode == 0 and "already done" in again.stdout
