"""Known timings in, exact metrics out: run directories written by the tests, collected from disk.

Each synthetic step takes ``step_s`` seconds, so throughput is ``batch / step_s`` and an eval at
step k happens at ``k * step_s`` running seconds. Expected values are computed here from those
numbers with the textbook formulas; tolerance 1e-12 relative (float rounding only).
"""

from __future__ import annotations

import numpy as np
import pytest

from kfac_hpc.analysis import stats
from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.contracts.targets import Target
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

EXACT = 1e-12
PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.006, "optimizer": 0.004}
KFAC_PHASES = {**PHASES, "factor_comm": 0.003, "inverse_compute": 0.005, "inverse_comm": 0.002}
# nodes -> seconds per step of repeat 0 and repeat 1 (SGD); K-FAC steps are 1.5x longer.
STEP_S = {1: (0.100, 0.104), 2: (0.060, 0.058), 4: (0.040, 0.041)}
BATCH = 64
# eval step -> accuracy: SGD reaches 0.9 at step 80, K-FAC at step 40.
SGD_ACC = {20: 0.5, 40: 0.8, 60: 0.85, 80: 0.91, 100: 0.93}
KFAC_ACC = {20: 0.7, 40: 0.9, 60: 0.93, 80: 0.95, 100: 0.96}
TARGET = 0.9


def _sweep(tmp_path):
    runs = []
    for nodes, times in STEP_S.items():
        for repeat, step_s in enumerate(times):
            common = {"nodes": nodes, "batch_size": BATCH, "seed": repeat, "rank_skew": 0.1}
            runs.append(
                SyntheticRun(
                    f"sgd-n{nodes}-r{repeat}",
                    step_s=step_s,
                    phases_s=PHASES,
                    accuracy=SGD_ACC,
                    target_accuracy=TARGET,
                    **common,
                )
            )
            runs.append(
                SyntheticRun(
                    f"kfac-n{nodes}-r{repeat}",
                    step_s=1.5 * step_s,
                    phases_s=KFAC_PHASES,
                    kfac=True,
                    accuracy=KFAC_ACC,
                    target_accuracy=TARGET,
                    **common,
                )
            )
    write_sweep(tmp_path, runs)
    return build_tables(collect(tmp_path))


def _cell(tables, optimizer_label, nodes):
    (cell,) = [
        c for c in tables.scaling if c["optimizer_label"] == optimizer_label and c["nodes"] == nodes
    ]
    return cell


def _median(values):
    return float(np.median(values))


def test_throughput_speedup_efficiency_and_karp_flatt_are_exact(tmp_path):
    tables = _sweep(tmp_path)
    throughput = {n: [BATCH / t for t in ts] for n, ts in STEP_S.items()}
    base = _median(throughput[1])
    for nodes in STEP_S:
        cell = _cell(tables, "sgd", nodes)
        speedup = _median(throughput[nodes]) / base
        p = nodes / 1
        assert cell["runs"] == 2
        assert cell["samples_per_s_median"] == pytest.approx(_median(throughput[nodes]), rel=EXACT)
        assert cell["samples_per_s_min"] == pytest.approx(min(throughput[nodes]), rel=EXACT)
        assert cell["samples_per_s_max"] == pytest.approx(max(throughput[nodes]), rel=EXACT)
        assert cell["samples_per_s_per_rank_median"] == pytest.approx(
            _median(throughput[nodes]) / nodes, rel=EXACT
        )
        assert cell["speedup"] == pytest.approx(speedup, rel=EXACT)
        assert cell["speedup_min"] == pytest.approx(
            min(throughput[nodes]) / max(throughput[1]), rel=EXACT
        )
        assert cell["speedup_max"] == pytest.approx(
            max(throughput[nodes]) / min(throughput[1]), rel=EXACT
        )
        assert cell["ideal_speedup"] == p
        assert cell["parallel_efficiency"] == pytest.approx(speedup / p, rel=EXACT)
        assert cell["weak_efficiency"] is None
        if nodes == 1:
            assert cell["karp_flatt_serial_fraction"] is None
        else:
            expected = (1 / speedup - 1 / p) / (1 - 1 / p)
            assert cell["karp_flatt_serial_fraction"] == pytest.approx(expected, rel=EXACT)


