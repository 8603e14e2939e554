"""FOSI / DHO2 in the cost model: the ESE (Lanczos iterations, each a Hessian-vector product
≈ 2 backward passes, plus full reorthogonalization) amortized over ``ese_every``; the base
optimizer sharded over P ranks; the run config of a FOSI run maps to the method. Checked
against the arithmetic of docs/plan.md written out here."""

from __future__ import annotations

import pytest

from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.explain import config_of_run
from kfac_hpc.plan.layers import model_shape
from kfac_hpc.plan.model import CostModel, PlanConfig, collective_s
from kfac_hpc.plan.planner import build_cost_model, predict_all
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile

MACHINE = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10)
NET = NetworkProfile("one node", 64, AlphaBeta(1e-4, 1e-9), AlphaBeta(1e-4, 1e-9))


def _model() -> CostModel:
    shape = model_shape("small_cnn", "digits")
    return CostModel(shape, RatedCompute(MACHINE, shape), NET)


def _cfg(ranks: int, ese_every: int = 50, iters: int | None = 12) -> PlanConfig:
    return PlanConfig("fosi", ranks, 64, "weak", fosi_k=3, ese_every=ese_every, lanczos_iters=iters)


def test_ese_at_one_rank_is_lanczos_iterations_of_two_backwards() -> None:
    model = _model()
    pred = model.predict(_cfg(1))
    sgd = model.predict(PlanConfig("sgd", 1, 64, "weak"))
    n = model.shape.params
    rate = 20 * n / model.compute.optimizer_s(64)  # bytes/s of the optimizer's traffic
    reorth = sum(2 * j * 4 * n for j in range(12)) / rate
    assert pred.phases_s["ese"] * 50 == pytest.approx(12 * 2 * sgd.phases_s["backward"] + reorth)
    # FOSI's forward and backward are SGD's; its optimizer adds the projections on 3 vectors
    assert pred.phases_s["backward"] == pytest.approx(sgd.phases_s["backward"])
    projections = 2 * 3 * 4 * n / rate
    assert pred.phases_s["optimizer"] == pytest.approx(sgd.phases_s["optimizer"] + projections)


def test_ese_is_amortized_and_defaults_to_four_iterations_per_pair() -> None:
    model = _model()
    every_50 = model.predict(_cfg(4, 50)).phases_s["ese"]
    assert model.predict(_cfg(4, 100)).phases_s["ese"] == pytest.approx(every_50 / 2)
    assert model.predict(_cfg(4, 50, None)).phases_s["ese"] == pytest.approx(every_50)  # 4·3


def test_sharded_base_and_its_collectives_at_p_ranks() -> None:
    model = _model()
    p, n = 4, model.shape.params
    pred = model.predict(_cfg(p))
    rate = 20 * n / model.compute.optimizer_s(64)
    local = model.compute.optimizer_s(64) / p + 2 * 3 * 4 * n / p / rate
    comm = collective_s(NET, "allreduce", 3 * 4, p) + 0.5 * collective_s(NET, "allreduce", 4 * n, p)
    assert pred.phases_s["optimizer"] == pytest.approx(local + comm)


def test_fosi_run_config_and_planner() -> None:
    config = {"world_size": 2, "fosi": True, "kfac": False, "batch_size": 64, "ese_every": 20}
    cfg = config_of_run(config)
    assert (cfg.method, cfg.ese_every, cfg.kfac) == ("fosi", 20, False)
    planned = build_cost_model("small_cnn", "digits", "a100-hdr200")
    (pred,) = predict_all(planned, ["fosi"], [8], 64, "weak", 10, 100, 25.0, 10, 100)
    assert pred.phases_s["ese"] > 0 and pred.step_s > sum(
        v for k, v in pred.phases_s.items() if k != "ese"
    )
