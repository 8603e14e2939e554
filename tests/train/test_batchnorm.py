"""BatchNorm statistics recomputed for a test evaluation (train/batchnorm.py, the job's
--precise-bn-batches): the plain average over the given batches, checked against the layer's
input computed by hand; training's own statistics back afterwards; and in the job, the
evaluation it records equals an independent recomputation from its checkpoint, with training
untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.train.batchnorm import recomputed_batchnorm
from kfac_hpc.train.config import load_config
from kfac_hpc.train.data import ShardedBatches
from kfac_hpc.train.step import evaluate
from kfac_hpc.train.workloads import build_model, load_data

from .conftest import explain_here, train_here


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


def test_statistics_are_the_plain_average_over_the_batches_and_come_back() -> None:
    model = _net().double()
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):  # some training history: running statistics of their own
        model(torch.randn(16, 5, generator=gen, dtype=torch.float64))
    model.eval()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    batches = [torch.randn(n, 5, generator=gen, dtype=torch.float64) * 3 + 1 for n in (8, 12, 20)]
    with torch.no_grad():  # the oracle: the layer's input, by hand
        inputs = [model[0](x) for x in batches]
    want_mean = torch.stack([h.mean(0) for h in inputs]).mean(0)
    want_var = torch.stack([h.var(0, unbiased=True) for h in inputs]).mean(0)
    with recomputed_batchnorm(model, batches) as used:
        assert used == 3
        assert torch.allclose(bn.running_mean, want_mean, rtol=1e-12, atol=1e-12)
        assert torch.allclose(bn.running_var, want_var, rtol=1e-12, atol=1e-12)
        assert int(bn.num_batches_tracked) == 3
    assert not model.training and bn.momentum == 0.1
    for key, value in bn.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_no_batchnorm_runs_nothing_and_empty_inputs_are_refused() -> None:
    plain = nn.Sequential(nn.Linear(5, 3))

    def never() -> list[torch.Tensor]:
        raise AssertionError("no forward is needed without a BatchNorm layer")

    with recomputed_batchnorm(plain, iter(()), forward=lambda x: never()) as used:
        assert used == 0
    model = _net()
    before = {k: v.clone() for k, v in model[1].state_dict().items()}
    with pytest.raises(ValueError, match="inputs gave no batch"), recomputed_batchnorm(model, []):
        pass
    for key, value in model[1].state_dict().items():
        assert torch.equal(value, before[key]), key


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _eval_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(run_dir) if r["kind"] == "eval"}


def _train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _records(run_dir) if r["kind"] != "eval"]


def test_the_job_tests_with_recomputed_statistics_and_trains_as_without(tmp_path: Path) -> None:
    """resnet20 (BatchNorm) on digits, 22 steps, 3 batches: the evaluation at step 22 equals
    the test loss of the checkpoint's model with its statistics recomputed here from the
    job's batches 0-2 of epoch 1; the training losses and the checkpoint (with training's own
    statistics) equal a run without the option."""
    args = ["--model", "resnet20", "--epochs", "1", "--checkpoint-every", "22", "--no-kfac"]
    plain, precise = tmp_path / "plain", tmp_path / "precise"
    result = train_here(plain, *args)
    assert result.exit_code == 0, explain_here(result)
    result = train_here(precise, *args, "--precise-bn-batches", "3")
    assert result.exit_code == 0, explain_here(result)
    assert _train_losses(precise) == _train_losses(plain)
    saved = {
        run: load_checkpoint(run / "checkpoints" / "ckpt-00000022.h5").tree["model"]
        for run in (plain, precise)
    }
    for name, entries in saved[plain].items():
        for key, value in entries.items():
            assert torch.equal(value, saved[precise][name][key]), f"{name}.{key}"

    config = load_config(None, {"model": "resnet20", "dataset": "digits", "batch_size": 64})
    source = load_data(config)
    model = build_model(config, source.shape, source.num_classes)
    state = {f"{m}.{k}": t for m, entries in saved[precise].items() for k, t in entries.items()}
    model.load_state_dict(state)
    batches = ShardedBatches(source, 64, 0, 1, config.seed, augment=False)
    inputs = [batches.batch(1, index)[0] for index in range(3)]
    with recomputed_batchnorm(model, inputs):
        want, _ = evaluate(model, batches, torch.device("cpu"), 1)
    stale, _ = evaluate(model, batches, torch.device("cpu"), 1)
    assert abs(want - stale) > 1e-3 * stale  # the two evaluations can be told apart
    assert _eval_losses(precise)[22] == pytest.approx(want, rel=1e-5)
    assert _eval_losses(plain)[22] == pytest.approx(stale, rel=1e-5)
