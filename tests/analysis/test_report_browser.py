"""report.html in a real headless Chromium at 1280 px: no horizontal scroll, the summary first,
no e-notation in any visible number; for a sweep built to stress the layout (many
configurations and node counts, all 12 phases, failed points with long reasons)."""

from __future__ import annotations

import re

from kfac_hpc.analysis.schema import PHASES
from tests.helpers.browser import assert_reads_well, measure, print_pdf, screenshot
from tests.helpers.report_checks import run_report
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep


def _wide_sweep(root):
    phases = {p: 8.387e-05 * (i + 1) for i, p in enumerate(PHASES)}  # tiny: e-notation bait
    runs = [
        SyntheticRun(
            f"{'kfac' if kfac else 'sgd'}-{model}-n{nodes}",
            nodes,
            0.02 / nodes**0.7,
            phases,
            ranks_per_node=4,
            kfac=kfac,
            model=model,
            steps=60,
            accuracy={20: 0.5, 40: 0.8, 60: 0.9},
            target_accuracy=0.85,
            rank_skew=0.01,
            attempt_ends=(30,) if nodes == 2 else (),
        )
        for model in ("resnet18_with_a_rather_long_model_name", "small_cnn")
        for kfac in (False, True)
        for nodes in (1, 2, 4, 8, 16)
    ]
    runs.append(SyntheticRun("sgd-failed", 4, 0.01, phases, state="error", model="small_cnn"))
    write_sweep(root, runs)


def test_wide_report_fits_1280_px_with_summary_first(tmp_path, chromium):
    _wide_sweep(tmp_path / "sweep")
    result = run_report(tmp_path / "sweep")
    assert result.returncode == 1, result.stderr  # one point failed
    page = tmp_path / "sweep" / "report" / "report.html"
    facts = measure(page, chromium, tmp_path)
    assert_reads_well(facts)
    assert "no target accuracy" not in facts["text"].lower()
    assert "forward" in facts["text"] and "sgd-failed" in facts["text"]
    png = screenshot(page, tmp_path / "shot.png", chromium, tmp_path)
    assert png.stat().st_size > 20_000  # a rendered page, not a blank one
    pdf = print_pdf(page, tmp_path / "report.pdf", chromium, tmp_path)
    pages = re.findall(rb"/Type\s*/Page[^s]", pdf)
    assert pdf.startswith(b"%PDF") and len(pages) >= 2, "the report does not print"


def test_report_without_target_says_why_in_one_line(tmp_path, chromium):
    runs = [
        SyntheticRun(f"r{n}", n, 0.1 / n, {"forward": 0.02}, steps=20, kfac=bool(n % 2))
        for n in (1, 2)
    ]
    write_sweep(tmp_path / "sweep", runs)
    assert run_report(tmp_path / "sweep").returncode == 0
    facts = measure(tmp_path / "sweep" / "report" / "report.html", chromium, tmp_path)
    assert_reads_well(facts)
    assert "No target was set: pass --target-accuracy or --target-loss." in facts["text"]
