"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

Each function draws one figure into ``path`` and returns it, or returns None when the tables
hold nothing to draw (e.g. no finished run).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: headless login and compute nodes have no display
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.humanize import axis_number, sig3, time_unit
from kfac_hpc.analysis.labels import optimizer_name, people_labels
from kfac_hpc.analysis.rundir import RunData

Row = dict[str, Any]
DPI = 110


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # legends outside the axes included
    plt.close(fig)
    return path


def _by_group(scaling: list[Row], column: str) -> dict[str, list[Row]]:
    """Cells with a value in ``column``, per group, sorted by node count."""
    out: dict[str, list[Row]] = defaultdict(list)
    for row in sorted(scaling, key=lambda r: (r["group"], r["nodes"])):
        if row.get(column) is not None:
            out[row["group"]].append(row)
    return dict(out)


def _log2_nodes(ax: Axes, nodes: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(nodes))
    ax.set_xticks(ticks, [f"{n:g}" for n in ticks])
    ax.set_xlabel("nodes")
    ax.grid(True, which="both", alpha=0.3)


def _legend(ax: Axes) -> None:
    """The legend right of the axes, where it covers no data."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)


def _lines_with_bands(
    ax: Axes, groups: dict[str, list[Row]], column: str, band: tuple[str, str]
) -> list[float]:
    """One line per group of ``column`` vs nodes with its min-max band; returns every node count
    plotted. A missing band edge falls back to the line's value."""
    all_nodes: list[float] = []
    labels = people_labels(list(groups))
    for group, cells in groups.items():
        nodes = [c["nodes"] for c in cells]
        all_nodes += nodes
        (line,) = ax.plot(nodes, [c[column] for c in cells], marker="o", label=labels[group])
        low = [c[band[0]] if c[band[0]] is not None else c[column] for c in cells]
        high = [c[band[1]] if c[band[1]] is not None else c[column] for c in cells]
        ax.fill_between(nodes, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    return all_nodes


def _scaling_plot(
    scaling: list[Row], path: Path, column: str, band: tuple[str, str], ylabel: str, title: str
) -> Path | None:
    """``column`` vs nodes per group, log-2 axes, min-max band, dashed ideal line."""
    groups = _by_group(scaling, column)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    all_nodes = _lines_with_bands(ax, groups, column, band)
    if column != "speedup":  # linear scaling from each group's smallest node count
        for cells, line in zip(groups.values(), ax.get_lines(), strict=True):
            nodes = [c["nodes"] for c in cells]
            ax.plot(
                nodes,
                [cells[0][column] * n / cells[0]["nodes"] for n in nodes],
                linestyle="--",
                color=line.get_color(),
                alpha=0.6,
                label="ideal (dashed)" if line is ax.get_lines()[0] else "_nolegend_",
            )
    if column == "speedup":  # ideal n / n0 is the same line for every group with that n0
        for n0 in sorted({cells[0]["nodes"] for cells in groups.values()}):
            nodes = sorted({n for n in all_nodes if n >= n0})
            ax.plot(nodes, [n / n0 for n in nodes], "--", color="grey", label=f"ideal n/{n0:g}")
    _log2_nodes(ax, all_nodes)
    _plain_log_axis(ax)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax)
    return _save(fig, path)


def plain_ticks(low: float, high: float) -> list[float]:
    """Round tick values between ``low`` and ``high`` (both > 0) for a log axis: 1-2-5 steps
    of every decade the range covers when it spans more than one (``100``, ``200``, ``500``,
    ``1k``), else evenly spaced round numbers (``4k``, ``6k``, ``8k``)."""
    if high / low > 10:
        ticks = [
            m * 10.0**k
            for k in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
            for m in (1, 2, 5)
        ]
    else:
        ticks = list(MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(low, high))
    inside = [t for t in ticks if low <= t <= high and t > 0]
    return inside if len(inside) >= 2 else [low, high]


