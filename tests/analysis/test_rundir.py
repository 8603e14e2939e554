"""Run directories in every shape a cluster leaves them: requeued, preempted, failed, killed,
truncated, corrupt. Each becomes a row with a state and a reason; nothing raises."""

from __future__ import annotations

import json
import math

import pytest

from kfac_hpc.analysis import rundir, schema
from kfac_hpc.analysis.collect import CollectError, Collection, collect, find_run_dirs
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.analysis.rundir import _without_rank_arrays, read_run_dir
from tests.helpers.synthetic_runs import SyntheticRun, write_run_dir, write_sweep

PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.01}


def _run(name="r", **kw):
    defaults = {"nodes": 2, "step_s": 0.05, "phases_s": PHASES, "steps": 100}
    return SyntheticRun(name, **{**defaults, **kw})


def build_tables_for(run):
    return build_tables(Collection(run.path.parent, [run]))


def test_requeued_point_is_one_run_with_two_segments(tmp_path):
    write_sweep(tmp_path, [_run("requeued", attempt_ends=(60,))])
    tables = build_tables(collect(tmp_path))
    (row,) = tables.runs
    assert (row["state"], row["segments"], row["restarts"]) == ("done", 2, 1)
    segments = [s for s in tables.segments if s["run_id"] == "requeued"]
    assert [(s["segment"], s["start_step"], s["end_step"], s["end"]) for s in segments] == [
        (0, 0, 60, "preempted"),
        (1, 60, 100, "done"),
    ]
    # compute time of a segment: its steps times step_s, from the metrics records
    assert segments[0]["compute_s"] == pytest.approx(60 * 0.05, rel=1e-12)
    assert segments[1]["compute_s"] == pytest.approx(40 * 0.05, rel=1e-12)
    assert segments[0]["wall_s"] + segments[1]["wall_s"] == pytest.approx(row["wall_s"])


def test_segments_rebuilt_from_records_while_waiting_for_requeue(tmp_path):
    # Preempted at step 60 (after a first requeue at 30): no run.json yet, a preempted marker.
    path = write_run_dir(tmp_path / "p", _run(attempt_ends=(30, 60), state="preempted"))
    run = read_run_dir(path)
    assert run.state == schema.INCOMPLETE
    assert "preempted" in run.reason
    assert [(s.attempt, s.start_step, s.end_step) for s in run.segments] == [
        (0, 0, 30),
        (1, 30, 60),
    ]
    assert [s.wall_s for s in run.segments] == pytest.approx([30 * 0.05, 30 * 0.05])
    assert [s.end for s in run.segments] == ["requeued", "incomplete"]


def test_error_marker_gives_failed_row_with_its_message(tmp_path):
    path = write_run_dir(tmp_path / "e", _run(state="error"))
    (path / "error").write_text("RuntimeError: NCCL timeout on rank 3\ntraceback...\n")
    run = read_run_dir(path)
    assert run.state == schema.FAILED
    assert run.reason == "error: RuntimeError: NCCL timeout on rank 3"


def test_killed_run_without_marker_is_incomplete_with_partial_metrics(tmp_path):
    path = write_run_dir(tmp_path / "k", _run(state="running"))
    run = read_run_dir(path)
    assert run.state == schema.INCOMPLETE
    assert "no done/error marker" in run.reason
    (row,) = build_tables_for(run).runs
    assert row["samples_per_s"] == pytest.approx(64 / 0.05)  # from the windows it wrote
    assert row["steps"] == 50


def test_truncated_last_line_and_malformed_lines_are_skipped_with_notes(tmp_path):
    path = write_run_dir(tmp_path / "t", _run(state="running"))
    lines = (path / "metrics.jsonl").read_text().splitlines()
    lines.insert(2, "{not json")
    lines.insert(3, json.dumps({"schema": 1, "kind": "train", "step": "twelve"}))
    text = "\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2]  # cut mid-record
    (path / "metrics.jsonl").write_text(text)
    run = read_run_dir(path)
    assert run.stats.windows == 5  # steps 10..50, every complete valid record
    assert "metrics.jsonl: last line truncated (skipped)" in run.notes
    assert "metrics.jsonl: 2 malformed record(s) skipped" in run.notes
    assert run.state == schema.INCOMPLETE


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = write_run_dir(tmp_path / "n", _run())
    (path / "metrics.jsonl").write_text((path / "metrics.jsonl").read_text().rstrip("\n"))
    run = read_run_dir(path)
    assert run.stats.windows == 10
    assert not run.notes


