"""`kfac-hpc train --fosi --curvature-ranks 1`: the job's training ranks never wait for the
curvature rank's ESE (real `mpiexec -n 3` ranks: two training ranks, one curvature rank).

The curvature rank takes no training step and is in none of the step's collectives nor in an
evaluation (the training ranks share the test set); it serves ESEs and joins the checkpoints and
the end on training rank 0's orders. The fault
hook holds the ESE of step 3 on the curvature rank until training rank 0 begins step 9: training
ranks that waited for it (a flag allreduce over the world, as the job once had) would never get
there, and the held ESE then fails the run after 120 s instead of hanging. With a staleness bound
of 2 steps 5..8 must be the base update alone, counted; the checkpoints after it meet the
curvature rank. With ``--max-staleness 0`` (training waits at every ESE's step) a run
resumed from a checkpoint ends bit for bit where the uninterrupted run does.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.train.config import load_config
from kfac_hpc.train.data import ShardedBatches
from kfac_hpc.train.step import evaluate
from kfac_hpc.train.workloads import build_model, load_data

from .conftest import (
    explain,
    metrics,
    rank_pids,
    read_json,
    run_ranks,
    start_until_checkpoint,
    train_cmd,
)

pytestmark = pytest.mark.mpi

# Small FOSI on the small CNN: ESEs at steps 3, 13, 23 (k = 4, 8 Lanczos steps), 3 ranks.
FOSI = ["--fosi", "--fosi-k", "4", "--lanczos-iters", "8", "--fosi-warmup", "3"]
FOSI += ["--fosi-residual-tol", "1", "--ese-every", "10", "--lr", "0.05"]
FOSI += ["--lr-schedule", "constant", "--no-progress", "--batch-size", "66"]
FOSI += ["--curvature-ranks", "1"]
HOLD = {"KFAC_HPC_FAULT_INJECT": "rank=2,step=3,hold=ese,until=9,hold_s=120"}


def _checkpoint(run: Path, step: int) -> dict:
    return load_checkpoint(run / "checkpoints" / f"ckpt-{step:08d}.h5").tree


def _model(tree: dict) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": t for m, entries in tree["model"].items() for k, t in entries.items()}


def _test_set_figures(run: Path, tree: dict) -> tuple[float, float]:
    """(loss, accuracy) of the checkpoint's model over the whole test set, on one rank."""
    config = load_config(None, {"dataset": "digits", "model": "small_cnn"})
    data = load_data(config)
    model = build_model(config, data.shape, data.num_classes, 0, 1)
    model.load_state_dict(_model(tree))
    batches = ShardedBatches(data, 66, 0, 1, config.seed, augment=False)
    return evaluate(model, batches, torch.device("cpu"), 1)


