"""Modules timed inside the model's own passes, on a fake clock: modules that advance it by a
known cost per call (forward and backward) come out as exactly those costs, the kind fit over
them recovers the coefficients that made them, what hooks add to the backward is taken off,
the whole-pass error against hand arithmetic, the kept source is the closer one, and the
K-FAC forward hook's cost per layer priced in a factor step's forward (hand arithmetic), old
profiles loading without it, a bad value one line exit 2."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kfac_hpc.cli import main
from kfac_hpc.plan import layer_rates as rates
from kfac_hpc.plan import pass_timing
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import model_shape
from kfac_hpc.plan.module_fits import ModuleFit, fit_module
from kfac_hpc.plan.pass_timing import PassTiming, pass_error, points_by_kind, time_in_pass
from kfac_hpc.plan.profiles import MachineProfile, load_profile
from tests.plan.test_cli_input import write_profile

LINEAR = ModuleFit((2e-5, 3e-10, 4e-8), (5e-5, 6e-10, 1e-7))
ACTIVATION = ModuleFit((3e-6, 0.0, 5e-8), (6e-6, 0.0, 2e-8))


class Clock:
    """A clock that moves only when a module says so."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Advance(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: Clock, seconds: float) -> torch.Tensor:
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.t += ctx.seconds
        return grad, None, None


def _costly(base: type[nn.Module], fit: ModuleFit, clock: Clock) -> type[nn.Module]:
    """``base`` whose calls cost ``fit``'s seconds on ``clock`` (forward when called, backward
    when its output's gradient passes)."""

    class Costly(base):  # type: ignore[valid-type, misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            flops = 2.0 * out.numel() * x.shape[-1] if isinstance(self, nn.Linear) else 0.0
            forward, backward = fit.seconds(flops, x.numel() + out.numel())
            clock.t += forward
            return _Advance.apply(out, clock, backward)

    return Costly


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(pass_timing.time, "perf_counter", fake)
    return fake


def _net(clock: Clock) -> nn.Module:
    linear, relu = _costly(nn.Linear, LINEAR, clock), _costly(nn.ReLU, ACTIVATION, clock)
    return nn.Sequential(linear(8, 32), relu(), linear(32, 16), relu(), linear(16, 4))


def test_in_pass_points_are_the_injected_costs_and_the_fit_recovers_them(clock: Clock) -> None:
    timings = time_in_pass(_net(clock), (8,), (4, 16, 64), torch.device("cpu"), passes=3)
    for timing in timings:
        b = timing.batch
        # (in, out) of each linear layer, the activations' widths, worked out by hand
        linears = [(8, 32), (32, 16), (16, 4)]
        expected = [
            ("linear", 2.0 * b * n_out * n_in, b * (n_in + n_out)) for n_in, n_out in linears
        ]
        expected[1:1] = [("activation", 0.0, 2 * b * 32)]
        expected[3:3] = [("activation", 0.0, 2 * b * 16)]
        got = list(timing.points)
        assert [(k, p[0], p[1]) for k, p in got] == expected
        for kind, (flops, elements, forward, backward) in got:
            fit = LINEAR if kind == "linear" else ACTIVATION
            truth = fit.seconds(flops, elements)
            assert (forward, backward) == pytest.approx(truth, rel=1e-9)
        # nothing outside the modules on this clock: the sums are the pass, hooks add none
        assert timing.modules == pytest.approx(timing.plain, rel=1e-9)
        assert timing.hooked == pytest.approx(timing.plain, rel=1e-9)
    by_kind = points_by_kind(timings)
    for kind, fit in (("linear", LINEAR), ("activation", ACTIVATION)):
        got = fit_module(by_kind[kind])
        for mine, truth in zip(got.row(), fit.row(), strict=True):
            assert mine == pytest.approx(truth, rel=1e-6, abs=1e-18)
    assert pass_error({"linear": LINEAR, "activation": ACTIVATION}, timings) < 1e-9


