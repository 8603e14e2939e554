"""What ``plan calibrate`` measures beyond rates and links, and how the cost model uses it:
real-layer curves price each layer (forward, backward, the hooks' factor update), a measured
slowdown by ranks computing at once replaces the cores ratio, the profile's measured waits
are added after compute, and a 1-rank overhead run inherits no launcher variables. Each cost
term is checked against the arithmetic written out here (numpy's interpolation as the
oracle of the log-log curves); every new profile key refuses a bad value naming it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.plan import layer_rates as rates
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.calibrate import fit_wait
from kfac_hpc.plan.compute_costs import RatedCompute, layer_kind
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import build_network, model_shape
from kfac_hpc.plan.model import CostModel, Host, PlanConfig, bucketed_allreduce_s
from kfac_hpc.plan.overhead import (
    JobOverhead,
    job_optimizer_tensor_s,
    one_process_env,
    window_means,
)
from kfac_hpc.plan.planner import build_cost_model
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile, load_profile
from kfac_hpc.plan.site import SiteHost, _groups, profile_text
from tests.plan.test_cli_input import write_profile

SHAPE = model_shape("small_cnn", "digits")
# forward FLOPs, forward s, backward s, factor s: spans the small CNN's layers at batch 64
CONV = ((1e5, 1e-4, 3e-4, 5e-4), (1e7, 4e-4, 9e-4, 2e-3), (1e9, 2e-2, 5e-2, 9e-2))
LINEAR = ((1e3, 1e-5, 2e-5, 4e-5), (1e6, 5e-5, 1e-4, 3e-4), (1e8, 3e-3, 7e-3, 2e-2))
MACHINE = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, conv_curve=CONV, linear_curve=LINEAR)
LINK = AlphaBeta(1e-4, 1e-9)
NET = NetworkProfile("one node", 64, LINK, LINK)


def _oracle(curve: tuple[tuple[float, ...], ...], column: int, flops: float) -> float:
    """Straight-line interpolation in log-log space (inside the curve's range)."""
    xs = np.log([p[0] for p in curve])
    ys = np.log([p[column] for p in curve])
    return float(np.exp(np.interp(math.log(flops), xs, ys)))


def _model(host: Host | None = None) -> CostModel:
    return CostModel(SHAPE, RatedCompute(MACHINE, SHAPE), NET, host or Host())


@pytest.mark.parametrize("kfac", [False, True])
def test_layer_curves_price_each_layer_of_its_kind(kfac: bool) -> None:
    batch = 64
    elementwise = batch * SHAPE.activations_per_sample * 8 / MACHINE.memory_bytes_per_s
    forward, backward = elementwise, 2 * elementwise
    for layer in SHAPE.layers:
        curve = CONV if layer.rows > 1 else LINEAR
        flops = batch * layer.forward_flops
        assert curve[0][0] <= flops <= curve[-1][0]  # inside: numpy's interpolation applies
        forward += _oracle(curve, 1, flops)
        backward += _oracle(curve, 2, flops) + (_oracle(curve, 3, flops) if kfac else 0.0)
    got = RatedCompute(MACHINE, SHAPE).forward_backward_s(batch, kfac)
    assert got == pytest.approx((forward, backward), rel=1e-9)
    assert {layer_kind(layer) for layer in SHAPE.layers} == {"conv", "linear"}


def test_a_layer_beyond_the_curve_follows_its_end_segment() -> None:
    (f0, t0, *_), (f1, t1, *_) = CONV[-2:]
    slope = math.log(t1 / t0) / math.log(f1 / f0)
    machine = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, conv_curve=CONV)
    got = machine.layer_s("conv", 1e10)
    assert got is not None and got[0] == pytest.approx(t0 * (1e10 / f0) ** slope)
    assert machine.layer_s("linear", 1e6) is None  # no linear curve: the GEMM rate prices it


def test_kfac_hooks_add_their_factor_update_on_factor_steps_only() -> None:
    plain = _model().predict(PlanConfig("sgd", 1, 64, "weak"))
    every = _model().predict(PlanConfig("kfac-comm-opt", 1, 64, "weak", 1, 10))
    tenth = _model().predict(PlanConfig("kfac-comm-opt", 1, 64, "weak", 10, 100))
    hooks = sum(
        _oracle(CONV if layer.rows > 1 else LINEAR, 3, 64 * layer.forward_flops)
        for layer in SHAPE.layers
    )
    assert every.phases_s["backward"] == pytest.approx(plain.phases_s["backward"] + hooks)
    assert tenth.phases_s["backward"] == pytest.approx(plain.phases_s["backward"] + hooks / 10)