def test_training_ranks_pass_a_held_ese_and_meet_the_curvature_rank_after_it(tmp_path) -> None:
    run = tmp_path / "run"
    args = [*FOSI, "--max-staleness", "2", "--steps", "24"]
    args += ["--eval-every-steps", "10", "--checkpoint-every", "10", "--keep-checkpoints", "3"]
    proc = run_ranks(3, run, *args, env=HOLD)
    assert proc.returncode == 0, explain(proc)
    assert validate_run_dir(run) == []
    summary = read_json(run / "run.json")
    assert summary["world_size"] == 3 and summary["curvature_ranks"] == 1
    assert summary["ese_count"] == 3  # steps 3, 13, 23
    # the held ESE arrived when step 9 had begun at the earliest: 6 steps or more late
    assert summary["ese_staleness_steps"][0] >= 6
    final = _checkpoint(run, 24)
    late = [int(s) for s in final["fosi_state"]["late_steps"]]
    assert {5, 6, 7, 8} <= set(late), late
    assert summary["fosi_late_steps"] == len(late)
    # one ESE seconds figure per ESE swapped in, as the curvature rank reported it
    assert len(summary["ese_s"]) == len(summary["ese_staleness_steps"])
    assert all(s > 0 for s in summary["ese_s"])
    ese = summary["rank_phases_s"]["ese"]
    assert ese[0] == ese[1] == 0.0 and ese[2] > 0  # the curvature rank's row
    # the evaluations cover the whole test set (shared by the training ranks): the last equals
    # the final model's figures over the whole test set on one rank
    evals = [r for r in metrics(run) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, 21, 24]  # and the epoch end (21 steps)
    loss, accuracy = _test_set_figures(run, final)
    assert evals[-1]["accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert evals[-1]["loss"] == pytest.approx(loss, rel=1e-5)
    assert [_checkpoint(run, s)["step"] for s in (10, 20)] == [10, 20]


def test_a_run_resumed_with_a_curvature_rank_ends_where_the_uninterrupted_run_ends(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = [*FOSI, "--max-staleness", "0", "--steps", "16", "--checkpoint-every", "8"]
    first = run_ranks(3, straight, *args)
    assert first.returncode == 0, explain(first)
    ckpt = straight / "checkpoints" / "ckpt-00000008.h5"
    again = run_ranks(3, resumed, *args, "--resume-from", str(ckpt))
    assert again.returncode == 0, explain(again)
    for run in (straight, resumed):
        summary = read_json(run / "run.json")
        assert summary["world_size"] == 3 and summary["curvature_ranks"] == 1
        # synchronous: every ESE swapped in at the step that requested it, no late step
        assert summary["fosi_late_steps"] == 0 and set(summary["ese_staleness_steps"]) == {0}
    assert read_json(resumed / "run.json")["ese_count"] == 2  # steps 3 and 13, counted on
    end_a, end_b = _checkpoint(straight, 16), _checkpoint(resumed, 16)
    for key, tensor in _model(end_a).items():
        assert torch.equal(tensor, _model(end_b)[key]), key
    for name in ("eigenvalues", "eigenvectors", "velocity"):
        assert torch.equal(end_a["fosi_state"][name], end_b["fosi_state"][name]), name


@pytest.mark.parametrize("rank", [0, 1])
def test_a_training_rank_that_raises_ends_the_curvature_rank_too(tmp_path, rank: int) -> None:
    run = tmp_path / "run"
    fault = {"KFAC_HPC_FAULT_INJECT": f"rank={rank},step=5"}
    # the collective timeout bounds any wait; run_ranks' own timeout turns a hang into a failure
    args = [*FOSI, "--max-staleness", "2", "--steps", "24", "--collective-timeout-s", "60"]
    proc = run_ranks(3, run, *args, env=fault)
    assert proc.returncode != 0, explain(proc)
    summary = read_json(run / "run.json")
    assert summary["state"] == "error" and summary["world_size"] == 3
    assert f"injected fault on rank {rank} at step 5" in summary["error"]
    assert not (run / "done").exists()


def test_a_preemption_signal_stops_every_rank_with_a_checkpoint_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    args = [*FOSI, "--max-staleness", "2", "--steps", "80", "--checkpoint-every", "20"]
    # training rank 0 holds before step 30 until the signal has reached it: the run is still
    # training when the signal comes, and stops by step 31
    hold = {"KFAC_HPC_FAULT_INJECT": "rank=0,step=30,hold=preempt,world=3"}
    mpiexec = str(Path(train_cmd(run)[0]).parent / "mpiexec")
    proc = start_until_checkpoint(run, *args, launcher=(mpiexec, "-n", "3"), env=hold)
    pids = rank_pids(run)
    assert len(pids) == 3, pids
    for pid in pids:  # as Slurm signals every task of the step, the curvature rank included
        os.kill(pid, signal.SIGUSR2)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 75, out[-2000:] + err[-2000:]
    first = read_json(run / "run.json")
    stop = first["steps"]
    assert first["state"] == "preempted" and first["world_size"] == 3 and 20 < stop <= 31
    # the curvature rank met the preemption's checkpoint (every rank's state is in it)
    assert load_checkpoint(run / "checkpoints" / f"ckpt-{stop:08d}.h5").world_size == 3
    again = run_ranks(3, run, *args)
    assert again.returncode == 0, explain(again)
    summary = read_json(run / "run.json")
    assert summary["state"] == "done" and summary["restarts"] == 1 and summary["steps"] == 80
    assert summary["attempts"][1]["start_step"] == stop
    assert validate_run_dir(run) == []


def test_a_checkpoint_with_a_curvature_rank_holds_the_training_ranks_mean_batchnorm(tmp_path):
    """resnet20 (BatchNorm) on digits at a learning rate of 1e-12 (the parameters stay put),
    no ESE and no evaluation before step 4's checkpoint: its BatchNorm statistics are the mean
    of the two training ranks' own (each from its share of batches 0-3), replayed here on one
    process; training rank 0's own statistics alone differ from it."""
    run = tmp_path / "run"
    args = [*FOSI, "--fosi-warmup", "20", "--steps", "4", "--checkpoint-every", "4"]
    args += ["--model", "resnet20", "--lr", "1e-12"]
    proc = run_ranks(3, run, *args)
    assert proc.returncode == 0, explain(proc)
    assert read_json(run / "run.json")["curvature_ranks"] == 1
    saved = _model(_checkpoint(run, 4))
    config = load_config(None, {"dataset": "digits", "model": "resnet20"})
    data = load_data(config)
    ranks = []
    for rank in (0, 1):
        model = build_model(config, data.shape, data.num_classes, rank, 3)
        model.load_state_dict(saved)
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.reset_running_stats()
        batches = ShardedBatches(data, 66, rank, 3, config.seed, augment=config.augment)
        with torch.no_grad():
            for index in range(4):
                model(batches.batch(0, index)[0])
        ranks.append(model.state_dict())
    keys = [key for key in saved if key.endswith(("running_mean", "running_var"))]
    assert keys
    for key in keys:
        mean = (ranks[0][key] + ranks[1][key]) / 2
        assert torch.allclose(saved[key], mean, rtol=1e-4, atol=1e-6), key
    assert any(not torch.allclose(ranks[0][key], ranks[1][key], atol=1e-3) for key in keys)
