"""``report.md`` and a self-contained ``report.html`` (plots embedded as base64 PNG).

The report is a list of blocks (headings, paragraphs, tables, images) rendered twice, so the
Markdown and the HTML always say the same thing. It reads top-down in one minute: the summary
(:mod:`kfac_hpc.analysis.summary`), the plots, then tables for people (titles with units,
3 significant digits: :mod:`kfac_hpc.analysis.humanize`). A section without data is one line
saying why. The machine-readable tables are the files under ``tables/``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kfac_hpc.analysis import plots, schema
from kfac_hpc.analysis.collect import Collection
from kfac_hpc.analysis.humanize import Column, render_columns, time_unit
from kfac_hpc.analysis.labels import optimizer_name, people_labels
from kfac_hpc.analysis.output import Tables, text_table
from kfac_hpc.analysis.report_html import MAX_COLUMNS, Block, to_html
from kfac_hpc.analysis.summary import summary_sentences

Row = dict[str, Any]

# The scaling table a terminal shows (:func:`terminal_text`), at most TERMINAL_WIDTH wide: the
# DROPPABLE columns go, in that order, while it would be wider.
TERMINAL_WIDTH = 100
SCALING_VIEW = (
    Column("label", "configuration"),
    Column("nodes", "nodes", "count"),
    Column("samples_per_s_median", "samples/s", "number"),
    Column("speedup", "speedup", "ratio"),
    Column("efficiency", "efficiency", "number"),
    Column("serial_fraction", "serial", "percent"),
    Column("time_to_target_s_median", "time to target", "time"),
    Column("time_ratio", "× SGD's time", "ratio"),
)
DROPPABLE = ("samples_per_s_median", "serial_fraction", "speedup")
# The convergence plot comes first and spans the page's width; the others share rows.
PLOTS: tuple[tuple[str, str], ...] = (
    ("curves", "Training loss and test accuracy vs running time, per configuration"),
    ("throughput", "Throughput vs nodes (median with min-max band, dashed: ideal)"),
    ("speedup", "Speedup over the smallest node count (dashed: ideal n/n0)"),
    ("efficiency", "Parallel / weak-scaling efficiency vs nodes"),
    ("phases", "Where the step time goes: per-phase time per step, stacked"),
    ("step_time", "Step-time distribution per node count"),
)
WIDE_PLOTS = frozenset({"curves"})
DEFINITIONS = (
    "X(n): median global samples/s of the finished repeats at n nodes; n0: the group's "
    "smallest node count; p = n/n0. Speedup S = X(n)/X(n0) (n nodes give S times the "
    "throughput of n0). Parallel efficiency (strong) and weak-scaling efficiency (weak) = S/p, "
    "1 for ideal scaling. Karp–Flatt serial fraction e = (1/S - 1/p)/(1 - 1/p), shown where it "
    "means something: a speedup above 1 in a configuration measured at 3 or more node counts. "
    "Time to target: running seconds until the first evaluation at or above the target "
    "accuracy. Time vs first order (× SGD's time): median time to target of a method (K-FAC, "
    "FOSI) over that of the same configuration without it at the same node count; 0.5× means "
    "the method takes half the first-order time. Communication: communication phases over all "
    "phases. Straggler spread: (max - min)/mean of the ranks' mean step times. Full "
    "definitions: docs/report.md."
)
SERIAL_FRACTION_NOTE = (
    "Serial fraction (Karp–Flatt) only where it means something: a speedup above 1 in a "
    "configuration measured at 3 or more node counts (else –)."
)
KARP_FLATT_NODE_COUNTS = 3


CONFIG = Column("label", "configuration")
NODES = Column("nodes", "nodes", "count")
SCALING_TABLE = (
    CONFIG,
    NODES,
    Column("runs", "runs", "count"),
    Column("samples_per_s_median", "throughput", "rate"),
    Column("speedup", "speedup", "ratio"),
    Column("efficiency", "efficiency", "number"),
    Column("serial_fraction", "serial fraction", "percent"),
)
TIME_TABLE = (
    CONFIG,
    NODES,
    Column("target_reached", "reached"),
    Column("time_to_target_s_median", "time to target", "time"),
    Column("time_ratio", "× SGD's time", "ratio"),
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
    """``rows`` with a ``label`` per group in words, the efficiency of either kind, the
    Karp-Flatt serial fraction where it means something (:func:`_serial_fraction`) and a
    method's time to target over its first-order configuration's (``time_ratio``)."""
    counts: dict[Any, set[Any]] = {}
    for row in rows:
        if row.get("samples_per_s_median"):
            counts.setdefault(row.get("group"), set()).add(row.get("nodes"))
    return [
        {
            **row,
            "label": labels.get(row.get("group") or "", row.get("group")),
            "efficiency": row.get("parallel_efficiency") or row.get("weak_efficiency"),
            "serial_fraction": _serial_fraction(row, len(counts.get(row.get("group"), ()))),
            "time_ratio": row.get("kfac_vs_first_order_tts_ratio"),
        }
        for row in rows
    ]


def _serial_fraction(row: Row, node_counts: int) -> float | None:
    """Karp-Flatt's serial fraction of a cell when it says something: a speedup above 1 (of a
    slowdown it reads as several hundred per cent) in a configuration measured at
    :data:`KARP_FLATT_NODE_COUNTS` or more node counts (with two it is one number, no trend)."""
    speedup = row.get("speedup")
    if node_counts < KARP_FLATT_NODE_COUNTS or speedup is None or speedup <= 1:
        return None
    value = row.get("karp_flatt_serial_fraction")
    return value if isinstance(value, int | float) else None


def first_order_name(rows: Sequence[Row]) -> str:
    """The first-order optimizer the methods' rows are compared with, in words (``SGD``), or
    ``first-order`` when they are several."""
    names = {
        optimizer_name(str(r["optimizer_label"]).split("+")[0])
        for r in rows
        if "+" in str(r.get("optimizer_label"))
    }
    return names.pop() if len(names) == 1 else "first-order"


def _with_ratio_title(columns: Sequence[Column], rows: Sequence[Row]) -> list[Column]:
    """``columns`` with the time-ratio column titled after the baseline: ``× SGD's time``."""
    name = first_order_name(rows)
    title = f"× {name}'s time" if name != "first-order" else "× first-order time"
    return [Column(c.key, title, c.kind) if c.key == "time_ratio" else c for c in columns]


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
        Column(k, f"{c['label']}, {_nodes(c['nodes'])}", "number")
        for k, c in zip(keys, cells, strict=True)
    ]
    caption = f"Time per step of each phase ({unit}, median over repeats)"
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


