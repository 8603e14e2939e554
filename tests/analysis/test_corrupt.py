"""Every file of a run directory cut short, emptied, replaced by junk or of the wrong JSON type:
collect and report never raise, every point is a row with a known state."""

from __future__ import annotations

import json
import random

from click.testing import CliRunner

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.cli import report_command
from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.01}
FILES = ("config.json", "metrics.jsonl", "run.json", "done", "manifest-params")


def _corruptions(original: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted({1, len(original) // 3, len(original) // 2, max(1, len(original) - 2)})
    junk = bytes(rng.randrange(256) for _ in range(64))
    wrong_types = [b"[]", b"3", b'"text"', b"null", b'{"schema": 1, "step": "x", "wall_s": []}']
    return [b"", junk, *wrong_types, *(original[:c] for c in cuts)]


def test_every_corruption_is_a_row_never_a_traceback(tmp_path):
    rng = random.Random(0)
    good = SyntheticRun("good", 1, 0.1, PHASES, steps=40, accuracy={20: 0.8, 40: 0.9})
    write_sweep(tmp_path / "template", [good])
    runs, edits = [], []
    for name in FILES:
        source = tmp_path / "template" / "runs" / "good" / name
        original = source.read_bytes() if source.exists() else b""
        for i, content in enumerate(_corruptions(original or b'{"nodes": 2}', rng)):
            run_name = f"{name.replace('.', '_')}-{i}"
            runs.append(SyntheticRun(run_name, 2, 0.05, PHASES, steps=40, seed=len(runs)))
            edits.append((run_name, name, content))
    runs.append(SyntheticRun("intact", 1, 0.1, PHASES, steps=40, accuracy={40: 0.9}))
    sweep = tmp_path / "sweep"
    write_sweep(sweep, runs)
    manifest = json.loads((sweep / "manifest.json").read_text())
    points = {p["point_id"]: p for p in manifest["points"]}
    for run_name, name, content in edits:
        if name == "manifest-params":  # junk where the sweep's parameters should be
            try:
                points[run_name]["params"] = json.loads(content)
            except (ValueError, UnicodeDecodeError):
                points[run_name]["params"] = content.decode("latin-1")
        else:
            (sweep / "runs" / run_name / name).write_bytes(content)
    (sweep / "manifest.json").write_text(json.dumps(manifest))

    tables = build_tables(collect(sweep))
    assert len(tables.runs) == len(runs)
    assert {r["state"] for r in tables.runs} <= set(schema.STATES)
    by_id = {r["run_id"]: r for r in tables.runs}
    assert by_id["intact"]["state"] == "done"
    for run_name, name, _ in edits:
        row = by_id[run_name]
        if row["state"] != "done":
            assert row["reason"], f"{run_name}: state {row['state']} without a reason"
        if name == "run.json":  # a done marker without a usable summary is never 'done'
            assert row["state"] == "invalid", run_name

    result = CliRunner().invoke(report_command, [str(sweep)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 1
    markdown = (sweep / "report" / "report.md").read_text()
    assert all(run.name in markdown for run in runs)