def test_time_to_target_and_kfac_ratio_are_exact(tmp_path):
    tables = _sweep(tmp_path)
    for nodes, times in STEP_S.items():
        sgd, kfac = _cell(tables, "sgd", nodes), _cell(tables, "sgd+kfac", nodes)
        sgd_tts = [80 * t for t in times]  # first SGD eval >= 0.9 is at step 80
        kfac_tts = [40 * 1.5 * t for t in times]  # K-FAC: step 40 with 1.5x slower steps
        assert sgd["target_reached"] == "2/2"
        assert sgd["time_to_target_s_median"] == pytest.approx(_median(sgd_tts), rel=EXACT)
        assert sgd["time_to_target_s_min"] == pytest.approx(min(sgd_tts), rel=EXACT)
        assert kfac["time_to_target_s_max"] == pytest.approx(max(kfac_tts), rel=EXACT)
        assert kfac["kfac_vs_first_order_tts_ratio"] == pytest.approx(
            _median(kfac_tts) / _median(sgd_tts), rel=EXACT
        )
        assert kfac["kfac_vs_first_order_tts_ratio"] == pytest.approx(0.75, rel=EXACT)
        assert sgd["kfac_vs_first_order_tts_ratio"] is None
    for row in tables.runs:
        repeat = int(row["run_id"][-1])
        step_s = STEP_S[row["nodes"]][repeat] * (1.5 if row["kfac"] else 1.0)
        assert row["step_to_target"] == (40 if row["kfac"] else 80)
        assert row["time_to_target_s"] == pytest.approx(row["step_to_target"] * step_s, rel=EXACT)


def test_target_override_recomputes_time_to_target(tmp_path):
    tables = _sweep(tmp_path)
    higher = build_tables(collect(tmp_path), Target("accuracy", 0.95))
    by_id = {r["run_id"]: r for r in higher.runs}
    assert by_id["sgd-n1-r0"]["time_to_target_s"] is None  # SGD never reaches 0.95
    assert by_id["kfac-n1-r0"]["time_to_target_s"] == pytest.approx(80 * 1.5 * 0.100, rel=EXACT)
    assert _cell(higher, "sgd", 1)["target_reached"] == "0/2"
    assert _cell(tables, "sgd", 1)["target_reached"] == "2/2"


def test_loss_target_override_takes_the_first_eval_at_or_below_it(tmp_path):
    """The synthetic evals' test loss is 1 - accuracy: at most 0.12 from step 80 for SGD
    (0.09) and from step 40 for K-FAC (0.10); at most 0.06 only for K-FAC, from step 80."""
    _sweep(tmp_path)
    tables = build_tables(collect(tmp_path), Target("loss", 0.12))
    by_id = {r["run_id"]: r for r in tables.runs}
    for nodes, (step_s, _) in STEP_S.items():
        sgd, kfac = by_id[f"sgd-n{nodes}-r0"], by_id[f"kfac-n{nodes}-r0"]
        assert (sgd["target_loss"], sgd["target_accuracy"]) == (0.12, None)
        assert sgd["step_to_target"] == 80 and kfac["step_to_target"] == 40
        assert sgd["time_to_target_s"] == pytest.approx(80 * step_s, rel=EXACT)
        assert kfac["time_to_target_s"] == pytest.approx(40 * 1.5 * step_s, rel=EXACT)
    lower = build_tables(collect(tmp_path), Target("loss", 0.06))
    by_id = {r["run_id"]: r for r in lower.runs}
    assert by_id["sgd-n1-r0"]["time_to_target_s"] is None
    assert by_id["kfac-n1-r0"]["step_to_target"] == 80
    assert _cell(lower, "sgd", 1)["target_reached"] == "0/2"
    assert _cell(lower, "sgd+kfac", 1)["target_reached"] == "2/2"


