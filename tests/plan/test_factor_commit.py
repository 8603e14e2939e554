"""K-FAC's factor_compute phase as the preconditioner runs it: with the factors computed in the
backward hooks, the phase commits them (the running averages' ``lerp`` over the factors a rank
keeps, the finiteness check over those and every gradient, one agreement allreduce of a flag);
without hook updates it computes the factors too. Tensors and elements are counted here from
the real preconditioner's factors of a tiny model; the costs per tensor and per element come
from the profile (written by calibrate) or, absent, from a kernel launch and the memory
rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kfac_hpc.optim.preconditioner import KFACPreconditioner
from kfac_hpc.plan import layer_rates as rates
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import MeasuredCompute, RatedCompute, Tensors
from kfac_hpc.plan.layers import INPUTS, build_network, model_shape
from kfac_hpc.plan.model import CostModel, Host, PlanConfig, collective_s
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile, load_profile
from kfac_hpc.plan.site import profile_text

MODEL, DATASET = "mlp", "digits"
SHAPE = model_shape(MODEL, DATASET)
AVERAGE_S, CHECK_S = 3e-9, 5e-10  # per element
AVERAGE_TENSOR_S, CHECK_TENSOR_S = 7e-6, 2e-6
MACHINE = MachineProfile(
    "cpu", 1e10, 1e9, 2e10, 1e10, kernel_overhead_s=1e-5,
    factor_average_element_s=AVERAGE_S, finite_check_element_s=CHECK_S,
    factor_average_tensor_s=AVERAGE_TENSOR_S, finite_check_tensor_s=CHECK_TENSOR_S,
)  # fmt: skip
LINK = AlphaBeta(1e-4, 1e-9)
NET = NetworkProfile("one node", 64, LINK, LINK)


def _real_counts() -> tuple[Tensors, Tensors]:
    """(factors, gradients) of the real preconditioner on the tiny model after one factor
    step: every running factor, every gradient (tensors and their elements)."""
    torch.manual_seed(0)
    net = build_network(MODEL, DATASET)
    pre = KFACPreconditioner(net, factor_update_steps=1, inv_update_steps=1)
    shape, classes = INPUTS[DATASET]
    x, y = torch.randn(8, *shape), torch.randint(0, classes, (8,))
    nn.CrossEntropyLoss()(net(x), y).backward()
    pre.step()
    pre.remove_hooks()
    factors = [t for f in pre.factors.values() for t in (f.A, f.G) if t is not None]
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    return tuple(  # type: ignore[return-value]
        Tensors(len(ts), sum(t.numel() for t in ts)) for ts in (factors, grads)
    )


(FACTOR_TENSORS, FACTORS), (GRAD_TENSORS, GRADS) = _real_counts()


def _predict(
    method: str,
    ranks: int,
    in_hook: bool = True,
    machine: MachineProfile = MACHINE,
    sync: tuple[tuple[int, float, float], ...] = (),
):
    host = Host(cores_per_node=1, sync=sync)
    model = CostModel(SHAPE, RatedCompute(machine, SHAPE), NET, host)
    cfg = PlanConfig(method, ranks, 64, "weak", 2, 10, update_factors_in_hook=in_hook)
    return model, model.predict(cfg)


def test_the_counts_are_the_real_preconditioners() -> None:
    assert FACTORS == sum(layer.factor_elements for layer in SHAPE.layers) > 0
    assert 2 * len(SHAPE.layers) == FACTOR_TENSORS
    assert (SHAPE.param_tensors, SHAPE.params) == (GRAD_TENSORS, GRADS)


@pytest.mark.parametrize(
    ("method", "ranks", "share"),
    [
        ("kfac-comm-opt", 1, 1.0),
        ("kfac-comm-opt", 4, 1.0),  # every rank keeps every factor
        ("kfac-mem-opt", 4, 0.25),  # each factor on one rank: the mean over ranks
        ("kfac-hybrid-opt", 4, 0.25),
    ],
)
def test_factor_compute_is_the_commit_of_the_kept_factors(
    method: str, ranks: int, share: float
) -> None:
    """(slow · (average(kept) + check(kept + gradients)) + agreement) / f, each cost a
    tensor's times the tensors plus an element's times the elements, at P ranks on one core
    (slow P), f = 2; the factor GEMMs are not in it (the hooks run them)."""
    _, pred = _predict(method, ranks)
    slow = ranks  # one core per node, one thread a rank, 64 ranks a node
    kept, kept_tensors = FACTORS * share, FACTOR_TENSORS * share
    average = AVERAGE_TENSOR_S * kept_tensors + AVERAGE_S * kept
    check = CHECK_TENSOR_S * (kept_tensors + GRAD_TENSORS) + CHECK_S * (kept + GRADS)
    commit = average + check
    agreement = collective_s(NET, "allreduce", 4, ranks)
    expected = (slow * commit + agreement) / 2
    assert pred.phases_s["factor_compute"] == pytest.approx(expected, rel=1e-12)


def test_the_agreement_waits_what_the_sync_fit_says_after_the_commit() -> None:
    """With a sync fit (a collective after T s of compute waits a + b·T), the agreement
    allreduce waits after the commit's uncontended compute: (a + b·commit) / f more."""
    a, b, ranks = 1e-3, 0.5, 4
    _, plain = _predict("kfac-comm-opt", ranks)
    _, synced = _predict("kfac-comm-opt", ranks, sync=((2, a, b),))
    average = AVERAGE_TENSOR_S * FACTOR_TENSORS + AVERAGE_S * FACTORS
    check = CHECK_TENSOR_S * (FACTOR_TENSORS + GRAD_TENSORS) + CHECK_S * (FACTORS + GRADS)
    grown = synced.phases_s["factor_compute"] - plain.phases_s["factor_compute"]
    assert grown == pytest.approx((a + b * (average + check)) / 2, rel=1e-9)