@pytest.mark.parametrize(("ranks", "factor"), [(1, 1.0), (2, 1.5), (3, 1.5), (4, 2.5), (16, 2.5)])
def test_the_measured_slowdown_at_the_largest_count_not_above_p(ranks: int, factor: float) -> None:
    curve = ((1, 1.0), (2, 1.5), (4, 2.5))
    # cores that would say otherwise (2 cores, 64 ranks a node): the measured curve wins
    slowed = _model(Host(2, 1, slowdown=curve)).predict(PlanConfig("sgd", ranks, 64, "weak"))
    free = _model().predict(PlanConfig("sgd", ranks, 64, "weak"))
    for phase in ("forward", "backward", "optimizer", "data"):
        assert slowed.phases_s[phase] == pytest.approx(factor * free.phases_s[phase])


def test_a_profile_s_waits_and_job_overhead_reach_the_model(tmp_path: Path) -> None:
    a, b = 2e-3, 0.5
    path = write_profile(
        tmp_path / "p.toml",
        {
            "machine": {"step_overhead_s": "0.001", "data_s_per_sample": "1e-6"},
            "network": {"sync": f"[[2, {a}, {b}]]"},
        },
    )
    planned = build_cost_model("small_cnn", "digits", str(path))
    machine, net = load_profile(str(path))
    assert net.sync == ((2, a, b),)
    pred = planned.model.predict(PlanConfig("sgd", 4, 64, "weak"))
    compute = planned.model.compute
    forward, backward = compute.forward_backward_s(64)
    data = 64 * 1e-6
    expected = (
        bucketed_allreduce_s(net, SHAPE.params * 4, 4, 25.0) + a + b * (data + forward + backward)
    )
    assert pred.phases_s["grad_allreduce"] == pytest.approx(expected)
    assert pred.phases_s["data"] == pytest.approx(data)
    assert pred.other_s == pytest.approx(1e-3)
    assert machine.step_overhead_s == pytest.approx(1e-3)


def test_fit_wait_recovers_a_linear_wait() -> None:
    lockstep, slowdown, a, b = 3e-4, 1.5, 1e-3, 0.4
    rows = [("sync", 2, t, slowdown * t + lockstep + a + b * t) for t in (5e-4, 4e-3, 16e-3)]
    assert fit_wait(rows, slowdown, lockstep) == pytest.approx((a, b))
    assert fit_wait(rows[:1], slowdown, lockstep) == pytest.approx((a + b * 5e-4, 0.0))


def test_fit_wait_keeps_the_slope_non_negative() -> None:
    """Waits that fall with the work (noise on a loaded host) fit b = 0 and the mean wait:
    the least-squares optimum over b >= 0, checked against a dense search of (a, b)."""
    lockstep, slowdown = 3e-4, 1.5
    waits = (4e-3, 3e-3, 1e-3)
    times = (5e-4, 4e-3, 16e-3)
    rows = [("sync", 2, t, slowdown * t + lockstep + w) for t, w in zip(times, waits, strict=True)]
    a, b = fit_wait(rows, slowdown, lockstep)
    assert (a, b) == pytest.approx((sum(waits) / 3, 0.0))

    def sse(a: float, b: float) -> float:
        return sum((w - a - b * t) ** 2 for t, w in zip(times, waits, strict=True))

    grid = [(i * 1e-5, j * 1e-3) for i in range(0, 600) for j in range(0, 50)]
    best = min(grid, key=lambda ab: sse(*ab))
    assert sse(a, b) <= sse(*best) + 1e-15


def test_the_concurrency_sets_are_one_rank_a_node_then_all() -> None:
    assert _groups(4, 2) == [[0, 2], [0, 1, 2, 3]]
    assert _groups(8, 4) == [[0, 4], list(range(8))]
    assert _groups(2, 2) == [[0, 1]]  # one node: one rank a node is one rank (not a set)
    assert _groups(2, 1) == [[0, 1]]  # one rank a node: the same set once


