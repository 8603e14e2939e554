"""A user's workload through `kfac-hpc train`: named by module:callable, by file.py:callable
and by an installed entry point; its arguments recorded and hashed; a lower-is-better metric's
time to target; a checkpoint refused to another workload by name; broken factories refused
with one line naming the flag, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result

from tests.helpers.workloads import workload_env, write_workloads

from .conftest import KFAC_HPC, explain, explain_here, train_here

SMALL = ["--batch-size", "32", "--log-every", "4", "--no-progress", "--eval-every-steps", "4"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_workloads(tmp_path_factory.mktemp("workloads"))


def _kfac_hpc(packages: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [KFAC_HPC, *args],
        env=workload_env(packages),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


def _train(packages: Path, run_dir: Path, *args: str, cwd: Path | None = None):
    return _kfac_hpc(packages, "train", "--run-dir", str(run_dir), *SMALL, *args, cwd=cwd)


@pytest.fixture
def importable(packages: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The packages importable in this process, as PYTHONPATH makes them for a new one (the
    installed entry points too); forgotten again afterwards."""
    from kfac_hpc.contracts.workload_names import installed

    def forget() -> None:
        installed.cache_clear()
        for name in ("wlpkg", "wlplug", "wlbroken"):
            sys.modules.pop(name, None)

    forget()  # another test's copy of the packages, imported earlier in this process
    monkeypatch.syspath_prepend(str(packages))
    yield packages
    forget()


def _train_here(run_dir: Path, *args: str) -> Result:
    """`kfac-hpc train` in this process: for what the job decides, not the process around it."""
    return train_here(run_dir, *args, settings=SMALL)


def _run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def test_a_module_workload_trains_and_records_its_names_and_arguments(
    packages, importable, tmp_path
):
    run_dir = tmp_path / "run"
    args = ["--model", "wlpkg:tiny_mlp", "--model-arg", "width=12", "--dataset", "wlpkg:blobs"]
    proc = _train(packages, run_dir, *args, "--dataset-arg", "n=192", "--steps", "12")
    assert proc.returncode == 0, explain(proc)
    summary = _run_json(run_dir)
    assert summary["model"] == "wlpkg:tiny_mlp" and summary["model_args"] == {"width": "12"}
    assert summary["dataset"] == "wlpkg:blobs" and summary["dataset_args"] == {"n": "192"}
    assert summary["metric"] == "accuracy" and summary["higher_is_better"] is True
    assert (summary["threads"], summary["threads_from"]) == (1, "OMP_NUM_THREADS")  # clean_env
    # whether torch's allocator had huge pages: as the environment the rank started with said
    assert summary["huge_pages"] is (os.environ.get("THP_MEM_ALLOC_ENABLE") == "1")
    assert summary["steps"] == 12 and summary["final_accuracy"] > 1 / 3  # better than chance
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model_arg"] == ["width=12"] and config["dataset_arg"] == ["n=192"]
    # Another argument is another experiment: the same run dir refuses it by its hash.
    other = _train_here(run_dir, *args[:3], "width=8", *args[4:], "--steps", "12")
    assert other.exit_code == 2, explain_here(other)
    assert "holds another experiment" in other.stderr, explain_here(other)


def test_a_file_workload_with_a_lower_is_better_metric_reaches_its_target_loss(packages, tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    (work / "my_model.py").write_text((packages / "wlpkg.py").read_text())
    run_dir = tmp_path / "run"
    proc = _train(
        packages,
        run_dir,
        "--model",
        "./my_model.py:tiny_mlp",
        "--dataset",
        "./my_model.py:blobs_by_loss",
        "--steps",
        "16",
        "--target-loss",
        "0.9",
        "--no-kfac",
        "--lr",
        "0.2",
        cwd=work,
    )
    assert proc.returncode == 0, explain(proc)
    summary = _run_json(run_dir)
    assert summary["model"] == f"{work / 'my_model.py'}:tiny_mlp"  # recorded absolute
    assert summary["metric"] == "loss" and summary["higher_is_better"] is False
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(e["step"], e["loss"]) for e in evals if e["kind"] == "eval"]
    first = next((step for step, loss in losses if loss <= 0.9), None)
    assert first is not None, losses  # the blobs are separable: the loss falls below 0.9
    assert summary["target_loss"] == 0.9 and summary["step_to_target"] == first


