"""K-FAC's factor_compute phase as the preconditioner runs it: with the factors computed in the
backward hooks, the phase commits them (the running averages' ``lerp`` over the factors a rank
keeps, the finiteness check over those and every gradient, one agreement allreduce of a flag);
without hook updates it computes the factors too. The elements are counted here from the real
preconditioner's factors of a tiny model; the per-element costs come from the profile (written
by calibrate) or, absent, from the memory rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kfac_hpc.optim.preconditioner import KFACPreconditioner
from kfac_hpc.plan import layer_rates as rates
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import MeasuredCompute, RatedCompute
from kfac_hpc.plan.layers import INPUTS, build_network, model_shape
from kfac_hpc.plan.model import CostModel, Host, PlanConfig, collective_s
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile, load_profile
from kfac_hpc.plan.site import profile_text

MODEL, DATASET = "mlp", "digits"
SHAPE = model_shape(MODEL, DATASET)
AVERAGE_S, CHECK_S = 3e-9, 5e-10  # per element
MACHINE = MachineProfile(
    "cpu", 1e10, 1e9, 2e10, 1e10, factor_average_element_s=AVERAGE_S, finite_check_element_s=CHECK_S
)
LINK = AlphaBeta(1e-4, 1e-9)
NET = NetworkProfile("one node", 64, LINK, LINK)


def _real_counts() -> tuple[int, int]:
    """(factor elements, parameter elements) of the real preconditioner on the tiny model
    after one factor step: every running factor's elements and every gradient's."""
    torch.manual_seed(0)
    net = build_network(MODEL, DATASET)
    pre = KFACPreconditioner(net, factor_update_steps=1, inv_update_steps=1)
    shape, classes = INPUTS[DATASET]
    x, y = torch.randn(8, *shape), torch.randint(0, classes, (8,))
    nn.CrossEntropyLoss()(net(x), y).backward()
    pre.step()
    pre.remove_hooks()
    factors = sum(f.A.numel() + f.G.numel() for f in pre.factors.values())  # type: ignore[union-attr]
    grads = sum(p.grad.numel() for p in net.parameters() if p.grad is not None)
    return factors, grads


FACTORS, GRADS = _real_counts()


def _predict(method: str, ranks: int, in_hook: bool = True, machine: MachineProfile = MACHINE):
    model = CostModel(SHAPE, RatedCompute(machine, SHAPE), NET, Host(cores_per_node=1))
    cfg = PlanConfig(method, ranks, 64, "weak", 2, 10, update_factors_in_hook=in_hook)
    return model, model.predict(cfg)


def test_the_counts_are_the_real_preconditioners() -> None:
    assert FACTORS == sum(layer.factor_elements for layer in SHAPE.layers) > 0
    assert GRADS == SHAPE.params > 0


@pytest.mark.parametrize(
    ("method", "ranks", "kept"),
    [
        ("kfac-comm-opt", 1, FACTORS),
        ("kfac-comm-opt", 4, FACTORS),  # every rank keeps every factor
        ("kfac-mem-opt", 4, FACTORS / 4),  # each factor on one rank: the mean over ranks
        ("kfac-hybrid-opt", 4, FACTORS / 4),
    ],
)
def test_factor_compute_is_the_commit_of_the_kept_factors(
    method: str, ranks: int, kept: float
) -> None:
    """(slow · (lerp · kept + check · (kept + gradients)) + agreement) / f, at 4 ranks on one
    core (slow 4), f = 2; the factor GEMMs are not in it (the hooks run them)."""
    _, pred = _predict(method, ranks)
    slow = ranks  # one core per node, one thread a rank, 64 ranks a node
    commit = AVERAGE_S * kept + CHECK_S * (kept + GRADS)
    agreement = collective_s(NET, "allreduce", 4, ranks)
    expected = (slow * commit + agreement) / 2
    assert pred.phases_s["factor_compute"] == pytest.approx(expected, rel=1e-12)


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


def test_unmeasured_rates_are_the_traffic_at_the_memory_rate() -> None:
    """lerp: read the running and the step's factor, write the new one (3 × 4 bytes); the
    check's sum reads each element once (4 bytes)."""
    plain = MachineProfile("gpu", 1e12, 1e11, 2e12, 1e10)
    compute = RatedCompute(plain, SHAPE)
    assert compute.factor_commit_s(1000, 0) == pytest.approx(1000 * 12 / 2e12, rel=1e-12)
    assert compute.factor_commit_s(0, 1000) == pytest.approx(1000 * 4 / 2e12, rel=1e-12)


@pytest.mark.parametrize("name", ["v100-edr", "a100-hdr200"])
def test_a_profile_without_the_keys_loads_and_prices_by_its_bandwidth(name: str) -> None:
    machine, _ = load_profile(name)
    assert (machine.factor_average_element_s, machine.finite_check_element_s) == (0.0, 0.0)
    compute = RatedCompute(machine, SHAPE)
    expected = (12 * FACTORS + 4 * GRADS) / machine.memory_bytes_per_s
    assert compute.factor_commit_s(FACTORS, GRADS) == pytest.approx(expected, rel=1e-12)


def test_calibrate_writes_the_keys_and_the_model_reads_them(tmp_path: Path) -> None:
    measured = {
        "eigh_curve": [[64, 1e-3], [512, 4e-3]],
        "gemm": 2e10,
        "copy": 5e9,
        "factor_average_element": 1.25e-9,
        "finite_check_element": 2.5e-10,
    }
    text = profile_text("cpu", measured, 8e9, 2, "gloo", LINK, LINK, 2)
    assert "factor_average_element_s = 1.25e-09" in text
    path = tmp_path / "site.toml"
    path.write_text(text)
    machine, _ = load_profile(str(path))
    assert (machine.factor_average_element_s, machine.finite_check_element_s) == (1.25e-9, 2.5e-10)
    got = RatedCompute(machine, SHAPE).factor_commit_s(1000, 3000)
    assert got == pytest.approx(1000 * 1.25e-9 + 3000 * 2.5e-10, rel=1e-12)


def test_the_rates_are_the_real_ops_over_their_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rate is one timed call (a stand-in clock: 2 s) over the elements it touched; the
    timed call folds every step's factor into its running average (lerp with the job's
    decay), or checks every factor."""
    elements = sum(n * n for n in rates.FACTOR_SIDES)
    calls: list[object] = []

    def timed(fn, device):  # type: ignore[no-untyped-def]
        calls.append(fn())
        return 2.0

    monkeypatch.setattr(rates, "per_call_s", timed)
    cpu = torch.device("cpu")
    assert rates.factor_average_element_s(cpu) == pytest.approx(2.0 / elements, rel=1e-12)
    assert rates.finite_check_element_s(cpu) == pytest.approx(2.0 / elements, rel=1e-12)
    assert calls[1] is True  # all_finite of finite factors


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
    compute._commit = (AVERAGE_S, CHECK_S)
    compute._fb[(64, True)] = (0.0, 0.0)  # the real preconditioner measured at batch 64
    compute._kfac_totals[64] = {"factor_compute": 1e-3}
    assert compute.factor_commit_s(FACTORS, FACTORS + GRADS) == pytest.approx(1e-3, rel=1e-12)
    whole = AVERAGE_S * FACTORS + CHECK_S * (FACTORS + GRADS)
    half = AVERAGE_S * FACTORS / 2 + CHECK_S * (FACTORS / 2 + GRADS)
    assert compute.factor_commit_s(FACTORS / 2, FACTORS / 2 + GRADS) == pytest.approx(
        1e-3 * half / whole, rel=1e-12
    )
