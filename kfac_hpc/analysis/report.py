"""``report.md`` and a self-contained ``report.html`` (plots embedded as base64 PNG).

The report is a list of blocks (headings, paragraphs, tables, images) rendered twice, so the
Markdown and the HTML always say the same thing.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_hpc.analysis import plots, schema
from kfac_hpc.analysis.collect import Collection
from kfac_hpc.analysis.compare import COMPARE_COLUMNS
from kfac_hpc.analysis.output import Tables, cell_text

Row = dict[str, Any]

SCALING_VIEW = (
    "group",
    "nodes",
    "runs",
    "points",
    "samples_per_s_median",
    "samples_per_s_min",
    "samples_per_s_max",
    "speedup",
    "parallel_efficiency",
    "weak_efficiency",
    "karp_flatt_serial_fraction",
)
TIME_VIEW = (
    "group",
    "nodes",
    "target_reached",
    "time_to_target_s_median",
    "time_to_target_s_min",
    "time_to_target_s_max",
    "kfac_vs_first_order_tts_ratio",
    "final_accuracy_median",
)
PHASE_VIEW = (
    "group",
    "nodes",
    "step_mean_s_median",
    "comm_fraction_median",
    "straggler_spread_fraction_median",
)
RUNS_VIEW = (
    "run_id",
    "state",
    "group",
    "nodes",
    "world_size",
    "segments",
    "samples_per_s",
    "time_to_target_s",
    "wall_s",
    "compute_s",
    "reason",
)
SEGMENTS_VIEW = ("run_id", "segment", "start_step", "end_step", "wall_s", "compute_s", "end")
PLOTS: tuple[tuple[str, str], ...] = (
    ("throughput", "Throughput vs nodes (log-2 axes, median with min-max band, dashed: ideal)"),
    ("speedup", "Speedup over the smallest node count (dashed: ideal n/n0)"),
    ("efficiency", "Parallel / weak-scaling efficiency vs nodes"),
    ("phases", "Per-phase step time per node count and optimizer"),
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


@dataclass(frozen=True)
class Block:
    """One element of the report: ``kind`` is heading, text, table or image."""

    kind: str
    text: str = ""
    rows: Sequence[Row] = ()
    columns: Sequence[str] = ()
    path: Path | None = None


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


def build_blocks(
    collection: Collection,
    tables: Tables,
    images: dict[str, Path | None],
    comparison: list[Row] | None,
    baseline: Path | None,
) -> list[Block]:
    """The report's content, in order."""
    kfac = [r for r in tables.scaling if r["kfac_vs_first_order_tts_ratio"] is not None]
    blocks = [
        Block("heading", f"Scaling report: {collection.name}"),
        Block("text", f"Source: `{collection.source}`. {_state_summary(tables)}"),
        Block("heading", "Scaling"),
        Block("table", rows=tables.scaling, columns=SCALING_VIEW),
        Block("heading", "Time to target accuracy"),
        Block("table", rows=tables.scaling, columns=TIME_VIEW),
    ]
    if kfac:
        best = min(kfac, key=lambda r: r["kfac_vs_first_order_tts_ratio"])
        blocks.append(
            Block(
                "text",
                f"Best K-FAC time-to-solution ratio: {best['kfac_vs_first_order_tts_ratio']:.3g} "
                f"({best['group']}, {best['nodes']} node(s)).",
            )
        )
    phase_columns = [
        f"phase_{p}_s_median"
        for p in schema.PHASES
        if any(row.get(f"phase_{p}_s_median") for row in tables.scaling)
    ]
    blocks += [
        Block("heading", "Where the time goes"),
        Block("table", rows=tables.scaling, columns=PHASE_VIEW),
        Block("text", "Seconds per step of each phase (median over repeats):"),
        Block("table", rows=tables.scaling, columns=("group", "nodes", *phase_columns)),
    ]
    if comparison is not None:
        flagged = sum(1 for r in comparison if r["regression"])
        blocks += [
            Block("heading", "Comparison with baseline"),
            Block("text", f"Baseline: `{baseline}`. {flagged} regression(s) flagged."),
            Block("table", rows=comparison, columns=COMPARE_COLUMNS[1:]),
        ]
    blocks.append(Block("heading", "Plots"))
    for name, caption in PLOTS:
        path = images.get(name)
        if path is not None:
            blocks.append(Block("image", caption, path=path))
        else:
            blocks.append(Block("text", f"{caption}: no finished run to plot."))
    blocks += [
        Block("heading", "Every point"),
        Block("table", rows=tables.runs, columns=RUNS_VIEW),
        Block("heading", "Notes (problems worked around, sweep vs job mismatches)"),
        Block("table", rows=[r for r in tables.runs if r["notes"]], columns=("run_id", "notes")),
        Block("heading", "Segments (attempts)"),
        Block("table", rows=tables.segments, columns=SEGMENTS_VIEW),
        Block("heading", "Definitions"),
        Block("text", DEFINITIONS),
    ]
    return blocks