def _plain_log_axis(ax: Axes) -> None:
    """A log y axis whose ticks are round numbers written plainly (``2k``, ``4k``, ``6k``;
    ``0.5``, ``1``, ``1.5``): no powers of two (``65536``), no powers of ten (``10^4``)."""
    ax.set_yscale("log")
    ax.autoscale_view()
    low, high = ax.get_ylim()
    ax.yaxis.set_major_locator(FixedLocator(plain_ticks(low, high)))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: axis_number(value)))


def throughput_plot(scaling: list[Row], path: Path) -> Path | None:
    """Global samples/s vs nodes (median, min-max band, ideal linear scaling)."""
    return _scaling_plot(
        scaling,
        path,
        "samples_per_s_median",
        ("samples_per_s_min", "samples_per_s_max"),
        "throughput (samples/s)",
        "Throughput vs nodes",
    )


def speedup_plot(scaling: list[Row], path: Path) -> Path | None:
    """Speedup over the smallest node count vs nodes (min-max band, ideal = n / n0)."""
    return _scaling_plot(
        scaling, path, "speedup", ("speedup_min", "speedup_max"), "speedup", "Speedup vs nodes"
    )


def efficiency_plot(scaling: list[Row], path: Path) -> Path | None:
    """Parallel (strong) or weak-scaling efficiency vs nodes, with the ideal 1.0."""
    rows = [{**r, "efficiency": r["parallel_efficiency"] or r["weak_efficiency"]} for r in scaling]
    groups = _by_group(rows, "efficiency")
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    all_nodes = _lines_with_bands(ax, groups, "efficiency", ("efficiency_min", "efficiency_max"))
    ax.axhline(1.0, linestyle="--", color="grey", label="ideal")
    _log2_nodes(ax, all_nodes)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("efficiency (fraction; strong: S/p, weak: t(n0)/t(n))")
    ax.set_title("Scaling efficiency vs nodes")
    _legend(ax)
    return _save(fig, path)


def phase_bars(scaling: list[Row], path: Path) -> Path | None:
    """Stacked per-step seconds of each phase, one bar per (configuration, node count)."""
    cells = [r for r in scaling if any(r.get(f"phase_{p}_s_median") for p in schema.PHASES)]
    if not cells:
        return None
    cells.sort(key=lambda r: (r["first_order_group"] or "", r["nodes"], r["optimizer_label"]))
    words = people_labels(sorted({str(c["group"]) for c in cells}))
    labels = [f"{words[str(c['group'])][:28]}\n{_nodes_text(c['nodes'])}" for c in cells]
    unit, scale = time_unit(  # the unit of the bars' heights
        sum(c.get(f"phase_{p}_s_median") or 0.0 for p in schema.PHASES) for c in cells
    )
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.4, 0.9 * len(cells) + 2)), 4.8))
    bottom = [0.0] * len(cells)
    colors = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]
    for i, phase in enumerate(schema.PHASES):
        heights = [(c.get(f"phase_{phase}_s_median") or 0.0) / scale for c in cells]
        if not any(heights):
            continue
        ax.bar(range(len(cells)), heights, bottom=bottom, label=phase, color=colors[i % 20])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(range(len(cells)), labels, fontsize="x-small")
    handles, names = ax.get_legend_handles_labels()
    ax.set_ylabel(f"time per step ({unit}, median over repeats)")
    ax.set_title("Where the step time goes")
    ax.legend(
        handles[::-1], names[::-1], fontsize="x-small", bbox_to_anchor=(1.02, 1), loc="upper left"
    )  # top to bottom, as stacked
    return _save(fig, path)


def curves_plot(runs: list[RunData], rows: list[Row], path: Path) -> Path | None:
    """Training loss and the evaluation's metric vs running time, one line per run: a colour
    per configuration, a line style per node count (the legend, under both plots, lists each
    once). The metric is test accuracy, or the test loss when every run is judged by its loss
    (a language model). Drawn to span the report's width, its text at the size of the page's."""
    if not any(run.stats.windows or run.evals for run in runs):
        return None
    with plt.rc_context({"font.size": 12}):
        return _curves(runs, rows, path)


