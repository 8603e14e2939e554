"""Phases whose work differs by rank are predicted as the job records them, the mean over
ranks, with the busiest rank's lead moved into the wait of the collective after them; ranks
done early free their share of the cores (``shared_finish_s``). Checked against the
arithmetic written out on small cases."""

from __future__ import annotations

import pytest

from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.layers import model_shape
from kfac_hpc.plan.model import CostModel, Host, PlanConfig, lanes_s, shared_finish_s
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile
from tests.plan.rank_work import rank_work, spread

SHAPE = model_shape("small_cnn", "digits")
LINK = AlphaBeta(1e-5, 1e-10)


def test_ranks_sharing_one_core_finish_in_turn() -> None:
    # one core, k ranks at once each at 1/k: the lightest finishes after 3 × 1 s, the next
    # after 1 s more at half pace, the last after all 7 s of work
    finish = shared_finish_s([2.0, 1.0, 4.0], lambda k: float(k))
    assert finish == pytest.approx([5.0, 3.0, 7.0])
    # no contention: each rank's own work
    assert shared_finish_s([2.0, 0.0, 4.0], lambda k: 1.0) == pytest.approx([2.0, 0.0, 4.0])
    # equal work: the slowdown of every rank at once, as for the phases every rank runs alike
    assert shared_finish_s([1.5] * 4, lambda k: 2.3 if k == 4 else 1.0) == pytest.approx(
        [1.5 * 2.3] * 4
    )


def _model(host: Host) -> CostModel:
    machine = MachineProfile("cpu", 1e9, 1e8, 1e10, 1e10)
    return CostModel(SHAPE, RatedCompute(machine, SHAPE), NetworkProfile("t", 4, LINK, LINK), host)


@pytest.mark.parametrize("inv", [1, 10])
def test_inverse_compute_is_the_mean_and_the_lead_waits_in_the_broadcasts(inv: int) -> None:
    model = _model(Host())
    cfg = PlanConfig("kfac-comm-opt", 4, 64, "weak", 1, inv)
    eigh, _ = rank_work(model, cfg)
    assert spread(eigh) > 0  # the small CNN's factors do not split evenly over 4 ranks
    phases = model.predict(cfg).phases_s
    assert phases["inverse_compute"] == pytest.approx(sum(eigh) / 4 / inv)
    broadcasts = lanes_s(model.network, model.kfac_collectives(cfg))
    assert phases["inverse_comm"] == pytest.approx((broadcasts + spread(eigh)) / inv)
    # the step keeps the busiest rank's eigendecompositions
    assert phases["inverse_compute"] + phases["inverse_comm"] == pytest.approx(
        (max(eigh) + broadcasts) / inv
    )


def test_ranks_done_early_free_the_cores_for_the_busiest() -> None:
    """With a measured slowdown, each rank's eigendecompositions finish as shared_finish_s
    says (written out here for the ranks in order of their work)."""
    slowdown = ((1, 1.0), (2, 1.4), (4, 2.2))
    model = _model(Host(slowdown=slowdown))
    cfg = PlanConfig("kfac-comm-opt", 4, 64, "weak", 1, 1)
    eigh, _ = rank_work(model, cfg)
    at = dict(slowdown)
    w = sorted(eigh)
    finish = [w[0] * at[4]]  # all 4 at once until the lightest is done
    finish.append(finish[-1] + (w[1] - w[0]) * at[2])  # 3 still at it: the 2-rank point
    finish.append(finish[-1] + (w[2] - w[1]) * at[2])
    finish.append(finish[-1] + (w[3] - w[2]) * at[1])  # the busiest alone
    phases = model.predict(cfg).phases_s
    assert phases["inverse_compute"] == pytest.approx(sum(finish) / 4)
    broadcasts = lanes_s(model.network, model.kfac_collectives(cfg))
    assert phases["inverse_comm"] == pytest.approx(broadcasts + finish[-1] - sum(finish) / 4)


def test_mem_opt_ranks_wait_for_the_busiest_in_the_gradient_broadcast() -> None:
    model = _model(Host())
    cfg = PlanConfig("kfac-mem-opt", 4, 64, "weak", 1, 10)
    eigh, precondition = rank_work(model, cfg)
    phases = model.predict(cfg).phases_s
    assert phases["inverse_comm"] == 0  # one grad worker a layer: nothing to broadcast
    assert phases["inverse_compute"] == pytest.approx(sum(eigh) / 4 / 10)
    assert phases["precondition"] == pytest.approx(sum(precondition) / 4)
    grads = [c for c in model.kfac_collectives(cfg) if c.phase == "grad_broadcast"]
    expected = lanes_s(model.network, grads) + spread(eigh) / 10 + spread(precondition)
    assert phases["grad_broadcast"] == pytest.approx(expected)


@pytest.mark.parametrize("a", [1e-6, 100.0])
def test_the_lead_and_the_sync_wait_overlap(a: float) -> None:
    """The ranks done early wait for the busiest; the sync fit's wait (after work every rank
    does alike: the least rank's) plays out meanwhile: the larger of the two, not their sum."""
    b = 0.5
    model = _model(Host(sync=((2, a, b),)))
    cfg = PlanConfig("kfac-comm-opt", 4, 64, "weak", 1, 10)
    eigh, _ = rank_work(model, cfg)
    phases = model.predict(cfg).phases_s
    broadcasts = lanes_s(model.network, model.kfac_collectives(cfg))
    wait = max(spread(eigh), a + b * min(eigh))
    assert wait == (spread(eigh) if a < 1 else a + b * min(eigh))  # both regimes met
    assert phases["inverse_comm"] == pytest.approx((broadcasts + wait) / 10)