def test_what_the_backward_hooks_add_is_taken_off_each_call(
    clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hooked backward call costs 10 µs more on the clock: 5 calls, 50 µs more a pass,
    spread back over the calls."""
    hook = 1e-5
    grad_post = pass_timing._Recorder.grad_post

    def slower(self: Any, module: nn.Module, *args: Any) -> None:
        clock.t += hook
        grad_post(self, module, *args)

    monkeypatch.setattr(pass_timing._Recorder, "grad_post", slower)
    (timing,) = time_in_pass(_net(clock), (8,), (16,), torch.device("cpu"), passes=3)
    assert timing.hooked[1] - timing.plain[1] == pytest.approx(5 * hook, rel=1e-9)
    for kind, (flops, elements, _, backward) in timing.points:
        fit = LINEAR if kind == "linear" else ACTIVATION
        assert backward == pytest.approx(fit.seconds(flops, elements)[1], rel=1e-9)


def test_the_pass_error_by_hand() -> None:
    """Two calls priced 1 + 2 ms forward, 3 + 1 ms backward against a pass of 2 and 8 ms:
    mean(|log 3/2|, |log 4/8|)."""
    fits = {"linear": ModuleFit((1e-3, 0.0, 0.0), (3e-3, 0.0, 0.0))}
    fits["view"] = ModuleFit((2e-3, 0.0, 0.0), (1e-3, 0.0, 0.0))
    timing = PassTiming(
        8,
        (("linear", (1.0, 1.0, 1.0, 1.0)), ("view", (0.0, 1.0, 1.0, 1.0))),
        (2e-3, 8e-3),
        (0.0, 0.0),
        (0.0, 0.0),
    )
    assert pass_error(fits, [timing]) == pytest.approx((math.log(1.5) + math.log(2)) / 2)


def test_calibrate_keeps_the_source_that_prices_the_passes_closer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Alone points twice the in-pass ones: the in-pass fit prices the passes (the in-pass
    sums) exactly and is kept, the alone fit is written beside it; with the passes twice as
    slow, the alone fit is kept."""
    in_pass = [("linear", (f, e, 1e-4 + f * 1e-10, 2e-4 + e * 1e-9)) for f, e in _SHAPES]
    alone = [(f, e, 2 * s, 2 * b) for _, (f, e, s, b) in in_pass]
    monkeypatch.setattr(rates, "module_points", lambda samples, device: alone)
    sums = (sum(p[2] for _, p in in_pass), sum(p[3] for _, p in in_pass))
    timing = PassTiming(16, tuple(in_pass), sums, sums, sums)
    chosen = rates.module_fits(torch.device("cpu"), (), [timing])
    assert chosen.source == "in-pass" and chosen.errors["in-pass"] < 1e-6
    assert chosen.fits["linear"] == fit_module([p for _, p in in_pass])
    assert chosen.other["linear"] == fit_module(alone)
    assert any(line.startswith("# alone: linear = [") for line in chosen.notes())
    slow = PassTiming(16, tuple(in_pass), (2 * sums[0], 2 * sums[1]), sums, sums)
    assert rates.module_fits(torch.device("cpu"), (), [slow]).source == "alone"


_SHAPES = ((1e5, 1e3), (1e6, 4e3), (1e7, 2e3), (4e7, 3e4))


def test_a_factor_step_forward_prices_the_hook_per_layer_by_hand() -> None:
    """The small CNN has 4 K-FAC layers: 4 × 25 µs more forward on a factor step."""
    shape = model_shape("small_cnn", "digits")
    assert len(shape.layers) == 4
    machine = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, kfac_forward_layer_s=25e-6)
    costs = RatedCompute(machine, shape)
    with_kfac, without = costs.forward_backward_s(64, kfac=True), costs.forward_backward_s(64)
    assert with_kfac[0] - without[0] == pytest.approx(4 * 25e-6, rel=1e-12)
    unmeasured = RatedCompute(MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10), shape)
    assert unmeasured.forward_backward_s(64, kfac=True)[0] == pytest.approx(without[0])


@pytest.mark.parametrize("name", ["v100-edr", "a100-hdr200", "h100-ndr400"])
def test_profiles_without_the_hook_cost_load_with_none(name: str) -> None:
    assert load_profile(name)[0].kfac_forward_layer_s == 0.0


def test_the_hook_cost_round_trips(tmp_path: Path) -> None:
    path = write_profile(tmp_path / "p.toml", {"machine": {"kfac_forward_layer_s": "2.5e-05"}})
    assert load_profile(str(path))[0].kfac_forward_layer_s == 2.5e-5


@pytest.mark.parametrize("value", ["-1e-5", '"fast"', "5.0"])
def test_a_bad_hook_cost_is_one_line_naming_it_exit_2(tmp_path: Path, value: str) -> None:
    path = write_profile(tmp_path / "p.toml", {"machine": {"kfac_forward_layer_s": value}})
    with pytest.raises(PlanInputError, match=r"machine\.kfac_forward_layer_s"):
        load_profile(str(path))
    result = CliRunner().invoke(main, ["plan", "--hardware", str(path), "--ranks", "1,2"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "machine.kfac_forward_layer_s" in lines[0]


def test_under_a_process_group_the_hook_cost_is_timed_in_a_fresh_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 alone must not build a preconditioner (its process groups are collective):
    with a group initialized the hook's and the step's costs come from a one-thread child
    without the launcher's variables."""
    from kfac_hpc.plan import site

    seen: dict[str, Any] = {}

    def child(argv: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        seen["argv"], seen["env"] = argv, env
        return type("Done", (), {"returncode": 0, "stdout": "2.5e-05 0.0002\n", "stderr": ""})()

    def in_process(device: torch.device) -> float:
        raise AssertionError("timed in the rank's own process")

    monkeypatch.setattr(site.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(site.subprocess, "run", child)
    monkeypatch.setattr(site, "kfac_forward_layer_s", in_process)
    monkeypatch.setattr(site, "kfac_step_overhead_s", in_process)
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert site._kfac_costs(torch.device("cpu")) == (2.5e-5, 2e-4)
    assert seen["argv"][1] == "-c" and "kfac_forward_layer_s" in seen["argv"][2]
    assert "kfac_step_overhead_s" in seen["argv"][2]
    assert "SLURM_PROCID" not in seen["env"] and seen["env"]["OMP_NUM_THREADS"] == "1"
