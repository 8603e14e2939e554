"""``kfac-hpc collect`` and ``kfac-hpc report`` as a user runs them: files, formats, exit codes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.conftest import require_module
from tests.helpers.report_checks import assert_plot, assert_report_complete, run_report
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.005, "factor_comm": 0.002}
ACC = {10: 0.5, 20: 0.8, 30: 0.92, 40: 0.95}


def _runs(slow=1.0, failed=False):
    runs = []
    for nodes, step_s in ((1, 0.1), (2, 0.055), (4, 0.03)):
        for kfac in (False, True):
            for seed in (0, 1):
                name = f"{'kfac' if kfac else 'sgd'}-n{nodes}-s{seed}"
                runs.append(
                    SyntheticRun(
                        name,
                        nodes,
                        slow * step_s * (1.3 if kfac else 1.0) * (1 + 0.03 * seed),
                        PHASES,
                        kfac=kfac,
                        seed=seed,
                        steps=40,
                        accuracy=ACC,
                        target_accuracy=0.9,
                        rank_skew=0.05,
                        attempt_ends=(20,) if name == "kfac-n2-s1" else (),
                    )
                )
    if failed:
        runs.append(SyntheticRun("sgd-n4-s2", 4, 0.03, PHASES, seed=2, state="error"))
    return runs


def _cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kfac_hpc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_collect_writes_tables_and_exits_0_when_all_done(tmp_path):
    write_sweep(tmp_path, _runs())
    result = _cli("collect", str(tmp_path), "--format", "json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert len(printed) == 12
    for stem in ("runs", "phases", "segments", "scaling"):
        for suffix in ("csv", "jsonl"):
            assert (tmp_path / "analysis" / f"{stem}.{suffix}").is_file()
    with open(tmp_path / "analysis" / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["schema"] for r in rows} == {"1"}
    assert "samples_per_s" in rows[0] and "wall_s" in rows[0] and "phase_forward_s" in rows[0]
    lines = (tmp_path / "analysis" / "phases.jsonl").read_text().splitlines()
    phase = json.loads(lines[0])
    assert set(phase) >= {"run_id", "phase", "mean_s", "p50_s", "p90_s", "rank_spread_s"}


def test_collect_exits_1_with_a_failed_point_and_lists_it(tmp_path):
    write_sweep(tmp_path, _runs(failed=True))
    result = _cli("collect", str(tmp_path))
    assert result.returncode == 1
    (line,) = [row for row in result.stdout.splitlines() if row.startswith("sgd-n4-s2")]
    assert "failed" in line and "error: synthetic failure" in line
    assert "12 done, 1 failed" in result.stderr


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_formats(tmp_path, fmt):
    write_sweep(tmp_path, _runs())
    out = _cli("collect", str(tmp_path), "--format", fmt).stdout
    if fmt == "json":
        assert len(json.loads(out)) == 12
    elif fmt == "csv":
        assert len(list(csv.DictReader(out.splitlines()))) == 12
    else:
        assert out.splitlines()[0].split()[:2] == ["run", "state"]
        assert len(out.splitlines()) == 13


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path):
    result = _cli("collect", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.startswith("kfac-hpc collect: error: SWEEP_DIR: ")
    assert "not a directory" in result.stderr
    (tmp_path / "manifest.json").write_text("{ truncated")
    result = _cli("report", str(tmp_path))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_report_holds_every_point_plot_and_requeue(tmp_path):
    write_sweep(tmp_path, _runs(failed=True))
    result = run_report(tmp_path)
    assert result.returncode == 1, result.stderr  # one point failed
    assert_report_complete(tmp_path, requeued={"kfac-n2-s1"})
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "error: synthetic failure" in markdown
    assert "K-FAC reaches the target accuracy" in markdown


def test_report_with_no_finished_run_still_writes_report(tmp_path):
    write_sweep(tmp_path, [SyntheticRun("only", 1, 0.1, PHASES, state="error")])
    result = run_report(tmp_path)
    assert result.returncode == 1, result.stderr
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "only" in markdown and "no finished run to plot" in markdown


def test_baseline_comparison_flags_regressions(tmp_path):
    base, new = tmp_path / "base", tmp_path / "new"
    write_sweep(base, _runs())
    write_sweep(new, _runs(slow=1.25))  # every step 25 % slower
    result = run_report(new, "--baseline", str(base), "--format", "json")
    assert result.returncode == 0, result.stderr
    markdown = (new / "report" / "report.md").read_text()
    assert "Comparison with baseline" in markdown
    rows = json.loads(result.stdout)["comparison"]
    throughput = [r for r in rows if r["metric"] == "samples_per_s_median"]
    assert len(throughput) == 6 and all(r["regression"] for r in throughput)
    assert all(r["change_fraction"] == pytest.approx(1 / 1.25 - 1) for r in throughput)
    efficiency = [r for r in rows if r["metric"] == "parallel_efficiency"]
    assert not any(r["regression"] for r in efficiency)  # uniformly slower scales the same
    assert_plot(new / "report" / "img" / "speedup.png")


def test_unwritable_output_exits_2_with_one_line(tmp_path):
    write_sweep(tmp_path / "sweep", _runs())
    (tmp_path / "file").write_text("")
    result = _cli("collect", str(tmp_path / "sweep"), "--out", str(tmp_path / "file" / "out"))
    assert result.returncode == 2
    assert result.stderr.startswith("kfac-hpc collect: error: --out: cannot write to")
    assert "Traceback" not in result.stderr


def test_parquet_tables_match_the_csv_rows(tmp_path):
    pq = require_module("pyarrow.parquet")
    runs = _runs(failed=True)
    write_sweep(tmp_path, runs)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["points"][0]["params"]["lr"] = "0.1"  # a column mixing kinds still writes
    manifest["points"][1]["params"]["lr"] = 0.2
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert _cli("collect", str(tmp_path)).returncode == 1
    for stem in ("runs", "phases", "segments", "scaling"):
        table = pq.read_table(tmp_path / "analysis" / f"{stem}.parquet")
        with open(tmp_path / "analysis" / f"{stem}.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert table.num_rows == len(rows) and table.column_names == list(rows[0])
    runs_table = pq.read_table(tmp_path / "analysis" / "runs.parquet").to_pylist()
    assert [r["run_id"] for r in runs_table] == [r.name for r in runs]
    schema = pq.read_schema(tmp_path / "analysis" / "runs.parquet")
    assert str(schema.field("nodes").type) == "int64"
