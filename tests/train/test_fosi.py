"""`kfac-hpc train --fosi`: FOSI/DHO2 through the real job — its flags, its `ese` phase, its
checkpoint re-sharded between world sizes (real `mpiexec -n 2` ranks, real HDF5), and
preemption (SIGUSR2 on one rank -> exit 75 -> resume) ending bit for bit as an uninterrupted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.cli import main
from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.train.config import load_config

from .conftest import (
    QUICK,
    explain,
    metrics,
    rank_pids,
    read_json,
    run_ranks,
    start_until_checkpoint,
    train_cmd,
)

# Small FOSI: one ESE at step 3 (then every 100), k = 4 with 8 Lanczos steps.
FOSI = ["--fosi", "--fosi-k", "4", "--lanczos-iters", "8", "--fosi-warmup", "3"]
FOSI += ["--fosi-residual-tol", "1"]  # every Ritz pair kept: 8 Lanczos steps converge few
FOSI += ["--ese-every", "100", "--lr", "0.05", "--lr-schedule", "constant", "--no-progress"]


def _cli(run_dir: Path, *args: str) -> Any:
    argv = ["train", "--run-dir", str(run_dir), *QUICK, *FOSI, *args]
    return CliRunner().invoke(main, argv, catch_exceptions=False)


def _model(path: Path) -> dict[str, torch.Tensor]:
    tree = load_checkpoint(path).tree
    return {f"{m}.{k}": t for m, entries in tree["model"].items() for k, t in entries.items()}


def _fosi_state(path: Path) -> dict[str, Any]:
    return load_checkpoint(path).tree["fosi_state"]


def test_fosi_and_kfac_together_exit_2_with_one_line_and_write_nothing(tmp_path: Path) -> None:
    result = _cli(tmp_path / "run", "--kfac")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--kfac and --fosi" in lines[0] and "choose one" in lines[0]
    assert not (tmp_path / "run").exists()


def test_the_method_is_one_contract_derived_from_the_switches() -> None:
    assert load_config(None, {}).method == "kfac"  # K-FAC is on by default
    assert load_config(None, {"kfac": False}).method == "first_order"
    fosi = load_config(None, {"fosi": True})  # --fosi alone turns the default K-FAC off
    assert fosi.method == "fosi" and fosi.kfac is False


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--lanczos-iters", "3", "--lanczos-iters: must be >= k + l = 4"),
        ("--max-staleness", "100", "--max-staleness: 100 must be < --ese-every 100"),
        ("--fosi-hvp", "magic", "--fosi-hvp: 'magic' is not one of auto"),
        ("--fosi-clip", "0.5", "--fosi-clip: 0.5 must be a finite number >= 1"),
    ],
)
def test_bad_fosi_options_exit_2_naming_the_flag(tmp_path, flag, value, words) -> None:
    result = _cli(tmp_path / "run", flag, value)
    assert result.exit_code == 2 and words in result.output, result.output
    assert not (tmp_path / "run").exists()


def test_curvature_ranks_must_leave_a_training_rank(tmp_path: Path) -> None:
    result = _cli(tmp_path / "run", "--curvature-ranks", "1", "--steps", "4")
    assert result.exit_code == 2 and "--curvature-ranks: 1 curvature ranks" in result.output
    assert not (tmp_path / "run").exists()


def test_fosi_run_records_its_ese_phase_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    result = _cli(a, "--steps", "12", "--checkpoint-every", "6")
    assert result.exit_code == 0, result.output
    assert validate_run_dir(a) == []
    summary = read_json(a / "run.json")
    assert summary["method"] == "fosi" and summary["fosi"] is True and summary["kfac"] is False
    assert summary["ese_count"] == 1 and len(summary["ese_s"]) == 1
    assert len(summary["fosi_eigenvalues"]) == 4 and summary["ese_staleness_steps"] == [0]
    train = [r for r in metrics(a) if r["kind"] == "train"]
    ese = [r["phases_s"]["ese"] for r in train]
    assert ese[0] > 0 and ese[1:] == [0.0] * (len(ese) - 1)  # the ESE at step 3, window 1
    assert summary["phases_s"]["ese"] > 0
    config = read_json(a / "config.json")
    assert config["fosi_k"] == 4 and config["lanczos_iters"] == 8

    saved = _fosi_state(a / "checkpoints" / "ckpt-00000006.h5")
    assert saved["step_count"] == 6 and saved["ese_count"] == 1
    assert tuple(saved["eigenvectors"].shape) == (4, sum(t.numel() for t in _model(a).values()))
    resume = ["--resume-from", str(a / "checkpoints" / "ckpt-00000006.h5")]
    result = _cli(b, "--steps", "12", "--checkpoint-every", "6", *resume)
    assert result.exit_code == 0, result.output
    model_b = _model(b)
    for key, tensor in _model(a).items():
        assert torch.equal(tensor, model_b[key]), key
    end_a, end_b = _fosi_state(a), _fosi_state(b)
    for name in ("eigenvalues", "eigenvectors", "velocity"):
        assert torch.equal(end_a[name], end_b[name]), name


def _reshard(tmp_path: Path, saved_at: int, resumed_at: int) -> None:
    """A run at ``saved_at`` ranks checkpoints at step 6; another run resumes that checkpoint at
    ``resumed_at`` ranks. Both end at step 12 on the same trajectory (float32; only the order
    of the gradient sums differs), from V, λ, velocity and base state re-sharded P -> P'."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["--steps", "12", "--checkpoint-every", "6"]

    def train(ranks: int, run_dir: Path, *extra: str) -> None:
        proc = run_ranks(ranks, run_dir, *FOSI, *args, *extra)
        assert proc.returncode == 0, explain(proc)
        assert read_json(run_dir / "run.json")["world_size"] == ranks

    train(saved_at, straight)
    ckpt = straight / "checkpoints" / "ckpt-00000006.h5"
    assert load_checkpoint(ckpt).world_size == saved_at
    train(resumed_at, resumed, "--resume-from", str(ckpt))
    end_a, end_b = _fosi_state(straight), _fosi_state(resumed)
    assert end_a["step_count"] == end_b["step_count"] == 12 and end_b["ese_count"] == 1
    for name in ("eigenvalues", "eigenvectors", "velocity"):
        torch.testing.assert_close(end_b[name], end_a[name], rtol=0, atol=1e-5, msg=name)
    model_a, model_b = _model(straight), _model(resumed)
    for key, tensor in model_a.items():
        torch.testing.assert_close(model_b[key], tensor, rtol=1e-4, atol=1e-5, msg=key)
    # the velocity is what the subspace step integrates: it moved after the resume
    assert not torch.equal(_fosi_state(ckpt)["velocity"], end_b["velocity"])


