"""FOSI / DHO2 in the cost model: the ESE (Lanczos iterations, each a Hessian-vector product
≈ 2 backward passes on the curvature batch, the step's passes over the shard in the basis'
dtype, reorthogonalization as the chosen mode runs it) amortized over ``ese_every``; the base
optimizer sharded over P ranks; the run config of a FOSI run maps to the method and its ESE
options. Checked against the arithmetic of docs/plan.md and lanczos.py written out here."""

from __future__ import annotations

import dataclasses

import pytest

from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.optim.fosi.options import FOSIOptions
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.explain import config_of_run
from kfac_hpc.plan.layers import model_shape
from kfac_hpc.plan.model import CostModel, Host, PlanConfig, collective_s
from kfac_hpc.plan.planner import build_cost_model, predict_all
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile

MACHINE = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10)
NET = NetworkProfile("one node", 64, AlphaBeta(1e-4, 1e-9), AlphaBeta(1e-4, 1e-9))


def _model() -> CostModel:
    shape = model_shape("small_cnn", "digits")
    return CostModel(shape, RatedCompute(MACHINE, shape), NET)


def _cfg(ranks: int, ese_every: int = 50, iters: int | None = 12, **fosi: object) -> PlanConfig:
    return PlanConfig(
        "fosi", ranks, 64, "weak", fosi_k=3, ese_every=ese_every, lanczos_iters=iters, **fosi
    )  # type: ignore[arg-type]


def _ese(model: CostModel, cfg: PlanConfig) -> float:
    """Seconds of one ESE (the phase times its interval)."""
    return model.predict(cfg).phases_s["ese"] * cfg.ese_every


def _rate(model: CostModel) -> float:
    """Bytes/s of the optimizer's elementwise traffic (5 × 4 bytes a parameter)."""
    return 20 * model.shape.params / model.compute.optimizer_s(64)


def _reorth_bytes(n_r: float, width: int, steps: int = 12) -> float:
    """Full reorthogonalization's traffic (lanczos._reorthogonalize, one pass a step): at step j
    the basis' j + 1 rows read twice, and w read, the correction written and subtracted, the new
    norm (6 passes of n_r)."""
    return sum(n_r * width * (2 * (j + 1) + 6) for j in range(steps))