def _nodes(n: Any) -> str:
    return f"{n:g} node" + ("" if n == 1 else "s") if isinstance(n, int | float) else str(n)


def _shown(rows: Sequence[Row], columns: Sequence[Column], width: int) -> list[Column]:
    """``columns`` without those nothing fills (a serial fraction, a time to target, a time
    ratio), then without the :data:`DROPPABLE` ones, in order, while wider than ``width``."""
    kept = [
        c
        for c in columns
        if c.key not in ("serial_fraction", "time_to_target_s_median", "time_ratio")
        or any(r.get(c.key) is not None for r in rows)
    ]
    for key in DROPPABLE:
        if _width(rows, kept) <= width:
            break
        kept = [c for c in kept if c.key != key]
    return kept


def _width(rows: Sequence[Row], columns: Sequence[Column]) -> int:
    return max(len(line) for line in text_table(list(rows), columns).splitlines())


def terminal_table(scaling: list[Row], width: int = TERMINAL_WIDTH) -> str:
    """The scaling table for a terminal: configurations in words, at most ``width`` columns
    (configuration names shortened with … when nothing else helps)."""
    labels = people_labels(sorted({str(r["group"]) for r in scaling}))
    rows = _labelled(scaling, labels)
    columns = _shown(rows, _with_ratio_title(SCALING_VIEW, rows), width)
    over = _width(rows, columns) - width
    if over > 0:
        longest = max(len(str(r["label"])) for r in rows)
        cut = max(12, longest - over)
        rows = [{**r, "label": _shorten(str(r["label"]), cut)} for r in rows]
    return text_table(rows, columns)


def _shorten(text: str, length: int) -> str:
    return text if len(text) <= length else text[: length - 1] + "…"


def terminal_text(tables: Tables) -> str:
    """What ``kfac-hpc report`` and a sweep that ends with its report print: the summary, the
    scaling table (:func:`terminal_table`) and one line on each column that needs it; no line
    wider than :data:`TERMINAL_WIDTH`."""
    summary = " ".join(summary_sentences(tables.scaling, tables.runs))
    parts = [textwrap.fill(summary, TERMINAL_WIDTH), terminal_table(tables.scaling)]
    rows = _labelled(
        tables.scaling, people_labels(sorted({str(r["group"]) for r in tables.scaling}))
    )
    notes = []
    if any(r.get("time_ratio") is not None for r in rows):
        name = first_order_name(rows)
        title = f"× {name}'s time" if name != "first-order" else "× first-order time"
        notes.append(
            f"{title}: a method's time to target over that of the same configuration without "
            "it, at the same node count (below 1: the method is faster)."
        )
    if any(r.get("speedup") is not None and r.get("serial_fraction") is None for r in rows):
        notes.append(SERIAL_FRACTION_NOTE)
    if notes:
        parts.append("\n".join(textwrap.fill(n, TERMINAL_WIDTH) for n in notes))
    return "\n\n".join(parts)


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
    labels = people_labels(sorted({str(r["group"]) for r in tables.runs}))
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
            blocks.append(Block("image", caption, path=path, wide=name in WIDE_PLOTS))
        else:
            blocks.append(Block("text", f"{caption}: no finished run to plot."))
    blocks += [Block("heading", "Scaling"), _table(scaling, SCALING_TABLE)]
    if any(r.get("speedup") is not None and r.get("serial_fraction") is None for r in scaling):
        blocks.append(Block("text", SERIAL_FRACTION_NOTE))
    blocks.append(Block("heading", "Time to target accuracy"))
    if all(r.get("target_accuracy") is None and r.get("target_loss") is None for r in tables.runs):
        blocks.append(
            Block("text", "No target was set: pass `--target-accuracy` or `--target-loss`.")
        )
    elif not any(r.get("time_to_target_s") is not None for r in tables.runs):
        blocks.append(Block("text", "No run reached its target accuracy."))
    else:
        blocks.append(_table(scaling, _with_ratio_title(TIME_TABLE, scaling)))
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
