"""`kfac-hpc report` shows the plan's predictions beside the measurements, per phase: a sweep
of synthetic runs (known phase times) with a predictions file of known numbers; the rows, the
report's section and the terminal table carry exactly those numbers; a broken predictions
file is bad input (exit 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.predicted import load_predicted, predicted_rows
from kfac_hpc.cli import main
from kfac_hpc.contracts.rundir import PREDICTED
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

MEASURED = {"forward": 0.020, "backward": 0.030, "grad_allreduce": 0.004}  # step 0.060 s
PREDICTED_PHASES = {"forward": 0.018, "backward": 0.033, "grad_allreduce": 0.005}


def _sweep(root: Path) -> Path:
    runs = [
        SyntheticRun("sgd-n2", 2, 0.060, MEASURED, steps=20),
        SyntheticRun("sgd-n4", 4, 0.040, {"forward": 0.01}, steps=20),  # no prediction
    ]
    write_sweep(root, runs)
    predictions = {
        "runs/sgd-n2": {
            "method": "sgd",
            "ranks": 2,
            "phases_s": {**PREDICTED_PHASES, "optimizer": 0.0},
            "other_s": 0.002,
            "step_s": 0.058,
        }
    }
    (root / PREDICTED).write_text(json.dumps({"source": "test profile", "runs": predictions}))
    return root


def test_rows_pair_each_prediction_with_the_measurement(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    collection = collect(root)
    loaded = load_predicted(root)
    assert loaded is not None and loaded.source == "test profile"
    rows = {r["phase"]: r for r in predicted_rows(collection, loaded)}
    assert {r["run_id"] for r in predicted_rows(collection, loaded)} == {"sgd-n2"}
    # phases neither predicted nor measured are left out; other and step always come
    assert set(rows) == {"forward", "backward", "grad_allreduce", "other", "step"}
    assert rows["forward"]["predicted_s"] == pytest.approx(0.018)
    assert rows["forward"]["measured_s"] == pytest.approx(0.020)
    assert rows["forward"]["ratio"] == pytest.approx(0.9)
    assert rows["backward"]["ratio"] == pytest.approx(1.1)
    # measured "other": the step minus its phases (0.060 - 0.054)
    assert rows["other"]["measured_s"] == pytest.approx(0.006)
    assert rows["other"]["predicted_s"] == pytest.approx(0.002)
    assert rows["step"]["measured_s"] == pytest.approx(0.060)
    assert rows["step"]["ratio"] == pytest.approx(0.058 / 0.060)
    assert rows["step"]["world_size"] == 2


def test_report_shows_predicted_next_to_measured(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    result = CliRunner().invoke(main, ["report", str(root)])
    assert result.exit_code == 0, result.output
    terminal = result.stdout
    assert "predicted (test profile) vs measured" in terminal
    line = next(x for x in terminal.splitlines() if "sgd-n2" in x and " step " in f" {x} ")
    assert line.split()[-3:] == ["58.0", "60.0", "0.967×"]  # ms, ms, predicted / measured
    report = (root / "report" / "report.md").read_text()
    assert "## Predicted vs measured (kfac-hpc plan)" in report
    section = report.split("## Predicted vs measured (kfac-hpc plan)")[1].split("\n## ")[0]
    assert "test profile" in section
    # | point | method | ranks | phase | predicted (ms) | measured (ms) | predicted / measured |
    rows = [r.split("|")[1:-1] for r in section.splitlines() if r.startswith("| sgd-n2")]
    cells = {r[3].strip(): [c.strip() for c in r] for r in rows}
    assert cells["forward"][4:] == ["18.0", "20.0", "0.900×"]
    assert cells["step"][4:] == ["58.0", "60.0", "0.967×"]
    assert "Predicted vs measured" in (root / "report" / "report.html").read_text()


def test_broken_predictions_file_is_bad_input(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    (root / PREDICTED).write_text("{not json")
    result = CliRunner().invoke(main, ["report", str(root)])
    assert result.exit_code == 2
    assert "predicted.json" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (root / "report").exists()


def test_report_json_document_carries_the_rows(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "sweep")
    result = CliRunner().invoke(main, ["report", str(root), "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {r["phase"]: r for r in json.loads(result.stdout)["predicted"]}
    assert rows["backward"]["predicted_s"] == pytest.approx(0.033)
    assert rows["backward"]["measured_s"] == pytest.approx(0.030)