def test_the_overhead_run_inherits_no_launcher_variables() -> None:
    env = {"PATH": "/bin", "SLURM_PROCID": "1", "PMI_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}
    env |= {"RANK": "1", "MASTER_PORT": "1", "KFAC_HPC_EMULATED_NODES": "2", "OMP_X": "y"}
    assert one_process_env(env) == {"PATH": "/bin", "OMP_X": "y"}


def test_profile_text_with_the_measured_host_round_trips(tmp_path: Path) -> None:
    rates = {
        "eigh_curve": [[64, 1e-3], [512, 4e-3]],
        "gemm": 2e10,
        "copy": 5e9,
        "conv_curve": [list(p) for p in CONV],
        "linear_curve": [list(p) for p in LINEAR],
        "optimizer": 1.5e-5,
        "optimizer_alone": 4e-6,
        "kfac_step_overhead": 2.25e-4,
    }
    host = SiteHost([[1, 1.0], [2, 1.4]], [[2, 1e-4, 0.3]], JobOverhead(2e-6, 5e-4), "digits")
    path = tmp_path / "site.toml"
    text = profile_text("cpu", rates, 8e9, 2, "gloo", LINK, LINK, 2, host)
    assert "(timed back to back: 4e-06)" in text
    path.write_text(text)
    machine, net = load_profile(str(path))
    assert machine.conv_curve == CONV and machine.linear_curve == LINEAR  # 6 digits hold them
    assert machine.slowdown_curve == ((1, 1.0), (2, 1.4))
    assert (machine.data_s_per_sample, machine.step_overhead_s) == (2e-6, 5e-4)
    assert machine.optimizer_tensor_s == 1.5e-5
    assert machine.kfac_step_overhead_s == 2.25e-4
    assert net.sync == ((2, 1e-4, 0.3),)


def test_the_optimizer_pays_its_traffic_and_a_cost_per_parameter_tensor() -> None:
    tensors = len(list(build_network("small_cnn", "digits").parameters()))
    assert SHAPE.param_tensors == tensors  # the network's own count (weights and biases)
    machine = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, optimizer_tensor_s=2e-5)
    traffic = 20 * SHAPE.params / 1e10  # read w, g, momentum; write w, momentum (FP32)
    got = RatedCompute(machine, SHAPE).optimizer_s(64)
    assert got == pytest.approx(traffic + 2e-5 * tensors)
    assert RatedCompute(MACHINE, SHAPE).optimizer_s(64) == pytest.approx(traffic)  # unmeasured


