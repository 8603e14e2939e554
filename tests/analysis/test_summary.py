"""The report's summary from a sweep with known timings: known numbers give known sentences."""

from __future__ import annotations

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.humanize import Column, render_columns, sig3
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.analysis.summary import summary_sentences
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

PHASES = {"forward": 0.02, "backward": 0.03}
# Step seconds per node count: throughput = 64 / step_s samples/s (global batch 64).
SGD_STEP = {1: 0.1, 2: 0.06, 4: 0.055}
KFAC_STEP = {1: 0.13, 2: 0.08, 4: 0.07}
# SGD reaches accuracy 0.8 at step 40, K-FAC at step 20: time to target = step * step_s.
SGD_ACC = {20: 0.5, 40: 0.85, 60: 0.9}
KFAC_ACC = {20: 0.85, 40: 0.9, 60: 0.92}


def _run(name, nodes, kfac, target=0.8, **kw):
    return SyntheticRun(
        name,
        nodes,
        (KFAC_STEP if kfac else SGD_STEP)[nodes],
        PHASES,
        ranks_per_node=2,  # rank factors 1 + skew (r - (world - 1) / 2): spread skew (world - 1)
        kfac=kfac,
        steps=60,
        accuracy=KFAC_ACC if kfac else SGD_ACC,
        target_accuracy=target,
        rank_skew=0.005 if kfac else 0.01,
        **kw,
    )


def _sentences(tmp_path, runs):
    write_sweep(tmp_path, runs)
    tables = build_tables(collect(tmp_path))
    return summary_sentences(tables.scaling, tables.runs)


def test_known_timings_give_known_sentences(tmp_path):
    runs = [_run(f"{'kfac' if k else 'sgd'}-n{n}", n, k) for n in (1, 2, 4) for k in (False, True)]
    runs[3].attempt_ends = (30,)  # kfac-n2 was requeued once
    runs.append(_run("sgd-n4-late", 4, False, state="error", seed=9))
    assert _sentences(tmp_path, runs) == [
        # one direction: K-FAC's time over SGD's, (20 * 0.13) / (40 * 0.1) = 0.65,
        # (20 * 0.08) / (40 * 0.06) = 0.667, 1.4 / 2.2 = 0.636
        "K-FAC reaches the target accuracy of 80 % in 0.650× SGD's time at 1 node (2.60 s "
        "against 4.00 s), 0.667× at 2 nodes (1.60 s against 2.40 s) and 0.636× at 4 nodes "
        "(1.40 s against 2.20 s).",
        # 64 / 0.1 = 640 and 64 / 0.055 = 1163.6 samples/s; K-FAC is slower per step throughout
        "Highest throughput: SGD at every node count, from 640 samples/s at 1 node to "
        "1,160 samples/s at 4 nodes.",
        # SGD at 4 nodes: (64 / 0.055) / 640 / 4 = 0.455; K-FAC 0.464: the lower one is named
        "Parallel efficiency drops below 0.5 at 4 nodes (0.455 for SGD: 1.82× the throughput "
        "on 4× the nodes).",
        # SGD, 8 ranks at 4 nodes: factors 1 - 0.035 .. 1 + 0.035: (max - min) / mean = 7 %
        "Stragglers: the ranks' mean step times spread by up to 7.00 % (SGD at 4 nodes).",
        "6 of 7 points finished; 1 failed (sgd-n4-late); 1 requeued (kfac-n2).",
    ]


def test_without_target_or_stragglers_the_sentences_say_so(tmp_path):
    runs = [
        _run(f"{'kfac' if k else 'sgd'}-n{n}", n, k, target=None)
        for n in (1, 2)
        for k in (False, True)
    ]
    for run in runs:
        run.rank_skew = 0.001  # 4 ranks at 2 nodes: spread 0.3 %
    assert _sentences(tmp_path, runs) == [
        "K-FAC and first-order time to target are not compared: no target was set "
        "(pass --target-accuracy or --target-loss).",
        "Highest throughput: SGD at every node count, from 640 samples/s at 1 node to "
        "1,070 samples/s at 2 nodes.",
        # SGD 1066.7 / 640 / 2 = 0.833, K-FAC 800 / 492.3 / 2 = 0.813
        "Parallel efficiency stays at or above 0.5 up to 2 nodes (lowest 0.813 for K-FAC, "
        "grad workers 1/1 at 2 nodes: 1.63× the throughput on 2× the nodes).",
        "No stragglers: the ranks' mean step times lie within 0.300 %.",
        "All 4 points finished.",
    ]


def test_numbers_for_people_have_three_significant_digits_and_units():
    assert [sig3(v) for v in (8.387e-05, 0.0123456, 1.0, 84.349, 999.7, 12345.6, -0.5)] == [
        "0.0000839",
        "0.0123",
        "1.00",
        "84.3",
        "1,000",
        "12,300",
        "-0.500",
    ]
    rows = [{"f": 8.387e-05, "c": 0.25, "x": 1234.5}, {"f": 1.2e-4, "c": None, "x": 2.0}]
    titles, cells = render_columns(
        rows,
        [Column("f", "forward", "time"), Column("c", "comm", "percent"), Column("x", "x")],
    )
    assert titles == ["forward (µs)", "comm (%)", "x"]
    assert cells == [["83.9", "25.0", "1234.5"], ["120", "–", "2.0"]]
