"""The transformer workload: the gpt model, the byte-level datasets, K-FAC on its 3-D Linear
inputs (against a dense float64 oracle), training through ``kfac-hpc train`` and --precision."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.cli import main
from kfac_hpc.train import precision as precision_module
from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.data import ShardedBatches, cross_entropy
from kfac_hpc.train.text_data import generated_corpus, generated_text, text_files
from kfac_hpc.train.transformer import GPT, GPTSizes
from kfac_hpc.train.workloads import load_data

from .conftest import metrics, read_json

# A model that trains in seconds on 2 busy cores: 1 block of width 32 over 32-byte windows.
TINY = ["--model", "gpt", "--dataset", "generated_text", "--num-samples", "1024"]
TINY += ["--gpt-layers", "1", "--gpt-d-model", "32", "--context-length", "32"]
TINY += ["--batch-size", "16", "--lr-schedule", "constant", "--no-progress"]
STEPS = 40
# The generated corpus's byte entropy is 2.92 nats without context (unigram) and 1.52 given
# the previous byte (both measured on 200 kB of it); ln 256 = 5.55 is the untrained model's.
# Below 2.5 the model uses context: measured 1.69-1.87 at step 40 for both settings below.
LOSS_BOUND = 2.5


def _train(run_dir: Path, *args: str) -> dict[str, Any]:
    argv = ["train", "--run-dir", str(run_dir), *TINY, "--steps", str(STEPS)]
    argv += ["--eval-every-steps", "20", "--log-every", "20", *args]
    result = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return read_json(run_dir / "run.json")


def _validation_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in metrics(run_dir) if r.get("kind") == "eval"]


# --- the model and the data --------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_is_causal_and_returns_next_byte_logits(tied: bool) -> None:
    torch.manual_seed(0)
    model = GPT(GPTSizes(layers=2, d_model=16, heads=2, context=8, tied=tied))
    x = torch.randint(0, 256, (3, 8))
    logits = model(x)
    assert logits.shape == (3, 8, 256)
    changed = x.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 256
    after = model(changed)
    assert torch.equal(logits[:, :5], after[:, :5])  # no position sees a later byte
    assert not torch.allclose(logits[:, 5:], after[:, 5:])
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * 6 + (0 if tied else 1)  # q, k, v, proj, 2 MLP; the head


def test_text_windows_are_next_byte_pairs_and_the_split_is_fixed(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(bytes(range(200)))
    (tmp_path / "a.txt").write_bytes(bytes(range(100, 0, -1)))
    (tmp_path / ".hidden").write_bytes(b"x" * 1000)  # left out
    source = text_files(tmp_path, 10)
    data = bytes(range(100, 0, -1)) + bytes(range(200))  # sorted path order
    train_bytes = data[: 300 - 30]
    assert (source.train_len, source.test_len) == ((270 - 1) // 10, (30 - 1) // 10)
    x, y = source.train(torch.tensor([0, 3]))
    assert x.shape == y.shape == (2, 10) and x.dtype == torch.int64
    assert x[1].tolist() == list(train_bytes[30:40]) and y[1].tolist() == list(train_bytes[31:41])
    tx, ty = source.test(torch.tensor([1]))
    assert tx[0].tolist() == list(data[280:290]) and ty[0].tolist() == list(data[281:291])
    assert text_files(tmp_path / "a.txt", 4).train_len == (90 - 1) // 4  # one file
    with pytest.raises(ValueError, match="needs at least"):
        text_files(tmp_path / "a.txt", 50)


def test_generated_corpus_is_deterministic_text_with_exact_window_counts() -> None:
    assert generated_corpus(5000) == generated_corpus(5000)
    assert generated_corpus(5000).decode("ascii").count(".") > 50
    source = generated_text(90, 16)
    assert (source.train_len, source.test_len) == (90, 10)
    assert source.shape == (16,) and source.num_classes == 256


def test_sharded_text_batches_depend_only_on_seed_epoch_step_and_rank() -> None:
    config = TrainConfig(model="gpt", dataset="generated_text", num_samples=64, context_length=8)
    source = load_data(config)
    whole = ShardedBatches(source, 8, 0, 1, seed=3, augment=True)
    parts = [ShardedBatches(load_data(config), 8, r, 2, seed=3, augment=True) for r in (0, 1)]
    x, y = whole.batch(1, 2)
    halves = [p.batch(1, 2) for p in parts]
    assert torch.equal(x, torch.cat([h[0] for h in halves]))
    assert torch.equal(y, torch.cat([h[1] for h in halves]))
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte


def test_text_needs_a_path_and_gpt_only_text(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data_path: .*--data-path"):
        TrainConfig(model="gpt", dataset="text").validate()
    with pytest.raises(ConfigError, match=r"^model: .*--model gpt"):
        TrainConfig(model="mlp", dataset="generated_text").validate()
    with pytest.raises(ConfigError, match=r"^model: .*--model gpt"):
        TrainConfig(model="gpt", dataset="digits").validate()
    with pytest.raises(ConfigError, match=r"^gpt_d_model: .*--gpt-heads"):
        TrainConfig(model="gpt", dataset="generated_text", gpt_d_model=30).validate()
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(generated_corpus(3000))
    TrainConfig(model="gpt", dataset="text", data_path=str(corpus)).validate()  # a file


# --- K-FAC on batch x sequence x features ------------------------------------------------


def test_kfac_factors_of_every_gpt_linear_equal_a_dense_oracle() -> None:
    """One factor step on a float64 2-block decoder: each Linear's A = (1/(N·T)) Σ a aᵀ (bias
    as a one) and G = (1/N) Σ (N g)(N g)ᵀ over all N·T positions (docs/kfac.md, expand), with
    a and g taken by independent hooks and autograd."""
    torch.manual_seed(0)
    model = GPT(GPTSizes(layers=2, d_model=8, heads=2, context=5)).double()
    x, y = torch.randint(0, 256, (3, 5)), torch.randint(0, 256, (3, 5))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            inputs[name], outputs[name] = args[0].detach(), out

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in linears.items()]
    loss = cross_entropy(model(x), y)
    grads = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values())), strict=True))
    for handle in handles:
        handle.remove()
    pre = KFACPreconditioner(model, factor_decay=0.5, damping=1e-3, kl_clip=None)
    assert set(pre.layers) == set(linears)  # embeddings and LayerNorms are not registered
    cross_entropy(model(x), y).backward()
    pre.step()
    n = x.shape[0]
    for name, module in linears.items():
        a = inputs[name].reshape(-1, module.in_features)
        assert a.shape[0] == 3 * 5  # every position is a row
        if module.bias is not None:
            a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        g = grads[name].reshape(-1, module.out_features) * n
        dense_a = sum(torch.outer(r, r) for r in a) / len(a)
        dense_g = sum(torch.outer(r, r) for r in g) / n
        factors = pre.factors[name]
        assert factors.A is not None and factors.G is not None
        torch.testing.assert_close(factors.A, dense_a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(factors.G, dense_g, rtol=1e-10, atol=1e-12)


# --- training through kfac-hpc train -----------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [["--kfac", "--lr", "0.3"], ["--no-kfac", "--optimizer", "adam", "--lr", "0.01"]],
    ids=["sgd-kfac", "adam"],
)
def test_training_lowers_the_validation_loss_below_the_bound(
    tmp_path: Path, method: list[str]
) -> None:
    facts = _train(tmp_path / "run", *method)
    losses = _validation_losses(tmp_path / "run")
    assert len(losses) == 2, losses  # steps 20 and 40
    assert losses[-1] < LOSS_BOUND, losses
    assert facts["kfac"] == (method[0] == "--kfac")
    if facts["kfac"]:
        skipped = facts["kfac_skipped_modules"]
        assert skipped == {
            "embed": "Embedding",
            "position": "Embedding",
            "blocks.0.ln1": "LayerNorm",
            "blocks.0.ln2": "LayerNorm",
            "ln_f": "LayerNorm",
        }
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"] == "gpt" and config["precision"] == "fp32"


def test_fosi_runs_on_the_transformer(tmp_path: Path) -> None:
    """FOSI's extreme-spectrum estimation takes Hessian-vector products through attention
    (a second derivative of it): one ESE at step 3 finds k positive eigenvalues."""
    argv = ["--fosi", "--lr", "0.1", "--fosi-k", "2", "--lanczos-iters", "8"]
    argv += ["--fosi-residual-tol", "1"]  # every Ritz pair kept: 8 Lanczos steps converge few
    argv += ["--fosi-warmup", "3", "--ese-every", "100", "--steps", "6"]
    facts = _train(tmp_path / "run", *argv)
    assert facts["state"] == "done" and facts["ese_count"] == 1
    assert len(facts["fosi_eigenvalues"]) == 2 and min(facts["fosi_eigenvalues"]) > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_on_cpu_with_float32_factors(
    tmp_path: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 autocast, and fp16 autocast with loss scaling (torch >= 2.3 has it on CPUs): the
    loss falls, parameters and K-FAC factors stay float32, the config records the choice."""
    seen: list[torch.dtype] = []
    head_g: list[float] = []  # the head's G trace after each run's first step
    original = KFACPreconditioner.step

    def step(self: KFACPreconditioner) -> None:
        original(self)
        seen.extend(t.dtype for f in self.factors.values() for t in (f.A, f.G) if t is not None)
        if self.steps == 1:
            g = self.factors["head"].G
            assert g is not None
            head_g.append(float(g.trace()))

    monkeypatch.setattr(KFACPreconditioner, "step", step)
    _train(tmp_path / "run", "--kfac", "--lr", "0.3", "--precision", precision)
    losses = _validation_losses(tmp_path / "run")
    assert losses[-1] < LOSS_BOUND, losses
    assert seen and set(seen) == {torch.float32}
    # The first G equals float32's within rounding: under fp16 the loss scale is divided out.
    _train(tmp_path / "fp32", "--kfac", "--lr", "0.3", "--steps", "1")
    assert head_g[0] == pytest.approx(head_g[1], rel=0.05), head_g
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["precision"] == precision
    assert read_json(tmp_path / "run" / "run.json")["precision"] == precision


def test_fp16_without_loss_scaling_on_this_device_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where torch has no GradScaler for the device (CPUs before torch 2.3), --precision fp16
    is one line naming the flag, exit 2, and no run is started."""

    def unavailable(device: str) -> None:
        raise RuntimeError(f"no GradScaler for {device}")

    monkeypatch.setattr(precision_module.torch.amp, "GradScaler", unavailable)
    argv = ["train", "--run-dir", str(tmp_path / "run"), *TINY, "--steps", "2"]
    result = CliRunner().invoke(main, [*argv, "--precision", "fp16"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--precision" in lines[0] and "bf16" in lines[0], result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fp16_with_fosi_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^precision: .*--precision bf16"):
        TrainConfig(fosi=True, precision="fp16").validate()