def _read_fields(run):
    return (run.state, run.notes, run.evals, run.segments, run.stats)


@pytest.mark.parametrize("finished", [True, False])
def test_orjson_pass_and_standard_library_read_a_file_alike(tmp_path, monkeypatch, finished):
    """The fast parser (orjson) and the tolerant one (json, line by line) give the same run."""
    path = write_run_dir(tmp_path / "r", _run(state="done" if finished else "running"))
    fast = read_run_dir(path)
    monkeypatch.setattr(rundir, "_parse_fast", lambda body: None)
    assert _read_fields(read_run_dir(path)) == _read_fields(fast)
    assert fast.stats.windows == (10 if finished else 5)


def test_records_orjson_refuses_are_read_by_the_standard_library(tmp_path):
    """NaN (which Python's json writes) and a line of invalid UTF-8: the run is still read."""
    path = write_run_dir(tmp_path / "r", _run())
    lines = (path / "metrics.jsonl").read_bytes().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "loss": float("nan")}).encode()
    lines.insert(1, b'{"schema": 1, "kind": "train", "note": "\xff' + bytes([0xFF]) + b'"}')
    (path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert rundir._parse_fast(b"\n".join(lines)) is None
    run = read_run_dir(path)
    assert run.stats.windows == 10
    assert math.isnan(run.stats.loss[0]) and not math.isnan(run.stats.loss[1])
    assert "metrics.jsonl: 1 malformed record(s) skipped" in run.notes


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "run.json: not valid JSON"),
        ("", "run.json: empty"),
        ("[1, 2]", "run.json: expected a JSON object"),
        ('{"schema": 7, "state": "done"}', "run.json: schema 7 is not 1"),
    ],
)
def test_done_marker_with_bad_run_json_is_invalid(tmp_path, content, message):
    path = write_run_dir(tmp_path / "b", _run())
    (path / "run.json").write_text(content)
    run = read_run_dir(path)
    assert run.state == schema.INVALID
    assert run.reason == "done marker but run.json missing or unreadable"
    assert any(note.startswith(message) for note in run.notes)
    (row,) = build_tables_for(run).runs  # still a row, from metrics.jsonl
    assert row["samples_per_s"] == pytest.approx(64 / 0.05)


def test_corrupt_config_of_unfinished_run_is_invalid(tmp_path):
    path = write_run_dir(tmp_path / "c", _run(state="running"))
    (path / "config.json").write_bytes(b"\x00\x01garbage")
    run = read_run_dir(path)
    assert run.state == schema.INVALID
    assert "config.json: not valid JSON" in run.reason


def test_both_markers_is_invalid(tmp_path):
    path = write_run_dir(tmp_path / "b", _run())
    (path / "error").write_text("late failure")
    assert read_run_dir(path).state == schema.INVALID


def test_unknown_fields_and_record_kinds_are_ignored(tmp_path):
    path = write_run_dir(tmp_path / "u", _run())
    summary = json.loads((path / "run.json").read_text())
    summary["new_field_from_a_later_version"] = {"x": 1}
    (path / "run.json").write_text(json.dumps(summary))
    with open(path / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"schema": 1, "kind": "event", "what": "checkpoint"}) + "\n")
    run = read_run_dir(path)
    assert (run.state, run.notes) == (schema.DONE, [])


def test_manifest_states_of_points_without_markers(tmp_path):
    runs = [_run("timed-out", state="running"), _run("queued", seed=1), _run("gone", seed=2)]
    write_sweep(tmp_path, runs, states={"timed-out": "timeout", "queued": "pending"})
    for name in ("queued", "gone"):
        for item in (tmp_path / "runs" / name).iterdir():
            item.unlink() if item.is_file() else item.rmdir()
        (tmp_path / "runs" / name).rmdir()
    rows = {r["run_id"]: r for r in build_tables(collect(tmp_path)).runs}
    assert (rows["timed-out"]["state"], rows["timed-out"]["reason"]) == (
        "failed",
        "job timeout (manifest), no done marker",
    )
    assert (rows["queued"]["state"], rows["queued"]["reason"]) == (
        "incomplete",
        "not started (job pending)",
    )
    assert rows["gone"]["state"] == "missing"  # the manifest says done, the directory is gone
    assert rows["gone"]["group"] == rows["queued"]["group"]  # parameters come from the manifest


