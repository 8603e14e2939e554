"""Run directories written by the real job (``kfac-hpc train`` on digits, one process each):
collected they agree with the job's own run.json, a preempted-then-resumed run is one run with
two segments, and their report reads well in headless Chromium at 1280 px."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from tests.conftest import clean_env
from tests.helpers.browser import assert_reads_well, measure
from tests.helpers.report_checks import assert_plot, run_report

pytestmark = pytest.mark.slow

# Long enough that the preemption signal lands before the end, short enough for a test.
STEPS = 160
TRAIN = ["--model", "mlp", "--dataset", "digits", "--log-every", "4", "--no-progress"]


def _train(run_dir, *args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "kfac_hpc", "train", "--run-dir", str(run_dir), *TRAIN, *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _preempt_after_first_window(run_dir, *args, timeout=240):
    """Start a run, send SIGUSR2 once it has logged a window; returns its exit code."""
    cmd = [sys.executable, "-m", "kfac_hpc", "train", "--run-dir", str(run_dir), *TRAIN, *args]
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and b'"kind":"train"' in metrics.read_bytes():
            os.kill(proc.pid, signal.SIGUSR2)
            break
        time.sleep(0.05)
    return proc.wait(timeout=timeout)


def test_real_runs_collected_and_reported(tmp_path, chromium):
    runs = tmp_path / "runs"
    sgd = _train(runs / "sgd", "--no-kfac", "--steps", str(STEPS), "--target-accuracy", "0.5")
    assert sgd.returncode == 0, sgd.stderr
    code = _preempt_after_first_window(
        runs / "kfac", "--kfac", "--steps", str(STEPS), "--target-accuracy", "0.5"
    )
    assert code == 75, "the job should checkpoint and exit 75 on SIGUSR2"
    (row,) = [r for r in build_tables(collect(runs)).runs if r["run_id"] == "kfac"]
    assert (row["state"], row["reason"]) == ("incomplete", "preempted, waiting for requeue")
    resumed = _train(runs / "kfac", "--kfac", "--steps", str(STEPS), "--target-accuracy", "0.5")
    assert resumed.returncode == 0, resumed.stderr

    collection = collect(runs)
    tables = build_tables(collection)
    rows = {r["run_id"]: r for r in tables.runs}
    assert {r["state"] for r in rows.values()} == {"done"}
    assert (rows["kfac"]["segments"], rows["sgd"]["segments"]) == (2, 1)
    assert (rows["kfac"]["optimizer_label"], rows["sgd"]["optimizer_label"]) == ("sgd+kfac", "sgd")
    for run in collection.runs:  # the collector agrees with the job's own summary
        row = rows[run.run_id]
        assert row["samples_per_s"] == run.summary["samples_per_s"]
        assert row["wall_s"] == run.summary["wall_s"]
        assert row["step_to_target"] == run.summary["step_to_target"]
        assert row["time_to_target_s"] == pytest.approx(run.summary["time_to_target_s"])
        assert row["host_memory"] == run.summary["host_memory"] == "kept"
        phases = [p for p in tables.phases if p["run_id"] == run.run_id]
        assert sum(p["share_fraction"] for p in phases) == pytest.approx(1.0)
        segments = [s for s in tables.segments if s["run_id"] == run.run_id]
        assert sum(s["wall_s"] for s in segments) == pytest.approx(row["wall_s"])
        assert segments[-1]["end_step"] == STEPS
    kfac_phases = {p["phase"] for p in tables.phases if p["run_id"] == "kfac"}
    assert {"factor_compute", "inverse_compute", "precondition"} <= kfac_phases

    result = run_report(runs)
    assert result.returncode == 0, result.stderr
    for name in ("throughput", "phases", "curves", "step_time"):
        assert_plot(runs / "report" / "img" / f"{name}.png")
    facts = measure(runs / "report" / "report.html", chromium, tmp_path)
    assert_reads_well(facts)
    assert "1 requeued (kfac)" in facts["summary"]