@pytest.mark.mpi
def test_checkpoint_of_two_ranks_resumes_at_one(tmp_path: Path) -> None:
    _reshard(tmp_path, saved_at=2, resumed_at=1)


@pytest.mark.mpi
def test_checkpoint_of_one_rank_resumes_at_two(tmp_path: Path) -> None:
    _reshard(tmp_path, saved_at=1, resumed_at=2)


@pytest.mark.mpi
def test_usr2_on_one_rank_exits_75_and_resumes_to_the_uninterrupted_result(tmp_path) -> None:
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = [*FOSI, "--steps", "160", "--checkpoint-every", "40", "--ese-every", "50"]
    mpiexec = str(Path(train_cmd(run)[0]).parent / "mpiexec")
    proc = start_until_checkpoint(run, *args, launcher=(mpiexec, "-n", "2"), timeout_s=180)
    pids = rank_pids(run)
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGUSR2)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    first = read_json(run / "run.json")
    assert first["state"] == "preempted" and (run / "preempted").exists()
    assert first["world_size"] == 2 and first["steps"] < 160

    again = run_ranks(2, run, *args)
    assert again.returncode == 0, explain(again)
    summary = read_json(run / "run.json")
    assert summary["state"] == "done" and summary["restarts"] == 1
    assert summary["attempts"][1]["start_step"] == first["steps"]
    assert validate_run_dir(run) == []

    whole = run_ranks(2, straight, *args)
    assert whole.returncode == 0, explain(whole)
    model_a, model_b = _model(straight), _model(run)
    for key, tensor in model_a.items():
        assert torch.equal(tensor, model_b[key]), key
    assert torch.equal(_fosi_state(straight)["eigenvectors"], _fosi_state(run)["eigenvectors"])


@pytest.mark.mpi
def test_curvature_ranks_compute_ese_beside_training_and_late_steps_are_counted(tmp_path):
    run = tmp_path / "run"
    args = ["--batch-size", "66", "--steps", "44", "--ese-every", "10"]
    args += ["--curvature-ranks", "1", "--max-staleness", "2"]
    proc = run_ranks(3, run, *FOSI, *args)
    assert proc.returncode == 0, explain(proc)
    assert validate_run_dir(run) == []
    summary = read_json(run / "run.json")
    assert summary["world_size"] == 3 and summary["curvature_ranks"] == 1
    assert summary["ese_count"] == 5  # steps 3, 13, 23, 33, 43
    staleness = summary["ese_staleness_steps"]
    # the training ranks never wait: how many ESEs arrived in the 44 steps (in order) depends
    # on the machine; the last (step 43) cannot have been swapped in
    assert len(staleness) <= 4 and all(s >= 0 for s in staleness)
    # past the bound the training ranks took the base update alone, from step t + 2 until the
    # ESE of step t arrived, or to the end (ESEs may overlap)
    ends = [t + s for t, s in zip((3, 13, 23, 33, 43), staleness, strict=False)]
    ends += [44] * (5 - len(staleness))
    late = {u for t, end in zip((3, 13, 23, 33, 43), ends, strict=True) for u in range(t + 2, end)}
    assert summary["fosi_late_steps"] == len(late)
    ese = summary["rank_phases_s"]["ese"]
    # only the curvature rank runs ESEs; its row holds those swapped in
    assert ese[0] == ese[1] == 0.0 and (ese[2] > 0) == bool(staleness)
    assert summary["final_accuracy"] > 0.5
