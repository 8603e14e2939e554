"""The method interface: a method defined only here registers, runs through the real job
(`kfac-hpc train`, in-process), records its own phase, checkpoints its state and resumes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from kfac_hpc.checkpoint import load_checkpoint
from kfac_hpc.cli import main
from kfac_hpc.contracts.method_state import MethodState, SavedState, UnitShapes
from kfac_hpc.train import job
from kfac_hpc.train.methods import (
    CurvatureLoss,
    Method,
    MethodSetup,
    build_method,
    register,
    registered,
    registry,
)
from kfac_hpc.train.timing import PhaseTimer

from .conftest import QUICK, metrics, read_json

STEPS, SAVE = 6, 3


class SignDescent(Method):
    """SGD on the sign of the gradient; every other step it also evaluates the curvature loss.
    Its state: a step counter, the running sum of |grad| per parameter, and a per-rank shard."""

    name = "sign_descent"
    phases = ("sign", "optimizer")

    def __init__(self, setup: MethodSetup) -> None:
        params = list(setup.model.parameters())
        super().__init__(torch.optim.SGD(params, lr=setup.config.lr * 0.01))
        self.params = dict(setup.model.named_parameters())
        self.calls = 0
        self.curvature_losses: list[float] = []
        self.abs_grad = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.loaded_shards: list[dict[str, Any]] | None = None

    def step(self, timer: PhaseTimer, curvature_loss: CurvatureLoss) -> None:
        if self.calls % 2 == 0:
            self.curvature_losses.append(float(curvature_loss().detach()))
        with torch.no_grad():
            for name, p in self.params.items():
                assert p.grad is not None
                self.abs_grad[name] += p.grad.abs()
                p.grad.sign_()
        timer.lap("sign")
        self.optimizer.step()
        timer.lap("optimizer")
        self.calls += 1

    # -- the checkpoint's view (kfac_hpc.contracts.method_state.Checkpointable)
    label = "sign descent"
    state_group = "sign_state"
    shard_group = "sign_shard"

    @property
    def state(self) -> SignDescent:
        return self

    def checkpoint_state(self, include_shard: bool = True) -> MethodState:
        units = {n: {"abs_grad": t.clone()} for n, t in self.abs_grad.items()}
        shard = {"calls_seen_here": self.calls} if include_shard else {}
        return MethodState({"calls": self.calls, "units": units}, shard, "replicated")

    def expected_shapes(self) -> UnitShapes:
        shapes = {n: {"abs_grad": tuple(p.shape)} for n, p in self.params.items()}
        return UnitShapes(("units",), shapes, unit="parameter", entry="tensor")

    def load_checkpoint_state(self, saved: SavedState) -> None:
        self.calls = int(saved.shared["calls"])
        for name, entry in saved.shared["units"].items():
            self.abs_grad[name].copy_(entry["abs_grad"])
        self.loaded_shards = saved.shards

    def warm_start(self, saved: SavedState) -> int:
        return 0

    def run_facts(self) -> dict[str, Any]:
        return {
            "sign_calls": self.calls,
            "curvature_losses": len(self.curvature_losses),
            "loaded_shards": None
            if self.loaded_shards is None
            else [int(s["calls_seen_here"]) for s in self.loaded_shards],
        }


@pytest.fixture
def sign_descent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the method and make the job choose it. The job picks ``kfac`` or
    ``first_order`` from ``--kfac``; until a ``--method`` option names any registered method,
    the test replaces that choice where the job makes it."""
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    register(SignDescent.name, SignDescent)
    monkeypatch.setattr(job, "method_name", lambda config: SignDescent.name)


def _train(run_dir: Path, *args: str) -> dict[str, Any]:
    argv = ["train", "--run-dir", str(run_dir), *QUICK, "--steps", str(STEPS), "--no-progress"]
    result = CliRunner().invoke(main, [*argv, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return read_json(run_dir / "run.json")


@pytest.mark.usefixtures("sign_descent")
def test_a_new_method_runs_through_the_job_checkpoints_and_resumes(tmp_path: Path) -> None:
    assert "sign_descent" in registered() and {"kfac", "first_order"} <= set(registered())
    first = _train(tmp_path / "a", "--checkpoint-every", str(SAVE), "--log-every", "3")
    assert first["state"] == "done" and first["method"] == "sign_descent"
    assert first["sign_calls"] == STEPS and first["curvature_losses"] == STEPS // 2
    assert first["loaded_shards"] is None
    train = [r for r in metrics(tmp_path / "a") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6]
    assert all(r["phases_s"]["sign"] > 0 and len(r["rank_phases_s"]["sign"]) == 1 for r in train)
    assert first["phases_s"]["sign"] > 0

    saved = load_checkpoint(tmp_path / "a" / "checkpoints" / f"ckpt-{SAVE:08d}.h5").tree
    assert saved["sign_state"]["calls"] == SAVE and saved["strategy"] == "replicated"
    assert saved["ranks"]["0"]["sign_shard"] == {"calls_seen_here": SAVE}
    units = saved["sign_state"]["units"]
    assert units and all(float(e["abs_grad"].sum()) > 0 for e in units.values())

    resumed = _train(
        tmp_path / "b",
        "--resume-from",
        str(tmp_path / "a" / "checkpoints" / f"ckpt-{SAVE:08d}.h5"),
        "--checkpoint-every",
        str(SAVE),
    )
    assert resumed["loaded_shards"] == [SAVE], "every saved rank's shard came back"
    assert resumed["sign_calls"] == STEPS, "the counter continued from the checkpoint"
    end_a = load_checkpoint(tmp_path / "a").tree
    end_b = load_checkpoint(tmp_path / "b").tree
    assert end_b["step"] == end_a["step"] == STEPS
    for name, entry in end_a["sign_state"]["units"].items():
        assert torch.equal(entry["abs_grad"], end_b["sign_state"]["units"][name]["abs_grad"])
    for module, params in end_a["model"].items():
        for key, tensor in params.items():
            assert torch.equal(tensor, end_b["model"][module][key]), (module, key)


def test_an_unknown_method_names_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown method 'nope'; registered: .*kfac"):
        build_method("nope", None)  # type: ignore[arg-type]


def test_a_name_is_registered_once(sign_descent: None) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(SignDescent.name, lambda setup: SignDescent(setup))
