"""``kfac_hpc.Run`` in this process (one rank): a user's own loop writes the run directory of
``kfac-hpc train`` (the contract's validator holds it to that), checkpoints K-FAC's and FOSI's
state through the checkpoint manager, and a USR2 in the middle checkpoints, exits 75 and resumes
to the parameters of the run that was never interrupted, bit for bit."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import kfac_hpc
from kfac_hpc.checkpoint import read_checkpoint
from kfac_hpc.contracts.records import validate_run_dir

STEPS = 12  # 3 epochs of 4 batches


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > x[:, 1]).long())


def _train(
    run_dir: Path,
    method: str = "kfac",
    *,
    signal_at: int | None = None,
    body: Callable[[int], None] | None = None,
    **run_args: Any,
) -> nn.Module:
    """The user's loop: a tiny MLP, shuffled batches of 16, SGD with K-FAC (or FOSI, or SGD
    alone); ``signal_at``: USR2 to this process during that step."""
    run_args.setdefault("checkpoint_every", 5)
    with kfac_hpc.Run(run_dir, model="tiny_mlp", dataset="synthetic", **run_args) as run:
        torch.manual_seed(0)
        data = _data()
        sampler = DistributedSampler(data, run.world_size, run.rank, shuffle=True, seed=1)
        loader = DataLoader(data, batch_size=16, sampler=sampler)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer: torch.optim.Optimizer = sgd
        pre: Any = None
        if method == "kfac":
            pre = kfac_hpc.KFACPreconditioner(model, lr=0.1, inv_update_steps=3)
        elif method == "fosi":
            optimizer = kfac_hpc.FOSI(
                model.parameters(), sgd, k=2, ese_every=4, warmup=2, model=model
            )
        run.track(model=model, optimizer=optimizer, preconditioner=pre, sampler=sampler)
        for step, (x, y) in run.steps(loader, steps=STEPS):
            if step == signal_at:  # before this step's allreduce, which carries the flag
                os.kill(os.getpid(), signal.SIGUSR2)
            with run.phase("forward"):
                loss = nn.functional.cross_entropy(model(x), y)
            with run.phase("backward"):
                optimizer.zero_grad()
                loss.backward()
            if method != "fosi":  # FOSI reduces the gradients itself
                run.average_gradients()
            if pre is not None:
                with run.phase("precondition"):
                    pre.step()
            with run.phase("optimizer"):
                if method == "fosi":
                    optimizer.step(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y))
                else:
                    optimizer.step()
            run.log(loss=loss)
            if body is not None:
                body(step)
        with torch.no_grad():
            logits = model(data.tensors[0])
        accuracy = (logits.argmax(1) == data.tensors[1]).float().mean().item()
        run.log(
            eval_loss=nn.functional.cross_entropy(logits, data.tensors[1]).item(), accuracy=accuracy
        )
    return model


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_the_loop_writes_the_job_contract_with_its_own_labels_and_kfac_state(tmp_path):
    run = tmp_path / "run"
    _train(run, log_every=4)
    assert validate_run_dir(run) == []
    summary = _json(run / "run.json")
    labels = {k: summary[k] for k in ("model", "dataset", "optimizer", "method", "kfac")}
    assert labels == {
        "model": "tiny_mlp",
        "dataset": "synthetic",
        "optimizer": "sgd",
        "method": "kfac",
        "kfac": True,
    }
    assert summary["state"] == "done" and summary["steps"] == STEPS and summary["epochs"] == 3
    assert summary["global_batch_size"] == 16 and summary["world_size"] == 1
    assert _json(run / "config.json")["config_hash"] == summary["config_hash"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [4, 8, 12]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [STEPS]
    # the preconditioner's own phases, not one "precondition" lump
    assert all(r["phases_s"]["factor_compute"] > 0 for r in records if r["kind"] == "train")
    latest = read_checkpoint(run / "checkpoints" / "ckpt-00000012.h5")
    assert latest.step == STEPS and latest.tree["kfac_state"]
    assert latest.tree["extra"]["method"] == "kfac"


@pytest.mark.parametrize("method", ["kfac", "fosi", "sgd"])
def test_usr2_checkpoints_exits_75_and_the_resume_ends_as_the_uninterrupted_run(tmp_path, method):
    straight = _train(tmp_path / "straight", method)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stopped:
        _train(run, method, signal_at=6)  # step 7 of 12, between the checkpoints at 5 and 10
    assert stopped.value.code == 75
    first = _json(run / "run.json")
    assert first["state"] == "preempted" and first["steps"] == 7 and (run / "preempted").exists()
    assert not (run / "done").exists()
    assert read_checkpoint(run / "checkpoints" / "ckpt-00000007.h5").step == 7

    resumed = _train(run, method)
    summary = _json(run / "run.json")
    assert summary["state"] == "done" and summary["restarts"] == 1
    assert [a["start_step"] for a in summary["attempts"]] == [0, 7]
    assert validate_run_dir(run) == []
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), f"{method}: {name} differs from the uninterrupted run's"


def test_a_done_run_exits_0_at_once_and_another_config_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    _train(run, "sgd")
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as done:
        _train(run, "sgd")
    assert done.value.code == 0 and (run / "metrics.jsonl").read_text() == before

    other = tmp_path / "other"
    with pytest.raises(SystemExit):
        _train(other, "sgd", signal_at=2)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        _train(other, "kfac")  # another method: another experiment
    assert refused.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kfac-hpc Run: error: run_dir: ")
    assert "holds another experiment" in lines[0]
    assert not (other / "error").exists() and (other / "preempted").exists()


def test_an_exception_in_the_loop_leaves_the_error_marker_and_goes_on(tmp_path):
    run = tmp_path / "run"

    def fail(step: int) -> None:
        if step == 3:
            raise ZeroDivisionError("the user's bug")

    with pytest.raises(ZeroDivisionError, match="the user's bug"):
        _train(run, "sgd", body=fail)
    assert "ZeroDivisionError: the user's bug" in (run / "error").read_text()
    summary = _json(run / "run.json")
    assert summary["state"] == "error" and "the user's bug" in summary["error"]
    assert not (run / "done").exists()


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KFAC_HPC_RUN_DIR", raising=False)
    cases = [
        ({}, "run_dir"),
        ({"run_dir": tmp_path / "r", "scaling": "diagonal"}, "scaling"),
        ({"run_dir": tmp_path / "r", "log_every": 0}, "log_every"),
        ({"run_dir": tmp_path / "r", "config": {"f": object()}}, "config"),
    ]
    for kwargs, field in cases:
        with pytest.raises(SystemExit) as exc:
            kfac_hpc.Run(**kwargs)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"kfac-hpc Run: error: {field}: "), err
    assert not (tmp_path / "r").exists()


def test_the_sweeps_run_dir_variable_names_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KFAC_HPC_RUN_DIR", str(tmp_path / "point"))
    _train(tmp_path / "ignored", "sgd")
    assert (tmp_path / "point" / "done").exists() and not (tmp_path / "ignored").exists()