def test_folder_without_manifest_is_scanned(tmp_path):
    write_run_dir(tmp_path / "a" / "run1", _run("x"))
    write_run_dir(tmp_path / "b" / "run2", _run("y", nodes=4))
    (tmp_path / "notes").mkdir()
    assert find_run_dirs(tmp_path) == [tmp_path / "a" / "run1", tmp_path / "b" / "run2"]
    assert [r.state for r in collect(tmp_path).runs] == ["done", "done"]
    assert len(collect(tmp_path / "a" / "run1").runs) == 1  # a run directory itself


def test_bad_inputs_raise_collect_error_naming_the_fix(tmp_path):
    with pytest.raises(CollectError, match="not a directory"):
        collect(tmp_path / "nope")
    with pytest.raises(CollectError, match="no run directory"):
        collect(tmp_path)
    (tmp_path / "manifest.json").write_text('{"points": [')
    with pytest.raises(CollectError, match="collect the run folder directly"):
        collect(tmp_path)
    (tmp_path / "manifest.json").write_text('{"points": 3}')
    with pytest.raises(CollectError, match="'points' must be a list"):
        collect(tmp_path)


def test_rank_array_skipping_keeps_every_other_field():
    record = {
        "schema": 1,
        "kind": "train",
        "rank_step_s": None,  # not the plain shape: must be left for the parser
        "step_s": 0.1,
        "tags": [1, 2],
        "rank_phases_s": {"forward": [0.1, 0.2], "backward": [0.3, 0.4]},
        "step": 5,
    }
    for separators in ((",", ":"), (", ", ": ")):
        line = json.dumps(record, separators=separators).encode()
        parsed = json.loads(_without_rank_arrays(line))
        assert parsed == {**record, "rank_phases_s": 0}
    plain = {**record, "rank_step_s": [0.1, 0.2]}
    parsed = json.loads(_without_rank_arrays(json.dumps(plain).encode() + b"\n" * 2))
    assert parsed == {**plain, "rank_step_s": 0, "rank_phases_s": 0}
    nested = {**record, "rank_phases_s": {"forward": {"mean": [0.1]}}}  # not plain: kept
    assert json.loads(_without_rank_arrays(json.dumps(nested).encode())) == nested


def test_per_rank_figures_agree_from_run_json_and_from_records(tmp_path):
    # run.json's per-rank summaries (fast path) and the records' arrays give the same figures.
    path = write_run_dir(tmp_path / "r", _run(nodes=4, rank_skew=0.1))
    fast = build_tables_for(read_run_dir(path))
    summary = json.loads((path / "run.json").read_text())
    del summary["rank_phases_s"], summary["samples_per_s_per_rank"]
    (path / "run.json").write_text(json.dumps(summary))
    slow_run = read_run_dir(path)
    assert slow_run.stats.rank_step_s  # the arrays were read this time
    slow = build_tables_for(slow_run)
    assert fast.runs[0]["straggler_spread_fraction"] == pytest.approx(0.3, rel=1e-9)
    assert slow.runs[0]["straggler_spread_fraction"] == pytest.approx(0.3, rel=1e-9)
    for a, b in zip(fast.phases, slow.phases, strict=True):
        assert a["rank_spread_s"] == pytest.approx(b["rank_spread_s"], rel=1e-9)


def test_resumed_attempt_without_marker_extends_the_summary_segments(tmp_path):
    # Preempted at step 60 (run.json written then), requeued, killed at step 80 without a marker.
    done = write_run_dir(tmp_path / "full", _run(attempt_ends=(60,)))
    path = write_run_dir(tmp_path / "r", _run(attempt_ends=(60,), state="running"))
    summary = json.loads((done / "run.json").read_text())
    summary["state"] = "preempted"
    summary["attempts"] = summary["attempts"][:1]
    (path / "run.json").write_text(json.dumps(summary))
    records = (done / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in records if json.loads(line)["step"] <= 80]
    (path / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    run = read_run_dir(path)
    assert run.state == schema.INCOMPLETE
    assert run.reason.startswith("attempt 1 started after the preemption")
    assert [(s.attempt, s.start_step, s.end_step, s.end) for s in run.segments] == [
        (0, 0, 60, "preempted"),
        (1, 60, 80, "incomplete"),
    ]
    assert run.segments[1].wall_s == pytest.approx(20 * 0.05)
    assert run.stats.rank_step_s  # unfinished: the records' per-rank arrays are read
