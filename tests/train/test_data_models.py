"""Data sources, deterministic sharding, the models and the learning-rate schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.data import ShardedBatches
from kfac_hpc.train.optimizers import learning_rate
from kfac_hpc.train.workloads import build_model, load_data


def _write_cifar_batch(path, labels, rng):
    records = np.zeros((len(labels), 3073), dtype=np.uint8)
    records[:, 0] = labels
    records[:, 1:] = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
    records.tofile(path)
    return records


def test_cifar10_binary_batches_are_read_exactly(tmp_path):
    rng = np.random.default_rng(0)
    first = _write_cifar_batch(tmp_path / "data_batch_1.bin", [3, 1, 4], rng)
    _write_cifar_batch(tmp_path / "data_batch_2.bin", [1, 5], rng)
    _write_cifar_batch(tmp_path / "test_batch.bin", [9, 2], rng)
    source = load_data(TrainConfig(dataset="cifar10", data_path=str(tmp_path)))
    assert (source.train_len, source.test_len, source.num_classes) == (5, 2, 10)
    x, y = source.train(torch.tensor([0, 4]))
    assert y.tolist() == [3, 5]
    # pixel (channel 1, row 2, col 3) of the first image, normalised as documented
    raw = first[0, 1 + 1024 + 2 * 32 + 3] / 255.0
    assert x[0, 1, 2, 3].item() == pytest.approx((raw - 0.4822) / 0.2435, abs=1e-6)


def test_digits_split_is_fixed_and_real():
    a = load_data(TrainConfig(dataset="digits", seed=1))
    b = load_data(TrainConfig(dataset="digits", seed=2))
    assert (a.train_len, a.test_len, a.shape, a.num_classes) == (1437, 360, (1, 8, 8), 10)
    idx = torch.arange(10)
    assert torch.equal(a.test(idx)[0], b.test(idx)[0])


def test_ranks_take_disjoint_parts_of_the_same_global_batch():
    source = load_data(TrainConfig(dataset="digits"))
    world = 4
    shards = [ShardedBatches(source, 64, r, world, seed=3, augment=False) for r in range(world)]
    single = ShardedBatches(source, 64, 0, 1, seed=3, augment=False)
    for epoch, step in ((0, 0), (1, 5)):
        parts = [s.batch(epoch, step) for s in shards]
        assert all(len(y) == 16 for _, y in parts)
        x_all, y_all = single.batch(epoch, step)
        assert torch.equal(torch.cat([x for x, _ in parts]), x_all)
        assert torch.equal(torch.cat([y for _, y in parts]), y_all)
    assert not torch.equal(single.batch(0, 0)[1], single.batch(1, 0)[1])
    tests = [torch.cat(s.test_batches(50)) for s in shards]
    assert sorted(torch.cat(tests).tolist()) == list(range(source.test_len))


def test_synthetic_data_is_fixed_by_the_seed():
    config = TrainConfig(dataset="synthetic_cifar", num_samples=64, seed=5)
    a, b = load_data(config), load_data(config)
    idx = torch.tensor([0, 7, 63])
    assert torch.equal(a.train(idx)[0], b.train(idx)[0])
    assert a.train(idx)[0].shape == (3, 3, 32, 32)


@pytest.mark.parametrize(
    ("name", "shape", "classes", "convs"),
    [
        ("small_cnn", (1, 8, 8), 10, 2),
        ("mlp", (1, 8, 8), 10, 0),
        ("resnet20", (3, 32, 32), 10, 19 + 2),
        ("resnet56", (3, 32, 32), 10, 55 + 2),
        ("resnet50", (3, 64, 64), 1000, 49 + 4),
    ],
)
def test_models_give_logits_and_have_their_depth(name, shape, classes, convs):
    model = build_model(TrainConfig(model=name), shape, classes)
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, classes)
    # conv count = depth - 1 (the classifier) + projection shortcuts (2 in CIFAR, 4 in ResNet-50)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) == convs


def test_learning_rate_warmup_step_and_cosine():
    step = TrainConfig(lr=1.0, lr_schedule="step", warmup_epochs=1, lr_decay_epochs=(2, 3))
    assert learning_rate(step, 0, 10, 100) == pytest.approx(0.1)
    assert learning_rate(step, 9, 10, 100) == pytest.approx(1.0)
    assert learning_rate(step, 25, 10, 100) == pytest.approx(0.1)
    assert learning_rate(step, 35, 10, 100) == pytest.approx(0.01)
    cosine = TrainConfig(lr=1.0, lr_schedule="cosine")
    assert learning_rate(cosine, 0, 10, 100) == 1.0
    assert learning_rate(cosine, 50, 10, 100) == pytest.approx(0.5)
    assert learning_rate(cosine, 75, 10, 100) == pytest.approx(0.5 * (1 + math.cos(0.75 * math.pi)))