def _passes(model: CostModel, share: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds at the local batch 64 times the curvature share."""
    forward, backward = model.compute.forward_backward_s(64)
    return forward * share, backward * share


def test_ese_at_one_rank_is_lanczos_iterations_of_two_backwards() -> None:
    """Defaults (float64 basis, full, the subspace check): the loss and its gradient with graph
    (a forward and a backward), per step 2 backwards, 12 passes over n in float64 (⟨Hq, q⟩ and
    ‖Hq‖² 3, two updates 6, the norm 1, the new row 2), the casts to float32 and back (2 ×
    (8 + 4) bytes) and the reorthogonalization pass, the Ritz vectors (12 rows read, 3
    written), the check's forward; no collective at one rank."""
    model = _model()
    pred = model.predict(_cfg(1))
    sgd = model.predict(PlanConfig("sgd", 1, 64, "weak"))
    n = model.shape.params
    rate = _rate(model)
    steps = 12 * n * (12 * 8 + 2 * (8 + 4)) / rate
    reorth = _reorth_bytes(n, 8) / rate
    ritz = n * 8 * (12 + 3) / rate
    forward, backward = sgd.phases_s["forward"], sgd.phases_s["backward"]
    expected = forward + backward + 12 * 2 * backward + steps + reorth + ritz + forward
    assert pred.phases_s["ese"] * 50 == pytest.approx(expected, rel=1e-12)
    # FOSI's forward and backward are SGD's; its optimizer adds the projections on 3 vectors
    assert pred.phases_s["backward"] == pytest.approx(sgd.phases_s["backward"])
    projections = 2 * 3 * 4 * n / rate
    assert pred.phases_s["optimizer"] == pytest.approx(sgd.phases_s["optimizer"] + projections)
    assert pred.phases_s["param_allgather"] == pred.phases_s["grad_allreduce"] == 0.0


@pytest.mark.parametrize("reorthogonalize", ["full", "partial"])
@pytest.mark.parametrize(("dtype", "width"), [("float64", 8), ("training", 4)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_ese_is_its_products_and_basis_passes(
    reorthogonalize: str, dtype: str, width: int, ranks: int
) -> None:
    """One ESE, counted from lanczos.py and FOSI._estimate written out here: m = 12 products of
    2 backwards each on the curvature batch (16 of 64 rows), each with the vector gathered and
    the product reduce-scattered (half an allreduce of n float32 each); the loss and its
    gradient once (a forward and a backward) and the subspace check's forward; per step 12
    passes over the shard in the basis' bytes (+ 2 × (8 + 4) of casts for float64) and
    allreduces of 16 and 8 bytes; full reorthogonalization: at step j two reads of the
    basis' j + 1 rows, 6 passes over w, allreduces of 8(j + 1) and 8 bytes; the Ritz vectors
    (12 rows read, 3 written); the check's allreduce of 16 bytes. Times from the profile's
    own numbers: its forward and backward at the local batch, its optimizer's bytes per
    second, its collectives."""
    model = _model()
    cfg = _cfg(ranks, fosi_curvature_fraction=0.25, fosi_lanczos_dtype=dtype,
               fosi_reorthogonalize=reorthogonalize)  # fmt: skip
    n, m, rate = model.shape.params, 12, _rate(model)
    n_r = n / ranks
    forward, backward = _passes(model, 16 / 64)
    compute = forward + backward + m * 2 * backward + forward

    def allreduce(nbytes: float) -> float:
        return collective_s(NET, "allreduce", nbytes, ranks)

    moves = m * 2 * 0.5 * allreduce(4 * n)
    casts = 2 * (8 + 4) if width == 8 else 0
    traffic = m * n_r * (12 * width + casts) + n_r * width * (m + 3)
    scalars = m * (allreduce(16) + allreduce(8)) + allreduce(16)
    if reorthogonalize == "full":
        traffic += _reorth_bytes(n_r, width, m)
        scalars += sum(allreduce(8 * (j + 1)) + allreduce(8) for j in range(m))
    expected = compute + traffic / rate + moves + scalars
    assert _ese(model, cfg) == pytest.approx(expected, rel=1e-12)


def test_the_phase_is_the_jobs_per_step_mean_over_the_run() -> None:
    """run.json's ``ese`` is the mean over every step of the run: the ESEs the job's schedule
    (FOSI.ese_due: step >= warmup and (step - warmup) % ese_every == 0, steps 0 … S − 1) runs
    in S steps, times one ESE, over S; without the run's steps, one ESE over ese_every."""
    model = _model()
    one = _ese(model, _cfg(2, 10))  # one ESE's seconds (steady state × interval)
    for steps, warmup, every in ((60, 10, 10), (60, 20, 100), (61, 10, 10), (10, 10, 5),
                                 (7, 0, 3), (100, 0, 1)):  # fmt: skip
        count = sum(1 for s in range(steps) if s >= warmup and (s - warmup) % every == 0)
        cfg = _cfg(2, every, fosi_warmup=warmup, steps=steps)
        assert cfg.ese_per_step == count / steps
        assert model.predict(cfg).phases_s["ese"] == pytest.approx(one * count / steps)
    # the bench's runs: 5 ESEs in 60 steps, not 60 / 10
    assert _cfg(2, 10, fosi_warmup=10, steps=60).ese_per_step == pytest.approx(1 / 12)


def test_the_subspace_check_adds_a_forward_and_an_allreduce() -> None:
    model = _model()
    forward, _ = _passes(model)
    for ranks in (1, 4):
        checked = _ese(model, _cfg(ranks))
        unchecked = _ese(model, _cfg(ranks, fosi_ese_check=False))
        check = forward + collective_s(NET, "allreduce", 16, ranks)
        assert checked - unchecked == pytest.approx(check, rel=1e-9)


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
    # (V g, V v) in one allreduce of 2 × 3 float32, then V d2 in one of 3 (FOSI._update)
    scalars = collective_s(NET, "allreduce", 24, p) + collective_s(NET, "allreduce", 12, p)
    assert pred.phases_s["optimizer"] == pytest.approx(local + scalars)
    # the gradient reduce-scattered and the parameters all-gathered: half an allreduce each,
    # in the job's own phases (no host: no sync wait)
    half = 0.5 * collective_s(NET, "allreduce", 4 * n, p)
    assert pred.phases_s["param_allgather"] == pytest.approx(half)
    assert pred.phases_s["grad_allreduce"] == pytest.approx(half)


@pytest.mark.parametrize(("fraction", "rows"), [(0.25, 16), (0.3, 20), (0.001, 1)])
def test_the_products_run_on_the_curvature_batch(fraction: float, rows: int) -> None:
    """At fraction f the ESE's passes differentiate the job's ⌈f · 64⌉ leading rows: the ESE
    is cheaper by exactly (12 × 2 backwards + the loss's forward and backward + the check's
    forward) × (1 − rows / 64); nothing else moves."""
    model = _model()
    forward, backward = _passes(model)
    for ranks in (1, 4):
        whole = _ese(model, _cfg(ranks))
        part = _ese(model, _cfg(ranks, fosi_curvature_fraction=fraction))
        passes = 12 * 2 * backward + forward + backward + forward
        assert whole - part == pytest.approx(passes * (1 - rows / 64), rel=1e-9)
        assert _cfg(ranks, fosi_curvature_fraction=fraction).curvature_share == rows / 64


def test_a_training_dtype_basis_moves_half_the_bytes() -> None:
    """``training`` (the parameters' float32): 4 bytes a coordinate instead of 8 and no casts;
    the gather and reduce-scatter were in float32 already (equal at P = 4 but for the
    traffic)."""
    model = _model()
    n, rate = model.shape.params, _rate(model)
    for ranks in (1, 4):
        n_r = n / ranks
        wide = _ese(model, _cfg(ranks))
        narrow = _ese(model, _cfg(ranks, fosi_lanczos_dtype="training"))
        steps = 12 * n_r * ((12 * 8 + 2 * (8 + 4)) - 12 * 4)
        reorth = _reorth_bytes(n_r, 8) - _reorth_bytes(n_r, 4)
        ritz = n_r * (8 - 4) * (12 + 3)
        assert wide - narrow == pytest.approx((steps + reorth + ritz) / rate, rel=1e-9)
        assert _reorth_bytes(n_r, 4) == _reorth_bytes(n_r, 8) / 2


def test_partial_reorthogonalization_prices_no_pass() -> None:
    """``partial`` makes a pass only where the basis drifts (unpredictable: priced as none):
    full costs more by its passes' traffic and, per step j, an allreduce of its j + 1
    coefficients and one of the new norm."""
    model = _model()
    n, rate = model.shape.params, _rate(model)
    for ranks, width, dtype in ((1, 8, "float64"), (4, 8, "float64"), (4, 4, "training")):
        full = _ese(model, _cfg(ranks, fosi_lanczos_dtype=dtype))
        partial = _ese(model, _cfg(ranks, fosi_lanczos_dtype=dtype, fosi_reorthogonalize="partial"))
        collectives = sum(
            collective_s(NET, "allreduce", 8 * (j + 1), ranks)
            + collective_s(NET, "allreduce", 8, ranks)
            for j in range(12)
        )
        expected = _reorth_bytes(n / ranks, width) / rate + collectives
        assert full - partial == pytest.approx(expected, rel=1e-9)


def test_keep_basis_moves_memory_not_time() -> None:
    model = _model()
    freed, kept = model.predict(_cfg(4)), model.predict(_cfg(4, fosi_keep_basis=True))
    assert kept.phases_s == freed.phases_s
    # the peak is the ESE's, which holds the basis either way; kept, the basis is resident
    assert kept.memory_bytes == freed.memory_bytes
    resident = model.memory.predict(kept.config.memory_config()).parts
    assert "fosi_lanczos_basis" in resident
    assert "fosi_lanczos_basis" not in model.memory.predict(freed.config.memory_config()).parts


def test_plan_takes_the_jobs_defaults_and_lanczos_steps() -> None:
    """PlanConfig's FOSI defaults are the job's option table's; None Lanczos steps are the
    optimizer's default (FOSIOptions.iterations), the same count the memory model uses."""
    cfg = PlanConfig("fosi", 2, 64)
    for field in ("fosi_k", "fosi_l", "ese_every", "lanczos_iters", "fosi_curvature_fraction",
                  "fosi_lanczos_dtype", "fosi_reorthogonalize", "fosi_keep_basis"):  # fmt: skip
        assert getattr(cfg, field) == OPTIONS[field].default, field
    point = cfg.memory_config()  # the memory model's point: the fields memory depends on
    for field in ("fosi_k", "fosi_l", "lanczos_iters", "fosi_curvature_fraction",
                  "fosi_lanczos_dtype", "fosi_keep_basis"):  # fmt: skip
        assert getattr(point, field) == getattr(cfg, field) == OPTIONS[field].default, field
    model = _model()
    k3 = FOSIOptions(k=3).iterations
    assert _ese(model, _cfg(1, iters=None)) == _ese(model, _cfg(1, iters=k3))
    assert _ese(model, _cfg(1, iters=None)) != _ese(model, _cfg(1, iters=k3 + 1))


def _not_default(name: str) -> object:
    """A value of option ``name`` other than the job's default."""
    option = OPTIONS[name]
    if option.choices:
        return next(c for c in option.choices if c != option.default)
    if option.kind == "bool":
        return not option.default
    if option.kind == "float":
        return 0.25
    return 16 if option.default is None else option.default + 3


def test_fosi_run_config_carries_every_option_plan_prices() -> None:
    """--explain reads every FOSI option of PlanConfig from a run's config.json (each set
    apart from its default here, so a field left at its default fails), and the run's steps;
    one written before they existed gets the job's defaults and the steady state."""
    names = [f.name for f in dataclasses.fields(PlanConfig) if f.name.startswith("fosi_")]
    names += ["ese_every", "lanczos_iters"]
    assert {"fosi_k", "fosi_l", "fosi_warmup", "fosi_curvature_fraction", "fosi_lanczos_dtype",
            "fosi_reorthogonalize", "fosi_keep_basis", "fosi_ese_check"} <= set(names)  # fmt: skip
    config = {"world_size": 2, "fosi": True, "kfac": False, "batch_size": 64}
    old = config_of_run(config)
    for name in names:
        assert getattr(old, name) == OPTIONS[name].default, name
    assert old.steps is None and old.ese_per_step == 1 / OPTIONS["ese_every"].default
    values = {name: _not_default(name) for name in names}
    cfg = config_of_run({**config, **values, "steps": 60})
    for name, value in values.items():
        assert getattr(cfg, name) == value != OPTIONS[name].default, name
    assert cfg.steps == 60


def test_fosi_run_config_and_planner() -> None:
    config = {"world_size": 2, "fosi": True, "kfac": False, "batch_size": 64, "ese_every": 20}
    cfg = config_of_run(config)
    assert (cfg.method, cfg.ese_every, cfg.kfac) == ("fosi", 20, False)
    planned = build_cost_model("small_cnn", "digits", "a100-hdr200")
    (pred,) = predict_all(planned, ["fosi"], [8], 64, "weak", 10, 100, 25.0)
    assert pred.phases_s["ese"] > 0 and pred.step_s > sum(
        v for k, v in pred.phases_s.items() if k != "ese"
    )


@pytest.mark.parametrize("reorthogonalize", ["full", "partial"])
def test_every_collective_waits_what_the_sync_fit_says(reorthogonalize: str) -> None:
    """With a sync fit (a collective after T s of compute waits a + b·T), each of FOSI's
    collectives waits after the compute before it: the gradient's reduce-scatter after the
    data, forward and backward; the update's two allreduces after half the update each; the
    all-gather after none; in an ESE each product's reduce-scatter after its 2 backwards on the
    curvature batch, every other collective (the vector's gather, 2 scalar allreduces a step,
    2 more with full reorthogonalization) after none, the check's after its forward."""
    a, b, p = 1e-3, 0.5, 4
    shape = model_shape("small_cnn", "digits")
    plain = CostModel(shape, RatedCompute(MACHINE, shape), NET, Host())
    synced = CostModel(shape, RatedCompute(MACHINE, shape), NET, Host(sync=((2, a, b),)))
    cfg = _cfg(p, fosi_curvature_fraction=0.25, fosi_reorthogonalize=reorthogonalize)
    before, after = plain.predict(cfg).phases_s, synced.predict(cfg).phases_s
    forward, backward = _passes(plain)
    update = before["optimizer"] - (
        collective_s(NET, "allreduce", 24, p) + collective_s(NET, "allreduce", 12, p)
    )
    assert after["grad_allreduce"] - before["grad_allreduce"] == pytest.approx(
        a + b * (forward + backward)
    )
    assert after["optimizer"] - before["optimizer"] == pytest.approx(2 * (a + b * update / 2))
    assert after["param_allgather"] - before["param_allgather"] == pytest.approx(a)
    m, share = 12, 16 / 64
    others = m * (1 + 2 + (2 if reorthogonalize == "full" else 0))
    waits = m * (a + b * share * 2 * backward) + others * a + (a + b * share * forward)
    assert (after["ese"] - before["ese"]) * cfg.ese_every == pytest.approx(waits)
