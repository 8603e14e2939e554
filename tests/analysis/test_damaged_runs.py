"""Generated damage to a finished run (its done marker and run.json intact): a metrics.jsonl that
is missing, empty, cut, binary or holds values of the wrong type, a garbage config.json, values
of the wrong type in run.json, config.json or the manifest's parameters. Each is refused per run
with a note: the run is listed as invalid ("damaged: ..."), never counted as finished, and
collect and report still write everything (exit 1, never a traceback)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.cli import collect_command, report_command
from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.contracts.records import EVAL_FIELDS, TRAIN_FIELDS
from tests.helpers.synthetic_runs import SyntheticRun, write_run_dir, write_sweep

PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.01}
Edit = Callable[[Path, dict[str, Any]], None]  # (run dir, its manifest point)


def _runs() -> list[SyntheticRun]:
    return [
        SyntheticRun("good", 1, 0.1, PHASES, steps=40, accuracy={20: 0.8, 40: 0.9}),
        SyntheticRun("bad", 2, 0.05, PHASES, steps=40, accuracy={20: 0.8, 40: 0.9}),
    ]


def _rewrite(name: str, change: Callable[[bytes], bytes]) -> Edit:
    def edit(run: Path, point: dict[str, Any]) -> None:
        path = run / name
        path.write_bytes(change(path.read_bytes() if path.exists() else b""))

    return edit


def _record_value(kind: str, field: str, value: Any) -> Edit:
    """The first record of ``kind`` with ``field`` set to ``value``."""

    def change(raw: bytes) -> bytes:
        lines = raw.decode().splitlines()
        index = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == kind)
        record = json.loads(lines[index])
        record[field] = value
        lines[index] = json.dumps(record)
        return ("\n".join(lines) + "\n").encode()

    return _rewrite("metrics.jsonl", change)


def _json_value(name: str, key: str, value: Any) -> Edit:
    def change(raw: bytes) -> bytes:
        obj = json.loads(raw)
        obj[key] = value
        return json.dumps(obj).encode()

    return _rewrite(name, change)


def _param(key: str, value: Any) -> Edit:
    def edit(run: Path, point: dict[str, Any]) -> None:
        point["params"][key] = value

    return edit


def _params(value: Any) -> Edit:
    def edit(run: Path, point: dict[str, Any]) -> None:
        point["params"] = value

    return edit


def _delete(name: str) -> Edit:
    def edit(run: Path, point: dict[str, Any]) -> None:
        (run / name).unlink()

    return edit


def _junk(seed: int, size: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(size))


# A value of a type no field of its kind may hold.
_WRONG = {int: "12", float: "fast", str: 5, dict: [1, 2], list: {"a": 1}}


def _wrong_for(kind: Any) -> Any:
    return _WRONG[kind[0] if isinstance(kind, tuple) else kind]


CASES: dict[str, Edit] = {
    "metrics_missing": _delete("metrics.jsonl"),
    "metrics_empty": _rewrite("metrics.jsonl", lambda raw: b""),
    "metrics_blank_lines": _rewrite("metrics.jsonl", lambda raw: b"\n\n  \n"),
    "metrics_nul_bytes": _rewrite("metrics.jsonl", lambda raw: b"\0" * 512),
    "metrics_only_events": _rewrite(
        "metrics.jsonl", lambda raw: b'{"schema": 1, "kind": "event", "what": "x"}\n'
    ),
    "metrics_invalid_utf8_line": _rewrite(
        "metrics.jsonl", lambda raw: raw + b'{"schema": 1, "kind": "eval", "x": "\xff\xfe"}\n'
    ),
    "metrics_other_schema": _rewrite(
        "metrics.jsonl", lambda raw: raw + b'{"schema": 7, "kind": "eval", "step": 1}\n'
    ),
    "metrics_last_line_cut": _rewrite("metrics.jsonl", lambda raw: raw[: len(raw) - 20]),
    **{
        f"metrics_junk_{seed}": _rewrite("metrics.jsonl", lambda raw, s=seed: _junk(s, 300))
        for seed in range(4)
    },
    **{
        f"metrics_cut_at_{tenth}0pct": _rewrite(
            "metrics.jsonl", lambda raw, t=tenth: raw[: max(1, len(raw) * t // 10)]
        )
        for tenth in range(1, 10, 2)
    },
    **{
        f"metrics_line_{name}": _rewrite("metrics.jsonl", lambda raw, v=value: raw + v + b"\n")
        for name, value in {
            "array": b"[]",
            "number": b"3",
            "string": b'"text"',
            "null": b"null",
            "true": b"true",
            "open_brace": b"{",
        }.items()
    },
    **{
        f"train_{field}_wrong_type": _record_value("train", field, _wrong_for(kind))
        for field, kind in TRAIN_FIELDS.items()
    },
    "train_step_bool": _record_value("train", "step", True),
    **{
        f"eval_{field}_wrong_type": _record_value("eval", field, _wrong_for(kind))
        for field, kind in EVAL_FIELDS.items()
    },
    "config_junk": _rewrite("config.json", lambda raw: _junk(9, 200)),
    "config_invalid_utf8": _rewrite("config.json", lambda raw: b'{"model": "\xff"}'),
    "config_empty": _rewrite("config.json", lambda raw: b""),
    "config_cut": _rewrite("config.json", lambda raw: raw[: len(raw) // 2]),
    "config_array": _rewrite("config.json", lambda raw: b"[]"),
    "config_string": _rewrite("config.json", lambda raw: b'"config"'),
    "config_other_schema": _json_value("config.json", "schema", 7),
    **{
        f"config_{key}_wrong_type": _json_value("config.json", key, value)
        for key, value in {
            "nodes": [2],
            "model": 5,
            "kfac": "yes",
            "batch_size": "64",
            "seed": [],
            "target_accuracy": "0.9",
            "scaling": {"x": 1},
        }.items()
    },
    **{
        f"run_{key}_wrong_type": _json_value("run.json", key, value)
        for key, value in {
            "nodes": [2],
            "world_size": "2",
            "optimizer": 3,
            "kfac": "no",
            "samples_per_s": "fast",
            "phases_s": {"forward": "x"},
            "samples_per_s_per_rank": ["x", 1.0],
            "rank_phases_s": {"forward": "x"},
            "attempts": [1, 2],
            "step_s": {"mean": "x"},
            "wall_s": [],
            "model": [],
        }.items()
    },
    **{
        f"params_{key}_wrong_type": _param(key, value)
        for key, value in {
            "nodes": [1],
            "ranks_per_node": {},
            "optimizer": 5,
            "kfac": "x",
            "seed": [],
            "scaling": 1,
        }.items()
    },
    "params_not_an_object": _params("junk"),
}


def _damaged_sweep(root: Path, case: str) -> Path:
    sweep = root / "sweep"
    write_sweep(sweep, _runs())
    manifest = json.loads((sweep / "manifest.json").read_text())
    point = next(p for p in manifest["points"] if p["point_id"] == "bad")
    CASES[case](sweep / "runs" / "bad", point)
    (sweep / "manifest.json").write_text(json.dumps(manifest))
    return sweep


def test_the_cases_are_many():
    assert len(CASES) >= 75


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_finished_run_is_invalid_with_its_reason(tmp_path, case):
    sweep = _damaged_sweep(tmp_path, case)
    tables = build_tables(collect(sweep, cache=False))
    rows = {row["run_id"]: row for row in tables.runs}
    assert rows["good"]["state"] == schema.DONE, rows["good"]["notes"]
    bad = rows["bad"]
    assert bad["state"] == schema.INVALID, (case, bad["reason"], bad["notes"])
    assert bad["reason"].startswith("damaged: ") and len(bad["reason"]) > 20, bad["reason"]
    for cell in tables.scaling:  # the damaged run is no finished run of any cell
        if cell["nodes"] == 2:
            assert cell["runs"] == 0, cell
    result = CliRunner().invoke(collect_command, [str(sweep), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, (result.output, result.exception)


REPORTED = [
    "run_nodes_wrong_type",
    "params_nodes_wrong_type",
    "config_nodes_wrong_type",
    "metrics_junk_0",
    "metrics_missing",
    "train_phases_s_wrong_type",
    "eval_accuracy_wrong_type",
]


@pytest.mark.parametrize("case", REPORTED)
def test_report_of_a_damaged_run_exits_1_and_writes_everything(tmp_path, case):
    sweep = _damaged_sweep(tmp_path, case)
    result = CliRunner().invoke(report_command, [str(sweep), "--out", str(tmp_path / "report")])
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "bad" in markdown and "damaged" in markdown


@pytest.mark.parametrize("value", [[2], {"n": 2}, "two", True, None])
def test_a_wrong_node_count_without_a_manifest_does_not_end_the_report(tmp_path, value):
    """The review's crash: `nodes: [2]` in run.json, collected by scanning (no manifest)."""
    for run in _runs():
        path = write_run_dir(tmp_path / "runs" / run.name, run)
        if run.name == "bad":
            summary = json.loads((path / "run.json").read_text())
            summary["nodes"] = value
            (path / "run.json").write_text(json.dumps(summary))
    result = CliRunner().invoke(report_command, [str(tmp_path / "runs")])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    rows = {row["run_id"]: row for row in build_tables(collect(tmp_path / "runs")).runs}
    if value is None:  # null is an absent value: nodes comes from config.json
        assert result.exit_code == 0 and rows["bad"]["state"] == schema.DONE
    else:
        assert result.exit_code == 1 and rows["bad"]["state"] == schema.INVALID
        assert "run.json: nodes" in rows["bad"]["reason"]
