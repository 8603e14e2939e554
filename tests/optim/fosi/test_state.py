"""FOSI state: state_dict()/load_state_dict() are exact inverses; the full (gathered) state
goes through a real HDF5 file (kfac_hpc.checkpoint.hdf5_tree) bit for bit.

Oracle: an uninterrupted run. A copy restored from the saved state at step 5 (after two ESEs,
with velocity, λ, V and base state) continues bit for bit like the original, through a third
ESE. (Re-sharding P -> P' is tested with real ranks in test_distributed.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from torch import nn

from kfac_hpc.checkpoint.hdf5_tree import read_tree, write_tree
from kfac_hpc.optim.fosi import FOSI


def _setup(base_name: str) -> tuple[nn.Module, FOSI]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    if base_name == "adam":
        base: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    return model, FOSI(model.parameters(), base, k=2, l=1, warmup=1, ese_every=3, model=model)


def _train(model: nn.Module, opt: FOSI, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (12,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step(lambda x=x, y=y: nn.functional.cross_entropy(model(x * 0.5), y))


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("base_name", ["sgd", "adam"])
def test_state_dict_round_trip_continues_bit_for_bit(base_name: str) -> None:
    model, opt = _setup(base_name)
    _train(model, opt, range(5))
    state = opt.state_dict()
    assert state["ese_count"] == 2 and state["eigenvectors"].shape == (3, 57)
    copy, restored = _setup(base_name)
    copy.load_state_dict(model.state_dict())
    restored.load_state_dict(state)
    assert restored.memory_usage() | {"lanczos_basis_bytes": 0} == opt.memory_usage() | {
        "lanczos_basis_bytes": 0
    }
    _train(model, opt, range(5, 9))
    _train(copy, restored, range(5, 9))
    assert _same(model, copy)
    assert restored.ese_count == 3 and torch.equal(restored.eigenvalues, opt.eigenvalues)


@pytest.mark.parametrize("base_name", ["sgd", "adam"])
def test_full_state_through_hdf5_continues_bit_for_bit(base_name: str, tmp_path: Path) -> None:
    model, opt = _setup(base_name)
    _train(model, opt, range(5))
    tree: dict[str, Any] = {"model": dict(model.state_dict()), "fosi": opt.full_state_dict()}
    with h5py.File(tmp_path / "state.h5", "w") as f:
        write_tree(f, tree)
    with h5py.File(tmp_path / "state.h5", "r") as f:
        loaded = read_tree(f)
    copy, restored = _setup(base_name)
    copy.load_state_dict(loaded["model"])
    restored.load_full_state_dict(loaded["fosi"])
    assert restored.state_dict().keys() == opt.state_dict().keys()
    _train(model, opt, range(5, 9))
    _train(copy, restored, range(5, 9))
    assert _same(model, copy)


def test_full_state_of_another_model_is_refused() -> None:
    model, opt = _setup("sgd")
    _train(model, opt, range(2))
    state = opt.full_state_dict()
    state["shapes"][0] = [7, 5]
    with pytest.raises(ValueError, match="shapes"):
        _setup("sgd")[1].load_full_state_dict(state)


def test_state_of_another_world_size_is_refused_naming_the_fix() -> None:
    _, opt = _setup("sgd")
    state = opt.state_dict() | {"world_size": 2}
    with pytest.raises(ValueError, match="load_full_state_dict"):
        opt.load_state_dict(state)