def test_an_installed_workload_is_listed_by_name_and_trains(packages, tmp_path):
    # a new process, as a user's: the help lists what is installed when the CLI is imported
    helped = _kfac_hpc(packages, "train", "--help")
    assert helped.returncode == 0, explain(helped)
    flat = " ".join(helped.stdout.split())
    assert "installed: plugmlp" in flat and "installed: plugblobs" in flat
    run_dir = tmp_path / "run"
    proc = _train(packages, run_dir, "--model", "plugmlp", "--dataset", "plugblobs", "--steps", "8")
    assert proc.returncode == 0, explain(proc)
    assert _run_json(run_dir)["model"] == "plugmlp"


def test_a_checkpoint_is_refused_to_another_workload_by_name(importable, tmp_path):
    first = tmp_path / "first"
    base = ["--model", "wlpkg:tiny_mlp", "--dataset", "wlpkg:blobs", "--steps", "8"]
    made = _train_here(first, *base, "--model-arg", "width=16", "--checkpoint-every", "4")
    assert made.exit_code == 0, explain_here(made)
    checkpoint = sorted((first / "checkpoints").glob("*.h5"))[-1]
    second = tmp_path / "second"
    refused = _train_here(second, *base, "--model-arg", "width=8", "--resume-from", str(checkpoint))
    assert refused.exit_code == 2, explain_here(refused)
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model-arg" in lines[0], refused.stderr
    assert "--model wlpkg:tiny_mlp --model-arg width=16" in lines[0]
    assert "--model wlpkg:tiny_mlp --model-arg width=8" in lines[0]
    assert not (second / "run.json").exists()


@pytest.mark.parametrize(
    ("args", "flag", "words"),
    [
        (["--model", "wlbroken:build"], "--model", "cannot be imported: ModuleNotFoundError"),
        (["--model", "wlpkg:returns_text"], "--model", "returned a str, not a torch.nn.Module"),
        (["--model", "wlpkg:no_parameters"], "--model", "no trainable parameters"),
        (["--model", "wlpkg:missing"], "--model", "cannot be imported: AttributeError"),
        (["--dataset", "wlpkg:tiny_mlp"], "--dataset", "cannot be loaded here: TypeError"),
        (["--dataset", "wlpkg:returns_text"], "--dataset", "returned a str"),
        (["--model", "./nowhere.py:build"], "--model", "is not a file"),
        (["--model", "mycnn"], "--model", "is not a registered model"),
        (["--model-arg", "width"], "--model-arg", "is not key=value"),
    ],
)
def test_a_broken_workload_is_one_line_exit_2_and_writes_nothing(
    importable, tmp_path, args, flag, words
):
    run_dir = tmp_path / "run"
    result = _train_here(run_dir, *args, "--steps", "2")
    assert result.exit_code == 2, explain_here(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kfac-hpc train: error: {flag}:"), lines
    assert words in lines[0], lines[0]
    assert not run_dir.exists()


def test_doctor_lists_the_installed_workloads(packages, monkeypatch):
    from kfac_hpc.contracts.workload_names import installed, registered
    from kfac_hpc.runtime.doctor import _workloads

    monkeypatch.syspath_prepend(str(packages))
    installed.cache_clear()
    try:
        [check] = _workloads()
        assert check.ok and check.detail == "--model plugmlp, --dataset plugblobs"
        assert registered("model")["plugmlp"] == "wlplug:tiny_mlp"
        assert registered("model")["small_cnn"] == "kfac_hpc.train.models:small_cnn"
    finally:
        installed.cache_clear()
