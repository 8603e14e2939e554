"""A user's workload swept on the local backend: a model from a module on PYTHONPATH and a
dataset from an installed entry point, at 1 and 2 ranks, SGD vs K-FAC vs FOSI, collected and
reported under its own names; on the local Slurm cluster the same with one point preempted and
resumed; broken factories are refused before anything is submitted."""

from __future__ import annotations

import csv
import json
import subprocess
import time
from pathlib import Path

import pytest

from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.waiting import wait_for_sweep
from tests.conftest import clean_env
from tests.helpers.report_checks import run_report
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


@pytest.mark.slurm
@pytest.mark.slow
def test_a_user_workload_on_slurm_is_preempted_resumed_and_reported(
    packages, slurm_cluster, tmp_path
):
    """The same workload, named by file (no PYTHONPATH needed on the nodes), on the local Slurm
    cluster at 1 and 2 ranks, SGD vs K-FAC vs FOSI; the 2-rank K-FAC point gets USR2 (what
    Slurm sends before a time limit), checkpoints, is requeued and resumes."""
    from tests.sweep.test_slurm_sweep import _status_of, _train_step

    module = packages / "wlpkg.py"
    sweep_dir = tmp_path / "sw"
    methods = "--kfac true,false --fosi true,false"
    run = "--steps 150 --batch-size 32 --target-accuracy 0.5 --time 00:08:00"
    train = "--eval-every-steps=10 --fosi-warmup=2 --ese-every=5 --fosi-k=4 --no-progress"
    out = cli(
        *f"sweep --nodes 1,2 {methods} {run} --name wl-slurm".split(),
        *("--model", f"{module}:tiny_mlp", "--dataset", f"{module}:blobs"),
        *(f"--train-arg={arg}" for arg in train.split()),
        "--sweep-dir",
        str(sweep_dir),
        env=slurm_cluster,
    )
    assert out.returncode == 0, out.stderr
    points = read_manifest(sweep_dir).points
    victim = next(
        p for p in points if p.params["nodes"] == 2 and p.params["kfac"] and not p.params["fosi"]
    )
    env = clean_env(slurm_cluster)
    deadline = time.monotonic() + 400
    while _train_step(sweep_dir / victim.run_dir) < 10:
        assert time.monotonic() < deadline, "the victim never started training"
        assert not (sweep_dir / victim.run_dir / "done").exists(), "finished before preemption"
        time.sleep(0.2)
    signal = ["scancel", "--signal=USR2", "--batch", str(victim.job_id)]
    sent = subprocess.run(signal, env=env, capture_output=True, text=True, timeout=30)
    assert sent.returncode == 0, sent.stderr
    while _status_of(sweep_dir, victim.point_id, slurm_cluster)["state"] != "requeued":
        assert time.monotonic() < deadline, "the victim was never requeued"
        time.sleep(0.5)
    soon = ["scontrol", "update", f"JobId={victim.job_id}", "StartTime=now+5"]
    assert subprocess.run(soon, env=env, capture_output=True, timeout=30).returncode == 0
    final = wait_for_sweep(sweep_dir, first_s=1.0, max_s=5.0, timeout_s=600)
    assert {p.state for p in final.points} == {"done"} and len(final.points) == 6
    resumed = json.loads((sweep_dir / victim.run_dir / "run.json").read_text())
    assert [a["end"] for a in resumed["attempts"]] == ["preempted", "done"]
    reported = run_report(sweep_dir)
    assert reported.returncode == 0, reported.stderr
    with open(sweep_dir / "report" / "tables" / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["model"] for r in rows} == {"wlpkg.py:tiny_mlp"}
    assert {r["dataset"] for r in rows} == {"wlpkg.py:blobs"}
    assert {(r["method"], r["world_size"]) for r in rows} == {
        (m, str(w)) for m in ("first_order", "kfac", "fosi") for w in (1, 2)
    }