def test_phase_shares_comm_fraction_and_straggler_spread_are_exact(tmp_path):
    tables = _sweep(tmp_path)
    total = sum(KFAC_PHASES.values())
    comm = KFAC_PHASES["factor_comm"] + KFAC_PHASES["inverse_comm"] + KFAC_PHASES["grad_allreduce"]
    rows = [p for p in tables.phases if p["run_id"] == "kfac-n4-r0"]
    assert {r["phase"] for r in rows} == set(KFAC_PHASES)
    for row in rows:
        assert row["mean_s"] == pytest.approx(KFAC_PHASES[row["phase"]], rel=EXACT)
        assert row["p50_s"] == pytest.approx(KFAC_PHASES[row["phase"]], rel=EXACT)
        assert row["share_fraction"] == pytest.approx(KFAC_PHASES[row["phase"]] / total, rel=EXACT)
        # rank_skew 0.1 over 4 ranks: factors 0.85, 0.95, 1.05, 1.15 of the mean
        assert row["rank_spread_s"] == pytest.approx(0.3 * KFAC_PHASES[row["phase"]], rel=1e-9)
    assert sum(r["share_fraction"] for r in rows) == pytest.approx(1.0, rel=EXACT)
    run = next(r for r in tables.runs if r["run_id"] == "kfac-n4-r0")
    assert run["comm_fraction"] == pytest.approx(comm / total, rel=EXACT)
    assert run["straggler_spread_fraction"] == pytest.approx(0.3, rel=1e-9)
    one_rank = next(r for r in tables.runs if r["run_id"] == "kfac-n1-r0")
    assert one_rank["straggler_spread_fraction"] == 0.0


def test_weak_scaling_efficiency_is_step_time_ratio(tmp_path):
    # Weak scaling: per-rank batch fixed, so ideal throughput grows with the nodes.
    step_s = {1: 0.050, 2: 0.055, 4: 0.0625, 8: 0.080}
    runs = [
        SyntheticRun(f"weak-n{n}", n, t, PHASES, scaling="weak", batch_size=32)
        for n, t in step_s.items()
    ]
    write_sweep(tmp_path, runs)
    tables = build_tables(collect(tmp_path))
    assert len({c["group"] for c in tables.scaling}) == 1
    for cell in tables.scaling:
        nodes = cell["nodes"]
        assert cell["samples_per_s_median"] == pytest.approx(32 * nodes / step_s[nodes], rel=EXACT)
        assert cell["weak_efficiency"] == pytest.approx(step_s[1] / step_s[nodes], rel=EXACT)
        assert cell["parallel_efficiency"] is None
        assert cell["karp_flatt_serial_fraction"] is None


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for size in (1, 2, 5, 40):
        values = rng.random(size).tolist()
        for q in (0, 10, 50, 90, 100):
            assert stats.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=EXACT)
    assert stats.percentile([], 50) is None


def test_failed_runs_do_not_enter_the_metrics(tmp_path):
    runs = [
        SyntheticRun("a-n1", 1, 0.1, PHASES),
        SyntheticRun("a-n2", 2, 0.05, PHASES),
        SyntheticRun("a-n2-crashed", 2, 0.5, PHASES, seed=1, state="error"),
    ]
    write_sweep(tmp_path, runs)
    tables = build_tables(collect(tmp_path))
    cell = _cell(tables, "sgd", 2)
    assert (cell["points"], cell["runs"]) == (2, 1)
    assert cell["speedup"] == pytest.approx(2.0, rel=EXACT)
    assert cell["parallel_efficiency"] == pytest.approx(1.0, rel=EXACT)
