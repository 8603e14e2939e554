"""The report's curves: the right-hand plot shows what the runs are judged by (test accuracy,
or the test loss of a language model), with the target drawn on it."""

from __future__ import annotations

import json

import pytest

from kfac_hpc.analysis import plots
from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.contracts.targets import Target
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

ACCURACY = {20: 0.5, 40: 0.8, 60: 0.9}  # the synthetic evals' test loss is 1 - accuracy


def _figure(tmp_path, monkeypatch, metric: str, target: Target):
    runs = [
        SyntheticRun(f"{name}-r0", 1, 0.1, {"forward": 0.05}, kfac=kfac, accuracy=ACCURACY)
        for name, kfac in (("sgd", False), ("kfac", True))
    ]
    write_sweep(tmp_path, runs)
    for summary in tmp_path.rglob("run.json"):
        facts = json.loads(summary.read_text())
        summary.write_text(json.dumps({**facts, "metric": metric}))
    collection = collect(tmp_path)
    tables = build_tables(collection, target)
    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or path)
    assert plots.curves_plot(collection.runs, tables.runs, tmp_path / "curves.png") is not None
    (figure,) = saved
    return figure.axes[1]


def _lines(axis):
    data = [line.get_ydata() for line in axis.get_lines()]
    curves = sorted(tuple(float(v) for v in y) for y in data if len(y) == len(ACCURACY))
    flat = {float(y[0]) for y in data if len(y) == 2 and y[0] == y[1]}  # axhline
    return curves, flat


def test_runs_judged_by_loss_plot_the_test_loss_and_its_target(tmp_path, monkeypatch):
    axis = _figure(tmp_path, monkeypatch, "loss", Target("loss", 0.15))
    assert axis.get_ylabel() == "test loss"
    curves, targets = _lines(axis)
    expected = tuple(pytest.approx(1.0 - a) for a in ACCURACY.values())
    assert curves == [expected, expected]
    assert targets == {0.15}


def test_runs_judged_by_accuracy_plot_the_accuracy_and_its_target(tmp_path, monkeypatch):
    axis = _figure(tmp_path, monkeypatch, "accuracy", Target("accuracy", 0.85))
    assert axis.get_ylabel() == "test accuracy (fraction)"
    curves, targets = _lines(axis)
    assert curves == [tuple(ACCURACY.values())] * 2
    assert targets == {0.85}
