"""MNIST-1D (generated locally by the mnist1d package) and the 1-D CNN K-FAC fully
preconditions."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.workloads import build_model, load_data

pytest.importorskip("mnist1d")


def test_mnist1d_is_generated_deterministically_without_touching_global_rngs() -> None:
    random.seed(5)
    np.random.seed(5)
    expected = (random.random(), np.random.rand())
    random.seed(5)
    np.random.seed(5)
    a = load_data(TrainConfig(dataset="mnist1d", model="cnn1d", num_samples=200, seed=1))
    assert (random.random(), np.random.rand()) == expected
    b = load_data(TrainConfig(dataset="mnist1d", model="cnn1d", num_samples=200, seed=2))
    assert (a.name, a.shape, a.num_classes) == ("mnist1d", (1, 40), 10)
    assert (a.train_len, a.test_len) == (200, 50)
    idx = torch.arange(50)
    xa, ya = a.test(idx)
    assert xa.shape == (50, 1, 40) and xa.dtype == torch.float32
    assert torch.equal(xa, b.test(idx)[0]) and torch.equal(ya, b.test(idx)[1])
    assert sorted(set(a.train(torch.arange(200))[1].tolist())) == list(range(10))


def test_cnn1d_is_fully_preconditioned_and_learns_mnist1d() -> None:
    """Every weight layer of the 1-D CNN is registered (3 Conv1d + 1 Linear); 60 K-FAC steps
    on 1,000 generated sequences lift training accuracy well above chance (10 %)."""
    source = load_data(TrainConfig(dataset="mnist1d", model="cnn1d", num_samples=1000))
    torch.manual_seed(0)
    model = build_model(TrainConfig(model="cnn1d"), source.shape, source.num_classes)
    pre = KFACPreconditioner(model, lr=0.05, damping=0.003, inv_update_steps=5)
    kinds = sorted(layer.kind for layer in pre.layers.values())
    assert kinds == ["Conv1d", "Conv1d", "Conv1d", "Linear"]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    registered = {id(layer.weight) for layer in pre.layers.values()}
    assert all(id(w) in registered for w in weights)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = source.train(torch.arange(1000))
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        idx = torch.randint(0, 1000, (64,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        pre.step()
        opt.step()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.4, accuracy


@pytest.mark.parametrize(
    ("dataset", "model"), [("mnist1d", "small_cnn"), ("digits", "cnn1d"), ("mnist1d", "resnet20")]
)
def test_model_and_dataset_must_fit(dataset: str, model: str) -> None:
    with pytest.raises(ConfigError, match=r"model: .* does not fit dataset"):
        TrainConfig(dataset=dataset, model=model).validate()
    TrainConfig(dataset=dataset, model="mlp").validate()


def test_mnist1d_cache_folder_holds_the_generated_sequences(tmp_path: Path) -> None:
    """With --data-path the first load writes the arrays there and later loads read them back:
    the same tensors as a fresh generation, no partial file left behind."""
    config = TrainConfig(dataset="mnist1d", model="cnn1d", num_samples=200, data_path=str(tmp_path))
    config.validate()
    fresh = load_data(TrainConfig(dataset="mnist1d", model="cnn1d", num_samples=200))
    first = load_data(config)
    assert [p.name for p in tmp_path.iterdir()] == ["mnist1d-250.npz"]
    with np.load(tmp_path / "mnist1d-250.npz") as stored:
        stored_y = torch.tensor(stored["y_test"], dtype=torch.int64)
    cached = load_data(config)
    train, test = torch.arange(200), torch.arange(50)
    for source in (first, cached):
        for got, want in zip(source.train(train), fresh.train(train), strict=True):
            assert torch.equal(got, want)
        for got, want in zip(source.test(test), fresh.test(test), strict=True):
            assert torch.equal(got, want)
    assert torch.equal(cached.test(torch.arange(50))[1], stored_y)


def test_mnist1d_cache_folder_must_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    config = TrainConfig(dataset="mnist1d", model="cnn1d", data_path=str(missing))
    with pytest.raises(ConfigError, match=r"data_path: .* is not a directory"):
        config.validate()


@pytest.mark.parametrize("channels", [8, 64])
def test_cnn1d_channels_sets_every_convolution_width(channels: int) -> None:
    model = build_model(TrainConfig(model="cnn1d", cnn1d_channels=channels), (1, 40), 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    assert [c.out_channels for c in convs] == [channels] * 3
    assert [c.in_channels for c in convs] == [1, channels, channels]
    assert model(torch.zeros(2, 1, 40)).shape == (2, 10)
