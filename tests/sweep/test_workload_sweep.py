"""A user's workload swept on the local backend: a model from a module on PYTHONPATH and a
dataset from an installed entry point, at 1 and 2 ranks, SGD vs K-FAC vs FOSI, collected and
reported under its own names; broken factories are refused before anything is submitted."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kfac_hpc.sweep.manifest import read_manifest
from tests.helpers.sweeps import cli
from tests.helpers.workloads import workload_env, write_workloads
from tests.sweep.test_bad_input import _files, assert_bad_input, run_sweep

WORKLOAD = ["--model", "wlpkg:tiny_mlp", "--dataset", "plugblobs"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_workloads(tmp_path_factory.mktemp("workloads"))


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("wlbroken:build", "cannot be imported: ModuleNotFoundError"),
        ("wlpkg:returns_text", "returned a str, not a torch.nn.Module"),
        ("wlpkg:no_parameters", "no trainable parameters"),
    ],
)
def test_a_broken_factory_stops_the_sweep_before_anything_is_submitted(
    packages, tmp_path, monkeypatch, model, says
):
    monkeypatch.syspath_prepend(str(packages))
    before = _files(tmp_path)
    args = ["--nodes", "1,2", "--model", f"mlp,{model}", "--dataset", "wlpkg:blobs"]
    result = run_sweep(tmp_path, *args, dry_run=False)
    line = assert_bad_input(result, "model", before, tmp_path, says)
    assert model in line


@pytest.mark.mpi
@pytest.mark.slow
def test_a_user_workload_is_swept_at_1_and_2_ranks_and_reported_by_its_names(packages, tmp_path):
    sweep_dir = tmp_path / "sw"
    # SGD, SGD+K-FAC and SGD+FOSI (never both switches on) at 1 and 2 ranks
    methods = "--kfac true,false --fosi true,false"
    run = "--steps 12 --batch-size 32 --target-accuracy 0.5 --model-arg width=12"
    train = "--eval-every-steps=4 --fosi-warmup=2 --ese-every=5 --fosi-k=4 --no-progress"
    out = cli(
        *f"sweep --backend local --nodes 1,2 {methods} {run} --name wl".split(),
        *WORKLOAD,
        *(f"--train-arg={arg}" for arg in train.split()),
        "--sweep-dir",
        str(sweep_dir),
        env=workload_env(packages),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    points = read_manifest(sweep_dir).points
    assert len(points) == 6 and {p.state for p in points} == {"done"}
    methods = set()
    for point in points:
        summary = json.loads((sweep_dir / "runs" / point.point_id / "run.json").read_text())
        assert summary["model"] == "wlpkg:tiny_mlp" and summary["model_args"] == {"width": "12"}
        assert summary["dataset"] == "plugblobs"
        methods.add((summary["method"], summary["world_size"]))
    assert methods == {(m, w) for m in ("first_order", "kfac", "fosi") for w in (1, 2)}
    with open(sweep_dir / "report" / "tables" / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6
    for row in rows:
        assert row["model"] == "wlpkg:tiny_mlp(width=12)" and row["dataset"] == "plugblobs"
        assert row["group"].startswith("wlpkg:tiny_mlp(width=12) plugblobs sgd")
        assert row["time_to_target_s"] != ""  # three separable blobs: 50 % is reached