def test_the_optimizer_tensor_cost_is_what_many_small_tensors_add(monkeypatch) -> None:
    """(64 small tensors' update − one tensor of their elements) / 63, on timed stand-ins."""
    updates = {64: 3.2e-3, 1: 0.05e-3}
    monkeypatch.setattr(rates, "_update_s", lambda shapes, device: updates[len(shapes)])
    assert rates.optimizer_tensor_s(torch.device("cpu")) == pytest.approx(3.15e-3 / 63)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("machine", "conv_curve", "[[1e6, 1e-3, 2e-3, 3e-3]]"),  # one point
        ("machine", "conv_curve", "[[1e6, 1e-3, 2e-3], [1e7, 1e-2, 2e-2]]"),  # 3 columns
        ("machine", "linear_curve", "[[1e6, 1e-3, 2e-3, 3e-3], [1e5, 1e-2, 2e-2, 3e-2]]"),
        ("machine", "linear_curve", "[[1e6, 0, 2e-3, 3e-3], [1e7, 1e-2, 2e-2, 3e-2]]"),
        ("machine", "slowdown_curve", "[[1, 1.0], [2, 0.0]]"),
        ("machine", "slowdown_curve", "[[1.5, 1.0], [2, 2.0]]"),
        ("network", "sync", "[[1, 1e-3, 0.5], [2, 1e-3, 0.5]]"),  # a wait needs 2 ranks
        ("network", "sync", "[[2, 1e-3, 500], [4, 1e-3, 0.5]]"),
        ("network", "sync", '"fast"'),
    ],
)
def test_a_bad_measured_key_is_one_line_naming_it_exit_2(
    tmp_path: Path, section: str, key: str, value: str
) -> None:
    path = write_profile(tmp_path / "p.toml", {section: {key: value}})
    with pytest.raises(PlanInputError, match=rf"{section}\.{key}"):
        load_profile(str(path))
    result = CliRunner().invoke(main, ["plan", "--hardware", str(path), "--ranks", "1,2"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{section}.{key}" in lines[0]


@pytest.mark.parametrize("name", ["v100-edr", "a100-hdr200"])
def test_shipped_profiles_measure_none_and_keep_the_rated_model(name: str) -> None:
    machine, net = load_profile(name)
    assert (machine.conv_curve, machine.linear_curve, machine.slowdown_curve, net.sync) == (
        (),
        (),
        (),
        (),
    )


def test_the_step_overhead_is_the_mean_of_step_minus_its_phases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a fake clock: each step() takes 5 units of which it times 3 (2 outside), every
    10th step 14 more outside; the overhead is their mean (2 + 14 / 10), not the median."""
    clock = [0.0]
    calls = [0]

    class Fake:
        def __init__(self, net: torch.nn.Module, **kwargs: Any) -> None:
            self.last_timings: dict[str, float] = {}

        def step(self) -> None:
            calls[0] += 1
            slow = 14.0 if calls[0] % 10 == 0 else 0.0
            clock[0] += 5.0 + slow
            self.last_timings = {"factor_compute": 2.0, "precondition": 1.0}

    monkeypatch.setattr(rates, "KFACPreconditioner", Fake)
    monkeypatch.setattr(rates.time, "perf_counter", lambda: clock[0])
    measured = rates.kfac_step_overhead_s(torch.device("cpu"))
    assert calls[0] == 220  # 20 warm-up steps, 200 timed: 20 slow ones among them
    assert measured == pytest.approx(2.0 + 14.0 / 10, rel=1e-12)


def test_kfac_other_adds_the_step_overhead_by_hand() -> None:
    """K-FAC's ``other``: (the job's step overhead + the preconditioner's) × the slowdown;
    SGD's: the job's alone."""
    shape = model_shape("small_cnn", "digits")
    machine = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, kfac_step_overhead_s=2e-4)
    host = Host(job=JobOverhead(1e-6, 3e-5), slowdown=((1, 1.0), (2, 1.5)))
    model = CostModel(shape, RatedCompute(machine, shape), NET, host)
    kfac = model.predict(PlanConfig("kfac-comm-opt", 2, 128, "strong", 1, 10))
    sgd = model.predict(PlanConfig("sgd", 2, 128, "strong", 1, 10))
    assert kfac.other_s == pytest.approx((3e-5 + 2e-4) * 1.5, rel=1e-12)
    assert sgd.other_s == pytest.approx(3e-5 * 1.5, rel=1e-12)
    path_machine = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10)
    assert RatedCompute(path_machine, shape).kfac_overhead_s(64) == 0.0


def _window(steps: int, data: float, optimizer: float, other: float) -> dict[str, Any]:
    phases = {"data": data, "forward": 1e-3, "optimizer": optimizer}
    return {"kind": "train", "window_steps": steps, "phases_s": phases,
            "step_s": sum(phases.values()) + other}  # fmt: skip


def test_the_job_overhead_is_the_step_weighted_mean_after_the_warm_up_window() -> None:
    """As the job reports its phases: per-step means weighted by the windows' steps, the slow
    window (an epoch start) counted, the first (warm-up) window left out; not medians."""
    records = [
        _window(10, 9e-3, 9e-3, 9e-3),  # warm-up: dropped
        {"kind": "eval"},
        _window(10, 1e-4, 2e-4, 3e-5),
        _window(10, 1e-4, 2e-4, 3e-5),
        _window(10, 9e-4, 6e-4, 1e-4),  # slow
        _window(5, 1e-4, 2e-4, 3e-5),
    ]
    job = window_means(records, 64)
    assert job.data_s_per_sample == pytest.approx((25 * 1e-4 + 10 * 9e-4) / 35 / 64, rel=1e-12)
    assert job.optimizer_s == pytest.approx((25 * 2e-4 + 10 * 6e-4) / 35, rel=1e-12)
    assert job.step_s == pytest.approx((25 * 3e-5 + 10 * 1e-4) / 35, rel=1e-12)


def test_the_optimizer_per_tensor_comes_from_the_jobs_optimizer_phase() -> None:
    """(The 1-rank mlp run's optimizer phase − 20 bytes a parameter at the copy rate) / its
    parameter tensors, counted here from the real mlp."""
    net = build_network("mlp", "digits")
    params = list(net.parameters())
    traffic = 20 * sum(p.numel() for p in params) / 5e9
    job = JobOverhead(optimizer_s=4e-4)
    expected = (4e-4 - traffic) / len(params)
    assert job_optimizer_tensor_s(job, "digits", 5e9) == pytest.approx(expected, rel=1e-12)
    assert job_optimizer_tensor_s(JobOverhead(optimizer_s=1e-9), "digits", 5e9) == 0.0
