"""The task types of FOSI's paper as workloads (kfac_hpc/train/fosi_tasks.py): the digits and
MNIST-1D reconstruction data, the autoencoder, multinomial logistic regression, and the
evaluation of a regression; checked against independent numpy arithmetic, and one real job
run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.data import ShardedBatches, digits_arrays
from kfac_hpc.train.fosi_tasks import autoencoder, digits_reconstruction, logistic
from kfac_hpc.train.step import evaluate
from kfac_hpc.train.workloads import FactoryContext, build_model, load_data
from tests.conftest import clean_env

from .conftest import KFAC_HPC, explain

RECON = "kfac_hpc.train.fosi_tasks:digits_reconstruction"
RECON_1D = "kfac_hpc.train.fosi_tasks:mnist1d_reconstruction"
AE = "kfac_hpc.train.fosi_tasks:autoencoder"
LOGREG = "kfac_hpc.train.fosi_tasks:logistic"


def _ctx(**args: str) -> FactoryContext:
    return FactoryContext(TrainConfig(), args, 0, 1, None, (64,), 64)


def test_the_reconstruction_data_are_the_standardized_digits_as_their_own_targets() -> None:
    source = digits_reconstruction(_ctx())
    images, _ = digits_arrays()
    assert (source.train_len, source.test_len, source.shape) == (1437, 360, (64,))
    assert source.metric == "loss" and source.num_classes == 64
    x, y = source.train(torch.arange(source.train_len))
    assert torch.equal(x, y)  # the input is the target
    # per-pixel standardization over the training images (numpy, float64)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0)).numpy()
    raw = images[order[:1437]].astype(np.float64) / 16.0
    want = (raw - raw.mean(0)) / np.maximum(raw.std(0, ddof=1), 0.1)
    np.testing.assert_allclose(x.numpy(), want, rtol=0, atol=1e-5)
    out = torch.zeros_like(x)
    assert abs(source.loss(out, y).item() - float((want**2).mean())) < 1e-5


def test_the_mnist1d_reconstruction_data_are_mnist1d_standardized_as_their_own_targets() -> None:
    pytest.importorskip("mnist1d")
    source = load_data(TrainConfig(dataset=RECON_1D, num_samples=200))
    plain = load_data(TrainConfig(dataset="mnist1d", num_samples=200))
    assert (source.train_len, source.test_len) == (plain.train_len, plain.test_len) == (200, 50)
    assert source.shape == (40,) and source.num_classes == 40 and source.metric == "loss"
    x, y = source.train(torch.arange(source.train_len))
    xt, yt = source.test(torch.arange(source.test_len))
    assert torch.equal(x, y) and torch.equal(xt, yt)  # the input is the target
    # mnist1d's split, standardized per position with the training sequences' statistics
    # (numpy, float64)
    raw = plain.train(torch.arange(plain.train_len))[0].numpy().astype(np.float64)[:, 0, :]
    raw_test = plain.test(torch.arange(plain.test_len))[0].numpy().astype(np.float64)[:, 0, :]
    mean, std = raw.mean(0), raw.std(0, ddof=1)
    np.testing.assert_allclose(x.numpy(), (raw - mean) / std, rtol=0, atol=1e-5)
    np.testing.assert_allclose(xt.numpy(), (raw_test - mean) / std, rtol=0, atol=1e-5)


def test_the_autoencoder_maps_back_to_the_input_through_its_code() -> None:
    model = autoencoder(_ctx(widths="16-4"))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (64, 16), (16, 4), (4, 16), (16, 64)
    ]  # fmt: skip
    default = autoencoder(_ctx())
    assert sum(p.numel() for p in default.parameters()) == 25480  # 64-128-32-8-32-128-64
    assert default(torch.zeros(5, 64)).shape == (5, 64)


def test_logistic_regression_is_softmax_of_one_affine_map() -> None:
    ctx = FactoryContext(TrainConfig(), {}, 0, 1, None, (1, 8, 8), 10)
    model = logistic(ctx).double()
    (linear,) = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = torch.randn(7, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(7) % 10
    loss = torch.nn.functional.cross_entropy(model(x), y).item()
    w, b, xs = linear.weight.detach().numpy(), linear.bias.detach().numpy(), x.numpy()
    z = xs.reshape(7, 64) @ w.T + b
    logp = z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))[:, None]
    assert abs(loss - float(-logp[np.arange(7), y.numpy()].mean())) < 1e-12


def test_a_regression_is_evaluated_by_its_mean_squared_error_without_accuracy() -> None:
    config = TrainConfig(dataset=RECON, model=AE, model_arg=["widths=8-2"])
    source = load_data(config)
    model = build_model(config, source.shape, source.num_classes)
    batches = ShardedBatches(source, 64, 0, 1, 0, augment=False)
    loss, accuracy = evaluate(model, batches, torch.device("cpu"), 1)
    x, _ = source.test(torch.arange(source.test_len))
    with torch.no_grad():
        want = ((model(x).double() - x.double()) ** 2).mean().item()
    assert abs(loss - want) < 1e-6 and accuracy == 0.0


def test_the_job_trains_the_autoencoder_to_a_target_loss(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--dataset", RECON, "--model", AE, "--batch-size", "128", "--epochs", "3"]
    args += ["--no-progress", "--target-loss", "0.9", "--lr", "0.05"]
    proc = subprocess.run(
        [KFAC_HPC, "train", "--run-dir", str(run_dir), *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run_dir / "run.json").read_text())
    assert summary["metric"] == "loss" and summary["higher_is_better"] is False
    assert summary["final_accuracy"] == 0.0
    assert summary["final_test_loss"] < 0.9 and summary["step_to_target"] is not None