def _md_cell(value: Any) -> str:
    return cell_text(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block], base: Path) -> str:
    """The blocks as GitHub-flavoured Markdown; images linked relative to ``base``."""
    out: list[str] = []
    first = True
    for block in blocks:
        if block.kind == "heading":
            out.append(("# " if first else "## ") + block.text)
            first = False
        elif block.kind == "text":
            out.append(block.text)
        elif block.kind == "table":
            if not block.rows:
                out.append("(none)")
                continue
            lines = ["| " + " | ".join(block.columns) + " |"]
            lines.append("|" + "---|" * len(block.columns))
            lines += [
                "| " + " | ".join(_md_cell(r.get(c)) for c in block.columns) + " |"
                for r in block.rows
            ]
            out.append("\n".join(lines))
        elif block.kind == "image" and block.path is not None:
            out.append(f"![{block.text}]({block.path.relative_to(base).as_posix()})")
    return "\n\n".join(out) + "\n"


_CSS = (
    "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse;font-size:12px;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
    "th{background:#f0f0f0}img{max-width:100%}figcaption{font-size:13px;color:#444}"
)


def to_html(blocks: list[Block]) -> str:
    """The blocks as one HTML page with every image inlined (no external files)."""
    body: list[str] = []
    first = True
    for block in blocks:
        if block.kind == "heading":
            tag = "h1" if first else "h2"
            first = False
            body.append(f"<{tag}>{html.escape(block.text)}</{tag}>")
        elif block.kind == "text":
            body.append(f"<p>{html.escape(block.text.replace('`', ''))}</p>")
        elif block.kind == "table":
            head = "".join(f"<th>{html.escape(c)}</th>" for c in block.columns)
            rows = "".join(
                "<tr>"
                + "".join(f"<td>{html.escape(cell_text(r.get(c)))}</td>" for c in block.columns)
                + "</tr>"
                for r in block.rows
            )
            body.append(f"<table><tr>{head}</tr>{rows}</table>" if block.rows else "<p>(none)</p>")
        elif block.kind == "image" and block.path is not None:
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(block.text)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(block.text)}</figcaption></figure>"
            )
    title = html.escape(blocks[0].text if blocks else "report")
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )


def write_report(
    collection: Collection,
    tables: Tables,
    out_dir: Path,
    comparison: list[Row] | None = None,
    baseline: Path | None = None,
) -> Path:
    """Draw the plots into ``out_dir/img`` and write ``report.md`` and ``report.html``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images = _plots(collection, tables, out_dir / "img")
    blocks = build_blocks(collection, tables, images, comparison, baseline)
    (out_dir / "report.md").write_text(to_markdown(blocks, out_dir), encoding="utf-8")
    (out_dir / "report.html").write_text(to_html(blocks), encoding="utf-8")
    return out_dir / "report.md"