def test_without_hook_updates_the_gemms_move_from_backward_to_factor_compute() -> None:
    model, hooked = _predict("kfac-comm-opt", 2)
    _, stepped = _predict("kfac-comm-opt", 2, in_hook=False)
    gemms = sum(model.compute.factor_s(layer, 64) for layer in SHAPE.layers)
    assert gemms > 0
    moved = 2 * gemms / 2  # slow 2, f = 2
    assert stepped.phases_s["factor_compute"] - hooked.phases_s["factor_compute"] == (
        pytest.approx(moved, rel=1e-9)
    )
    assert hooked.phases_s["backward"] - stepped.phases_s["backward"] == (
        pytest.approx(moved, rel=1e-9)
    )


def test_unmeasured_rates_are_a_launch_and_the_traffic_at_the_memory_rate() -> None:
    """A kernel launch a tensor; lerp reads the running and the step's factor and writes the
    new one (3 × 4 bytes an element), the check's sum reads each element once (4 bytes)."""
    plain = MachineProfile("gpu", 1e12, 1e11, 2e12, 1e10, kernel_overhead_s=4e-6)
    compute = RatedCompute(plain, SHAPE)
    none = Tensors(0, 0)
    got = compute.factor_commit_s(Tensors(3, 1000), none)
    assert got == pytest.approx(3 * 4e-6 + 1000 * 12 / 2e12, rel=1e-12)
    got = compute.factor_commit_s(none, Tensors(5, 1000))
    assert got == pytest.approx(5 * 4e-6 + 1000 * 4 / 2e12, rel=1e-12)


@pytest.mark.parametrize("name", ["v100-edr", "a100-hdr200"])
def test_a_profile_without_the_keys_loads_and_prices_by_its_bandwidth(name: str) -> None:
    machine, _ = load_profile(name)
    assert (machine.factor_average_element_s, machine.finite_check_element_s) == (0.0, 0.0)
    assert (machine.factor_average_tensor_s, machine.finite_check_tensor_s) == (0.0, 0.0)
    compute = RatedCompute(machine, SHAPE)
    launches = (FACTOR_TENSORS + GRAD_TENSORS) * machine.kernel_overhead_s
    expected = launches + (12 * FACTORS + 4 * GRADS) / machine.memory_bytes_per_s
    got = compute.factor_commit_s(Tensors(FACTOR_TENSORS, FACTORS), Tensors(GRAD_TENSORS, GRADS))
    assert got == pytest.approx(expected, rel=1e-12)


