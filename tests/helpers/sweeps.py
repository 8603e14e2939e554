"""Shared helpers of the sweep tests: build specs and run the CLI as a real process."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

from kfac_hpc.sweep.spec import SweepSpec, load_spec
from tests.conftest import clean_env

SWEEP_TESTS = Path(__file__).resolve().parents[1] / "sweep"
GOLDEN = SWEEP_TESTS / "golden"


def spec(**fields: Any) -> SweepSpec:
    fields.setdefault("nodes", "1,2")
    return load_spec(None, fields)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
):
    """``kfac-hpc ARGS`` in a fresh process (the installed entry point's module)."""
    return subprocess.run(
        [sys.executable, "-m", "kfac_hpc", *args],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


SCALING_HEADER = ["configuration", "nodes"]  # the terminal's scaling table, for people


def assert_scaling_report(
    out: subprocess.CompletedProcess[str], sweep_dir: Path, done: set[int], points: int = 1
):
    """``out`` (of a sweep that waited) printed the report's summary, its scaling table (one
    row per point group and node count) and the path of report.html, and wrote the report
    with its tables, those of the node counts in ``done`` with a measured throughput."""
    tables = [p for p in out.stdout.split("\n\n") if p.split()[:2] == SCALING_HEADER]
    assert len(tables) == 1, out.stdout
    assert len(tables[0].strip().splitlines()) == 1 + points, out.stdout
    assert out.stdout.rstrip().endswith(f"Report: {sweep_dir / 'report' / 'report.html'}")
    assert "report unavailable" not in out.stderr and "report failed" not in out.stderr
    with open(sweep_dir / "report" / "tables" / "scaling.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["runs"]) > 0]
    assert {int(r["nodes"]) for r in rows} == done
    assert all(float(r["samples_per_s_median"]) > 0 for r in rows)
    assert (sweep_dir / "report" / "report.html").is_file()
