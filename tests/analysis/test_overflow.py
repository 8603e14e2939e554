"""A done run whose run.json, config.json or metrics hold a number no table column can hold
(an integer beyond int64, a float where an integer belongs): the value is a note on that run,
and collect and report write every table, Parquet included (issue 14)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kfac_hpc.analysis.cli import collect_command, report_command
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.01}
HUGE = 99999999999999999999999


def _edit_json(path, **values):
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data))


def _edit_metrics(path, **values):
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record.update(values)
    lines[0] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")


CASES = {
    "world_size_1e308": ("run.json", {"world_size": 1e308}, "world_size"),
    "attempt_huge": ("run.json", {"attempt": HUGE}, "attempt"),
    "nodes_huge": ("run.json", {"nodes": HUGE}, "nodes"),
    "steps_inf": ("run.json", {"steps": float("inf")}, "steps"),
    "restarts_1e400": ("run.json", {"restarts": 10**400}, "restarts"),
    "config_seed_huge": ("config.json", {"seed": HUGE}, "seed"),
    "record_attempt_huge": ("metrics.jsonl", {"attempt": HUGE}, "int64"),
    "record_step_1e308": ("metrics.jsonl", {"step": 1e308}, "int64"),
    "record_window_huge": ("metrics.jsonl", {"window_steps": 10**400}, "int64"),
}


# report runs the collector too: two cases through it, every case through collect.
RUNS = [(case, "collect") for case in sorted(CASES)]
RUNS += [("world_size_1e308", "report"), ("record_attempt_huge", "report")]


@pytest.mark.parametrize(("case", "command"), RUNS)
def test_an_overflowing_value_is_a_note_not_the_end_of_the_report(tmp_path, case, command):
    name, values, note = CASES[case]
    good = SyntheticRun("good", 1, 0.1, PHASES, steps=40, accuracy={40: 0.9})
    bad = SyntheticRun("bad", 2, 0.05, PHASES, steps=40, accuracy={40: 0.9})
    sweep = tmp_path / "sweep"
    write_sweep(sweep, [good, bad])
    target = sweep / "runs" / "bad" / name
    (_edit_metrics if name == "metrics.jsonl" else _edit_json)(target, **values)
    out = tmp_path / "out"
    cmd = collect_command if command == "collect" else report_command
    result = CliRunner().invoke(cmd, [str(sweep), "--out", str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    tables = out / "tables" if (out / "tables").is_dir() else out
    runs = pq.read_table(tables / "runs.parquet").to_pylist()
    assert sorted(r["run_id"] for r in runs) == ["bad", "good"]
    row = next(r for r in runs if r["run_id"] == "bad")
    assert row["state"] == "done"
    if note is not None:
        assert note in row["notes"], row["notes"]
    for stem in ("runs", "phases", "segments", "scaling"):
        assert (tables / f"{stem}.parquet").is_file() and (tables / f"{stem}.csv").is_file()
