"""PNG plots of a sweep (matplotlib, Agg backend: no display needed).

Each function draws one figure into ``path`` and returns it, or returns None when the tables
hold nothing to draw (e.g. no finished run).
"""

from __future__ import annotations

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
from matplotlib.ticker import FuncFormatter

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.humanize import sig3, time_unit
from kfac_hpc.analysis.rundir import RunData
from kfac_hpc.analysis.summary import short_labels

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
    labels = short_labels(list(groups))
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
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax)
    return _save(fig, path)


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
    many = len({c["first_order_group"] for c in cells}) > 1
    labels = [
        f"n={c['nodes']:g}\n{c['optimizer_label']}" + (f"\n{c['group'][:24]}" if many else "")
        for c in cells
    ]
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
    """Training loss and eval accuracy vs wall time, one line per run: a colour per
    configuration, a line style per node count (the legend lists each once)."""
    if not any(run.stats.windows or run.evals for run in runs):
        return None
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.4))
    cycle = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]
    styles = ["-", "--", ":", "-."]
    labels = short_labels(sorted({str(r["group"]) for r in rows}))
    colors = {g: cycle[i % len(cycle)] for i, g in enumerate(labels)}
    node_counts = sorted({r["nodes"] for r in rows if isinstance(r["nodes"], int | float)})
    style_of: dict[Any, Any] = {n: styles[i % len(styles)] for i, n in enumerate(node_counts)}
    for run, row in zip(runs, rows, strict=True):
        color, style = colors[str(row["group"])], style_of.get(row["nodes"], "-")
        stats = run.stats
        losses = [(t, v) for t, v in zip(stats.wall_s, stats.loss, strict=True) if v == v]
        if losses:
            loss_ax.plot(*zip(*losses, strict=True), style, color=color, lw=1)
        accs = [(e.wall_s, e.accuracy) for e in run.evals if e.accuracy is not None]
        if accs:
            acc_ax.plot(*zip(*accs, strict=True), style, color=color, lw=1, marker=".")
    for ax, name in ((loss_ax, "training loss"), (acc_ax, "eval accuracy (fraction)")):
        ax.set_xlabel("wall time (s, running time)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    targets = {r["target_accuracy"] for r in rows if r["target_accuracy"] is not None}
    for target in targets:
        acc_ax.axhline(target, color="grey", linestyle=":", lw=1)
    handles = [Line2D([], [], color=colors[g], label=labels[g]) for g in labels]
    if len(node_counts) > 1:
        handles += [
            Line2D([], [], color="black", linestyle=style_of[n], label=f"{n:g} node(s)")
            for n in node_counts
        ]
    if targets:
        handles.append(Line2D([], [], color="grey", linestyle=":", label="target accuracy"))
    acc_ax.legend(  # right of the plots, where it covers no curve
        handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1)
    )
    fig.suptitle("Convergence vs wall time")
    return _save(fig, path)


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
    ax.set_xticks(range(1, len(keys) + 1), [f"n={n:g}\n{o}" for n, o in keys], fontsize="x-small")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: sig3(value * 1e3)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: sig3(value * 1e3)))
    ax.set_ylabel("step time (ms, log scale), whiskers 5-95 %")
    ax.set_title("Step-time distribution per node count")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)
