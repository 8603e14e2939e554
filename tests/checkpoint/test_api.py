"""The API the job uses, in one process: capture/restore, retention, no pickle, locking off,
plain HDF5 tools, the CLI, and warm starts."""

from __future__ import annotations

import pickle
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kfac_hpc.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    DataPosition,
    capture_training_state,
    init_factors_from,
    load_checkpoint,
    restore_training_state,
)
from kfac_hpc.checkpoint.files import list_checkpoints, locking_mode, read_latest
from kfac_hpc.cli import main
from kfac_hpc.optim import KFACPreconditioner


def _model(hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, hidden), nn.ReLU(), nn.BatchNorm1d(hidden), nn.Linear(hidden, 3)
    )


def _train(model, opt, kfac, steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()


def _save(directory: Path, steps: int, keep: int = 3, hidden: int = 8) -> CheckpointManager:
    model = _model(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kfac = KFACPreconditioner(model, inv_update_steps=2)
    manager = CheckpointManager(directory, keep=keep)
    for step in range(1, steps + 1):
        _train(model, opt, kfac, 1)
        manager.save(
            capture_training_state(
                step=step,
                model=model,
                optimizer=opt,
                preconditioner=kfac,
                data_position=DataPosition(0, step, 11),
                config={"lr": 0.01, "model": "mlp"},
                config_hash="abc123",
            )
        )
    return manager


def test_restore_puts_back_every_part(tmp_path):
    _save(tmp_path, 3)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kfac = KFACPreconditioner(model, inv_update_steps=2)
    ckpt = load_checkpoint(tmp_path)
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    restored = restore_training_state(ckpt, model=model, optimizer=opt, preconditioner=kfac)
    assert restored.step == 3 and restored.data_position == DataPosition(0, 3, 11)
    assert restored.config == {"lr": 0.01, "model": "mlp"} and restored.config_hash == "abc123"
    assert restored.rng_restored and restored.saved_world_size == 1
    saved = ckpt.tree
    assert torch.equal(model[2].running_mean, saved["model"]["2"]["running_mean"])
    assert int(model[2].num_batches_tracked) == 3
    assert torch.equal(
        opt.state_dict()["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"]
    )
    assert kfac.steps == 3
    assert torch.equal(torch.get_rng_state(), saved["ranks"]["0"]["rng"]["torch_cpu"])
    assert ckpt.tree["versions"]["torch"] == torch.__version__


def test_retention_keeps_the_last_k_and_latest_names_the_newest(tmp_path):
    _save(tmp_path, 5, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000005.h5", "ckpt-00000004.h5"]
    assert read_latest(tmp_path) == tmp_path / "ckpt-00000005.h5"


def test_nothing_on_the_load_path_unpickles(tmp_path, monkeypatch):
    _save(tmp_path, 2)

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling on the load path")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(np, "load", forbidden)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    kfac = KFACPreconditioner(model)
    ckpt = CheckpointManager(tmp_path).load_latest()
    assert ckpt is not None
    restore_training_state(ckpt, model=model, optimizer=opt, preconditioner=kfac)
    assert init_factors_from(tmp_path, kfac) == 2


def test_works_with_hdf5_file_locking_off(tmp_path, monkeypatch):
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "FALSE")
    assert locking_mode() is False
    _save(tmp_path, 1)
    assert load_checkpoint(tmp_path).step == 1
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING")
    assert locking_mode() == "best-effort" and locking_mode(True) is True


@pytest.mark.usefixtures("hdf5_tools")
def test_h5ls_and_h5dump_read_a_checkpoint(tmp_path):
    _save(tmp_path, 1)
    path = read_latest(tmp_path)
    ls = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    for expected in ("/kfac_state/layers/0/A", "/model/3/weight", "/ranks/0/rng/torch_cpu"):
        assert expected in ls.stdout
    dump = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True, timeout=60)
    assert dump.returncode == 0, dump.stderr
    for attribute in ("schema_version", "complete", "step", "world_size", "config_hash"):
        assert f'ATTRIBUTE "{attribute}"' in dump.stdout


def test_cli_inspect_and_verify(tmp_path):
    _save(tmp_path / "checkpoints", 2)
    runner = CliRunner()
    result = runner.invoke(main, ["checkpoint", "inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "step:        2" in result.output and "valid:       yes" in result.output
    assert "K-FAC layers (2)" in result.output
    result = runner.invoke(main, ["checkpoint", "verify", str(tmp_path)])
    assert result.exit_code == 0 and "ok:" in result.output
    path = read_latest(tmp_path / "checkpoints")
    assert path is not None
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)  # zero the second half
    path.write_bytes(bytes(raw))
    result = runner.invoke(main, ["checkpoint", "verify", str(path)])
    assert result.exit_code == 1 and "corrupt" in result.output
    result = runner.invoke(main, ["checkpoint", "verify", str(tmp_path / "missing.h5")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_init_factors_loads_only_the_factors(tmp_path):
    _save(tmp_path, 3)
    model = _model()
    kfac = KFACPreconditioner(model)
    assert init_factors_from(tmp_path, kfac) == 2
    saved = load_checkpoint(tmp_path).tree["kfac_state"]["layers"]
    state = kfac.state_dict()
    assert state["steps"] == 0  # counters and schedules are the new run's
    for name in ("0", "3"):
        assert torch.equal(state["layers"][name]["A"], saved[name]["A"])
        assert torch.equal(state["layers"][name]["G"], saved[name]["G"])


def test_k_fac_factors_of_another_model_are_refused_naming_the_layer(tmp_path):
    _save(tmp_path, 1)
    model = _model(hidden=5)
    kfac = KFACPreconditioner(model)
    with pytest.raises(CheckpointMismatchError, match=r"layer '0' factor G: shape \(8, 8\)"):
        init_factors_from(tmp_path, kfac)
