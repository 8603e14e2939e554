"""Assertions on a collected and reported sweep, for tests that run a real sweep.

Usage, after ``kfac-hpc report SWEEP_DIR`` (or :func:`run_report`)::

    from tests.helpers.report_checks import assert_report_complete
    assert_report_complete(sweep_dir)              # every point and plot present
    assert_report_complete(sweep_dir, requeued={"<point_id>"})  # and these have >= 2 segments
"""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

# Plots a report holds when at least one point finished.
PLOTS = ("throughput", "speedup", "efficiency", "phases", "curves", "step_time")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A real plot (axes, labels, a line) is tens of kB; an empty canvas compresses to ~2 kB.
MIN_PNG_BYTES = 8_000


def run_report(
    sweep_dir: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``kfac-hpc report SWEEP_DIR ARGS`` in a subprocess; the caller checks its exit code."""
    env = {**os.environ, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kfac_hpc", "report", str(sweep_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG file, from its IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def assert_plot(path: Path) -> None:
    """``path`` is a real, non-trivial PNG plot."""
    assert path.is_file(), f"plot {path} missing"
    assert path.stat().st_size >= MIN_PNG_BYTES, f"plot {path} is nearly empty"
    width, height = png_size(path)
    assert width >= 300 and height >= 200, f"plot {path} is {width}x{height}"


def _point_ids(sweep_dir: Path) -> list[str]:
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    return [str(p["point_id"]) for p in manifest["points"]]


def assert_report_complete(
    sweep_dir: Path,
    report_dir: Path | None = None,
    *,
    plots: tuple[str, ...] = PLOTS,
    requeued: set[str] | frozenset[str] = frozenset(),
) -> None:
    """The report of ``sweep_dir`` holds every manifest point, every plot and the tables.

    ``requeued``: point ids that must be one run with at least two segments.
    """
    report_dir = report_dir or sweep_dir / "report"
    markdown = (report_dir / "report.md").read_text()
    page = (report_dir / "report.html").read_text()
    points = _point_ids(sweep_dir)
    assert points, "the manifest lists no point"
    for point in points:
        assert point in markdown, f"point {point} missing from report.md"
        assert point in page, f"point {point} missing from report.html"
    for name in plots:
        assert_plot(report_dir / "img" / f"{name}.png")
        assert f"img/{name}.png" in markdown
    assert page.count("data:image/png;base64,") >= len(plots)
    assert 'src="img/' not in page, "report.html must be self-contained"
    with open(report_dir / "tables" / "runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(r["run_id"] for r in rows) == sorted(points), "runs.csv is not one row per point"
    with open(report_dir / "tables" / "segments.csv", newline="") as fh:
        segments = list(csv.DictReader(fh))
    for point in requeued:
        count = sum(1 for s in segments if s["run_id"] == point)
        row = next(r for r in rows if r["run_id"] == point)
        assert count >= 2 and int(row["segments"]) == count, (
            f"requeued point {point}: {count} segment(s), runs.csv says {row['segments']}"
        )
