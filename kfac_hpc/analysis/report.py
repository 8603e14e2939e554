"""``report.md`` and a self-contained ``report.html`` (plots embedded as base64 PNG).

The report is a list of blocks (headings, paragraphs, tables, images) rendered twice, so the
Markdown and the HTML always say the same thing. It reads top-down in one minute: the summary
(:mod:`kfac_hpc.analysis.summary`), the plots, then tables for people (titles with units,
3 significant digits: :mod:`kfac_hpc.analysis.humanize`). A section without data is one line
saying why. The machine-readable tables are the files under ``tables/``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kfac_hpc.analysis import plots, schema
from kfac_hpc.analysis.collect import Collection
from kfac_hpc.analysis.humanize import Column, render_columns, time_unit
from kfac_hpc.analysis.output import Tables
from kfac_hpc.analysis.report_html import MAX_COLUMNS, Block, to_html
from kfac_hpc.analysis.summary import short_labels, summary_sentences

Row = dict[str, Any]

# The scaling-table columns a terminal shows.
SCALING_VIEW = (
    Column("group", "configuration"),
    Column("nodes", "nodes", "count"),
    Column("runs", "done", "count"),
    Column("points", "points", "count"),
    Column("samples_per_s_median", "throughput", "rate"),
    Column("samples_per_s_min", "min", "rate"),
    Column("samples_per_s_max", "max", "rate"),
    Column("speedup", "speedup", "ratio"),
    Column("parallel_efficiency", "efficiency", "percent"),
    Column("weak_efficiency", "weak efficiency", "percent"),
    Column("karp_flatt_serial_fraction", "serial fraction", "percent"),
)
PLOTS: tuple[tuple[str, str], ...] = (
    ("throughput", "Throughput vs nodes (log-2 axes, median with min-max band, dashed: ideal)"),
    ("speedup", "Speedup over the smallest node count (dashed: ideal n/n0)"),
    ("efficiency", "Parallel / weak-scaling efficiency vs nodes"),
    ("phases", "Where the step time goes: per-phase time per step, stacked"),
    ("curves", "Loss and accuracy vs wall time per configuration"),
    ("step_time", "Step-time distribution per node count"),
)
DEFINITIONS = (
    "X(n): median global samples/s of the finished repeats at n nodes; n0: the group's "
    "smallest node count; p = n/n0. Speedup S = X(n)/X(n0). Parallel efficiency (strong) "
    "and weak-scaling efficiency (weak) = S/p. Karp-Flatt serial fraction "
    "e = (1/S - 1/p)/(1 - 1/p). Time to target: running seconds until the first evaluation at "
    "or above the target accuracy. K-FAC vs first-order ratio: median time-to-target of K-FAC "
    "over that of the same configuration without K-FAC at the same node count (< 1: K-FAC "
    "faster). Communication fraction: communication phases over all phases. Straggler spread: "
    "(max - min)/mean of the ranks' mean step times. Full definitions: docs/report.md."
)


CONFIG = Column("label", "configuration")
NODES = Column("nodes", "nodes", "count")
SCALING_TABLE = (
    CONFIG,
    NODES,
    Column("runs", "runs", "count"),
    Column("samples_per_s_median", "throughput", "rate"),
    Column("speedup", "speedup", "ratio"),
    Column("efficiency", "efficiency", "percent"),
    Column("karp_flatt_serial_fraction", "serial fraction", "percent"),
)
TIME_TABLE = (
    CONFIG,
    NODES,
    Column("target_reached", "reached"),
    Column("time_to_target_s_median", "time to target", "time"),
    Column("kfac_speedup", "speedup vs first order", "ratio"),
    Column("final_accuracy_median", "final accuracy", "accuracy"),
)
STEP_TABLE = (
    CONFIG,
    NODES,
    Column("step_mean_s_median", "step", "time"),
    Column("comm_fraction_median", "communication", "percent"),
    Column("straggler_spread_fraction_median", "straggler spread", "percent"),
)
RUNS_TABLE = (
    Column("run_id", "point"),
    Column("state", "state"),
    CONFIG,
    NODES,
    Column("segments", "attempts", "count"),
    Column("samples_per_s", "throughput", "rate"),
    Column("time_to_target_s", "time to target", "time"),
    Column("wall_s", "wall time", "time"),
    Column("reason", "why not done"),
)
SEGMENTS_TABLE = (
    Column("run_id", "point"),
    Column("segment", "attempt", "count"),
    Column("start_step", "from step", "count"),
    Column("end_step", "to step", "count"),
    Column("wall_s", "wall time", "time"),
    Column("end", "ended"),
)


def _table(rows: Sequence[Row], columns: Sequence[Column], title: str = "") -> Block:
    titles, cells = render_columns(rows, columns)
    return Block("table", title, titles=titles, cells=cells)


def _plots(collection: Collection, tables: Tables, img_dir: Path) -> dict[str, Path | None]:
    draw: dict[str, Callable[[Path], Path | None]] = {
        "throughput": lambda p: plots.throughput_plot(tables.scaling, p),
        "speedup": lambda p: plots.speedup_plot(tables.scaling, p),
        "efficiency": lambda p: plots.efficiency_plot(tables.scaling, p),
        "phases": lambda p: plots.phase_bars(tables.scaling, p),
        "curves": lambda p: plots.curves_plot(collection.runs, tables.runs, p),
        "step_time": lambda p: plots.step_time_plot(collection.runs, tables.runs, p),
    }
    images = {}
    for name, fn in draw.items():
        (img_dir / f"{name}.png").unlink(missing_ok=True)  # no stale plot of an earlier report
        images[name] = fn(img_dir / f"{name}.png")
    return images


def _state_summary(tables: Tables) -> str:
    counts: dict[str, int] = {}
    for row in tables.runs:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    parts = [f"{counts[s]} {s}" for s in schema.STATES if s in counts]
    return f"{len(tables.runs)} point(s): " + ", ".join(parts) + "."


def _labelled(rows: Sequence[Row], labels: dict[str, str]) -> list[Row]:
    """``rows`` with a short ``label`` per group, the efficiency of either kind, and K-FAC's
    time-to-target speedup (first-order time over K-FAC time)."""
    out = []
    for row in rows:
        ratio = row.get("kfac_vs_first_order_tts_ratio")
        out.append(
            {
                **row,
                "label": labels.get(row.get("group") or "", row.get("group")),
                "efficiency": row.get("parallel_efficiency") or row.get("weak_efficiency"),
                "kfac_speedup": 1 / ratio if ratio else None,
            }
        )
    return out


def _phase_blocks(scaling: list[Row]) -> list[Block]:
    """Per-step time of each phase: configurations as rows, or phases as rows when that
    table would be narrower than one with more than :data:`MAX_COLUMNS` columns."""
    phases = [p for p in schema.PHASES if any(r.get(f"phase_{p}_s_median") for r in scaling)]
    cells = [r for r in scaling if any(r.get(f"phase_{p}_s_median") for p in phases)]
    if not cells:
        return [Block("text", "No finished run recorded per-phase times.")]
    if len(phases) + 2 <= MAX_COLUMNS or len(cells) + 1 >= len(phases) + 2:
        columns = [
            CONFIG,
            NODES,
            *(Column(f"phase_{p}_s_median", p.replace("_", " "), "time") for p in phases),
        ]
        return [_table(cells, columns, "Time per step of each phase (median over repeats)")]
    # Turned: one row per phase, one column per (configuration, node count), one unit for all.
    unit, scale = time_unit(c.get(f"phase_{p}_s_median") for c in cells for p in phases)
    keys = [f"c{i}" for i in range(len(cells))]
    rows = [
        {
            "phase": p.replace("_", " "),
            **{
                k: _scaled(c.get(f"phase_{p}_s_median"), scale)
                for k, c in zip(keys, cells, strict=True)
            },
        }
        for p in phases
    ]
    columns = [Column("phase", "phase")]
    columns += [
        Column(k, f"{c['label']} ×{c['nodes']:g}", "number")
        for k, c in zip(keys, cells, strict=True)
    ]
    caption = f"Time per step of each phase ({unit}, median over repeats; ×n: n nodes)"
    return [_table(rows, columns, caption)]


PREDICTED_TABLE = (
    Column("run_id", "point"),
    Column("method", "method"),
    Column("world_size", "ranks", "count"),
    Column("phase", "phase"),
    Column("predicted_s", "predicted", "time"),
    Column("measured_s", "measured", "time"),
    Column("ratio", "predicted / measured", "ratio"),
)


def _predicted_blocks(source: str, rows: list[Row]) -> list[Block]:
    """The plan's prediction beside each run's measurement, per phase (``other``: the time of
    a step outside every phase)."""
    blocks = [Block("heading", "Predicted vs measured (kfac-hpc plan)")]
    if not rows:
        return [*blocks, Block("text", "No finished run has a prediction.")]
    text = (
        f"Predictions of `kfac-hpc plan --explain` ({source}), seconds per step; measured: "
        "run.json's per-step means over the run, averaged over ranks."
    )
    return [*blocks, Block("text", text), _table(rows, PREDICTED_TABLE)]


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value / scale


def build_blocks(
    collection: Collection,
    tables: Tables,
    images: dict[str, Path | None],
    comparison: list[Row] | None,
    baseline: Path | None,
    predicted: tuple[str, list[Row]] | None = None,
) -> list[Block]:
    """The report's content, in order: summary, plots, tables. ``predicted``: the plan's
    source and its rows (:mod:`kfac_hpc.analysis.predicted`), when the sweep has them."""
    labels = short_labels(sorted({str(r["group"]) for r in tables.runs}))
    scaling = _labelled(tables.scaling, labels)
    runs = _labelled(tables.runs, labels)
    blocks = [
        Block("heading", f"Scaling report: {collection.name}"),
        Block("summary", " ".join(summary_sentences(tables.scaling, tables.runs))),
        Block("text", f"Source: `{collection.source}`. {_state_summary(tables)}"),
        Block("heading", "Plots"),
    ]
    for name, caption in PLOTS:
        path = images.get(name)
        if path is not None:
            blocks.append(Block("image", caption, path=path))
        else:
            blocks.append(Block("text", f"{caption}: no finished run to plot."))
    blocks += [Block("heading", "Scaling"), _table(scaling, SCALING_TABLE)]
    blocks.append(Block("heading", "Time to target accuracy"))
    if all(r.get("target_accuracy") is None for r in tables.runs):
        blocks.append(Block("text", "No target accuracy was set: pass `--target-accuracy`."))
    elif not any(r.get("time_to_target_s") is not None for r in tables.runs):
        blocks.append(Block("text", "No run reached its target accuracy."))
    else:
        blocks.append(_table(scaling, TIME_TABLE))
    blocks += [
        Block("heading", "Where the time goes"),
        _table(scaling, STEP_TABLE),
        *_phase_blocks(scaling),
    ]
    if predicted is not None:
        blocks += _predicted_blocks(*predicted)
    if comparison is not None:
        flagged = [r for r in comparison if r["regression"]]
        blocks += [
            Block("heading", "Comparison with baseline"),
            Block("text", f"Baseline: `{baseline}`. {len(flagged)} regression(s) flagged."),
            _table(
                [{**r, "metric": METRIC_NAMES.get(r["metric"], r["metric"])} for r in comparison],
                COMPARE_TABLE,
            ),
        ]
    blocks += [Block("heading", "Every point"), _table(runs, RUNS_TABLE)]
    noted = [r for r in runs if r["notes"]]
    blocks.append(Block("heading", "Notes"))
    if noted:
        blocks.append(_table(noted, (Column("run_id", "point"), Column("notes", "problem"))))
    else:
        blocks.append(Block("text", "No file problem was worked around."))
    blocks.append(Block("heading", "Attempts"))
    if any((r.get("segments") or 0) > 1 for r in tables.runs):
        blocks.append(_table(tables.segments, SEGMENTS_TABLE))
    else:
        blocks.append(Block("text", "No point was requeued: each ran in one attempt."))
    blocks += [Block("heading", "Definitions"), Block("text", DEFINITIONS)]
    return blocks


METRIC_NAMES = {
    "samples_per_s_median": "throughput (samples/s)",
    "step_mean_s_median": "step time (s)",
    "parallel_efficiency": "parallel efficiency",
    "weak_efficiency": "weak-scaling efficiency",
    "time_to_target_s_median": "time to target (s)",
    "final_accuracy_median": "final accuracy",
}
COMPARE_TABLE = (
    Column("group", "configuration"),
    NODES,
    Column("metric", "figure"),
    Column("baseline", "baseline", "number"),
    Column("current", "now", "number"),
    Column("change_fraction", "change", "percent"),
    Column("regression", "regression"),
)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block], base: Path) -> str:
    """The blocks as GitHub-flavoured Markdown; images linked relative to ``base``."""
    out: list[str] = []
    first = True
    for block in blocks:
        if block.kind == "heading":
            out.append(("# " if first else "## ") + block.text)
            first = False
        elif block.kind in ("text", "summary"):
            out.append(block.text)
        elif block.kind == "table":
            if block.text:
                out.append(f"*{block.text}*")
            lines = ["| " + " | ".join(_md_cell(t) for t in block.titles) + " |"]
            lines.append("|" + "---|" * len(block.titles))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.cells]
            out.append("\n".join(lines) if block.cells else "(none)")
        elif block.kind == "image" and block.path is not None:
            out.append(f"![{block.text}]({block.path.relative_to(base).as_posix()})")
    return "\n\n".join(out) + "\n"


def write_report(
    collection: Collection,
    tables: Tables,
    out_dir: Path,
    comparison: list[Row] | None = None,
    baseline: Path | None = None,
    predicted: tuple[str, list[Row]] | None = None,
) -> Path:
    """Draw the plots into ``out_dir/img`` and write ``report.md`` and ``report.html``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images = _plots(collection, tables, out_dir / "img")
    blocks = build_blocks(collection, tables, images, comparison, baseline, predicted)
    (out_dir / "report.md").write_text(to_markdown(blocks, out_dir), encoding="utf-8")
    (out_dir / "report.html").write_text(to_html(blocks), encoding="utf-8")
    return out_dir / "report.md"