def test_calibrate_writes_the_keys_and_the_model_reads_them(tmp_path: Path) -> None:
    measured = {
        "eigh_curve": [[64, 1e-3], [512, 4e-3]],
        "gemm": 2e10,
        "copy": 5e9,
        "factor_average_tensor": 6e-6,
        "factor_average_element": 1.25e-9,
        "finite_check_tensor": 3e-6,
        "finite_check_element": 2.5e-10,
    }
    text = profile_text("cpu", measured, 8e9, 2, "gloo", LINK, LINK, 2)
    assert "factor_average_element_s = 1.25e-09" in text
    path = tmp_path / "site.toml"
    path.write_text(text)
    machine, _ = load_profile(str(path))
    assert (machine.factor_average_element_s, machine.finite_check_element_s) == (1.25e-9, 2.5e-10)
    assert (machine.factor_average_tensor_s, machine.finite_check_tensor_s) == (6e-6, 3e-6)
    got = RatedCompute(machine, SHAPE).factor_commit_s(Tensors(2, 1000), Tensors(4, 3000))
    expected = 2 * 6e-6 + 1000 * 1.25e-9 + 4 * 3e-6 + 3000 * 2.5e-10
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_costs_are_fitted_per_tensor_and_per_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a stand-in clock where a call over a set costs 5 µs a tensor + 1 ns an element, the
    fit over COMMIT_SETS gives those back; the timed calls run the real commit (every
    factor folded in) and the real check (of finite factors: True)."""
    returned: list[object] = []

    def timed(fn, device):  # type: ignore[no-untyped-def]
        returned.append(fn())
        return clock[0]

    clock = [0.0]
    sets = iter(rates.COMMIT_SETS)
    real = rates._factors

    def factors(count: int, side: int, device: torch.device) -> list[torch.Tensor]:
        assert (count, side) == next(sets)
        clock[0] = count * (5e-6 + side * side * 1e-9)
        return real(count, side, device)

    monkeypatch.setattr(rates, "per_call_s", timed)
    monkeypatch.setattr(rates, "_factors", factors)
    cpu = torch.device("cpu")
    assert rates.factor_average_costs(cpu) == pytest.approx((5e-6, 1e-9), rel=1e-6)
    sets = iter(rates.COMMIT_SETS)
    assert rates.finite_check_costs(cpu) == pytest.approx((5e-6, 1e-9), rel=1e-6)
    checks = returned[len(rates.COMMIT_SETS) :]
    assert checks == [True] * len(rates.COMMIT_SETS)


def test_the_measured_average_is_a_lerp_into_a_new_tensor() -> None:
    """What the calibration times is LayerFactors.commit: F ← 0.95 F + 0.05 F_step."""
    from kfac_hpc.optim.factors import LayerFactors

    running, step = torch.eye(3), torch.full((3, 3), 2.0)
    factors = LayerFactors()
    factors.A = running
    factors.set_pending("A", step, 1)
    factors.commit(0.95, keep_g=False)
    assert factors.A is not running
    torch.testing.assert_close(factors.A, 0.95 * running + 0.05 * step, rtol=1e-6, atol=0)


def test_measured_compute_scales_the_commit_to_the_real_phase() -> None:
    """On one rank the real phase commits every factor and checks every factor and gradient:
    that price equals the phase the real preconditioner reported; others scale with it."""
    compute = MeasuredCompute(SHAPE)
    compute._commit = ((AVERAGE_TENSOR_S, AVERAGE_S), (CHECK_TENSOR_S, CHECK_S))
    compute._fb[(64, True)] = (0.0, 0.0)  # the real preconditioner measured at batch 64
    compute._kfac_totals[64] = {"factor_compute": 1e-3}

    def rated(share: float) -> float:
        kept, tensors = FACTORS * share, FACTOR_TENSORS * share
        average = AVERAGE_TENSOR_S * tensors + AVERAGE_S * kept
        return average + CHECK_TENSOR_S * (tensors + GRAD_TENSORS) + CHECK_S * (kept + GRADS)

    def priced(share: float) -> float:
        kept = Tensors(FACTOR_TENSORS * share, FACTORS * share)
        checked = Tensors(kept.number + GRAD_TENSORS, kept.elements + GRADS)
        return compute.factor_commit_s(kept, checked)

    assert priced(1.0) == pytest.approx(1e-3, rel=1e-12)
    assert priced(0.5) == pytest.approx(1e-3 * rated(0.5) / rated(1.0), rel=1e-12)