def _judged_by_loss(run: RunData, row: Row) -> bool:
    """Whether ``run`` is judged by its test loss: run.json's metric, else its target's."""
    metric = run.summary.get("metric")
    return metric == "loss" if metric is not None else row.get("target_loss") is not None


def _curves(runs: list[RunData], rows: list[Row], path: Path) -> Path:
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(13, 5.2))
    by_loss = all(_judged_by_loss(run, row) for run, row in zip(runs, rows, strict=True))
    metric_name, target_key = (
        ("test loss", "target_loss") if by_loss else ("test accuracy (fraction)", "target_accuracy")
    )
    cycle = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    styles = ["-", "--", ":", "-."]
    labels = people_labels(sorted({str(r["group"]) for r in rows}))
    colors = {g: cycle[i % len(cycle)] for i, g in enumerate(labels)}
    node_counts = sorted({r["nodes"] for r in rows if isinstance(r["nodes"], int | float)})
    style_of: dict[Any, Any] = {n: styles[i % len(styles)] for i, n in enumerate(node_counts)}
    for run, row in zip(runs, rows, strict=True):
        nodes = row["nodes"] if isinstance(row["nodes"], int | float) else None
        color, style = colors[str(row["group"])], style_of.get(nodes, "-")
        stats = run.stats
        losses = [(t, v) for t, v in zip(stats.wall_s, stats.loss, strict=True) if v == v]
        if losses:
            loss_ax.plot(*zip(*losses, strict=True), style, color=color, lw=2)
        values = [(e.wall_s, e.loss if by_loss else e.accuracy) for e in run.evals]
        points = [(t, v) for t, v in values if v is not None]
        if points:
            acc_ax.plot(*zip(*points, strict=True), style, color=color, lw=2, marker="o", ms=4)
    for ax, name in ((loss_ax, "training loss"), (acc_ax, metric_name)):
        ax.set_xlabel("running time (s)")
        ax.set_ylabel(name)
        ax.set_title(f"{name[:1].upper()}{name[1:].split(' (')[0]} vs running time")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
    targets = {r[target_key] for r in rows if r[target_key] is not None}
    for target in targets:
        acc_ax.axhline(target, color="grey", linestyle=":", lw=1.5)
    handles = [Line2D([], [], color=colors[g], lw=2, label=labels[g]) for g in labels]
    if len(node_counts) > 1:
        handles += [
            Line2D([], [], color="black", lw=2, linestyle=style_of[n], label=_nodes_text(n))
            for n in node_counts
        ]
    if targets:
        handles.append(
            Line2D([], [], color="grey", linestyle=":", label=f"target {metric_name.split()[1]}")
        )
    fig.legend(  # under both plots, where it covers no curve
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(4, len(handles)),
        frameon=False,
    )
    return _save(fig, path)


def _nodes_text(n: float) -> str:
    return f"{n:g} node" + ("" if n == 1 else "s")


def step_time_plot(runs: list[RunData], rows: list[Row], path: Path) -> Path | None:
    """Distribution of per-step time (logging windows of finished runs) per node count."""
    samples: dict[tuple[float, str], list[float]] = defaultdict(list)
    for run, row in zip(runs, rows, strict=True):
        if row["state"] == schema.DONE and isinstance(row["nodes"], int | float):
            samples[(row["nodes"], row["optimizer_label"])].extend(run.stats.step_s)
    keys = sorted(k for k, v in samples.items() if v)
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(max(6.4, 0.8 * len(keys) + 2), 4.4))
    ax.boxplot([samples[k] for k in keys], whis=(5, 95), showfliers=True)
    names = [f"{optimizer_name(o)}\n{_nodes_text(n)}" for n, o in keys]
    ax.set_xticks(range(1, len(keys) + 1), names, fontsize="small")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: sig3(value * 1e3)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: sig3(value * 1e3)))
    ax.set_ylabel("step time (ms, log scale), whiskers 5-95 %")
    ax.set_title("Step-time distribution per node count")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)
