"""Scaling metrics across runs: one row per (configuration group, node count).

Definitions (docs/report.md has them with their rationale). For a group, ``n0`` is its smallest
node count with a finished run, ``X(n)`` the median global throughput (samples/s) of the
finished repeats at ``n`` nodes and ``p = n / n0``:

- speedup ``S = X(n) / X(n0)``; band ``[min X(n) / max X(n0), max X(n) / min X(n0)]``
- parallel efficiency (strong scaling) ``E = S / p``; weak-scaling efficiency (weak scaling,
  fixed per-rank batch) the same ratio, which there equals ``t_step(n0) / t_step(n)``
- Karp-Flatt serial fraction (strong scaling, ``p > 1``) ``e = (1/S - 1/p) / (1 - 1/p)``
- K-FAC vs first-order time-to-solution ratio: median time-to-target of a K-FAC group over the
  median of its first-order group at the same node count (< 1: K-FAC is faster)

Only ``done`` runs enter the metrics; the other rows are counted in ``points``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.stats import median, ratio

Row = dict[str, Any]

# Per-run columns summarised as median / min / max over the repeats of a (group, nodes) cell.
SPREAD_COLUMNS = ("samples_per_s", "time_to_target_s")
# Per-run columns summarised by their median only.
MEDIAN_COLUMNS = (
    "samples_per_s_per_rank",
    "step_mean_s",
    "step_p90_s",
    "wall_s",
    "compute_s",
    "final_accuracy",
    "comm_fraction",
    "straggler_spread_fraction",
    *(f"phase_{p}_s" for p in schema.PHASES),
)

SCALING_COLUMNS: tuple[str, ...] = (
    "schema",
    "group",
    "first_order_group",
    "optimizer_label",
    "scaling",
    "nodes",
    "world_size",
    "points",
    "runs",
    "samples_per_s_median",
    "samples_per_s_min",
    "samples_per_s_max",
    "ideal_speedup",
    "speedup",
    "speedup_min",
    "speedup_max",
    "parallel_efficiency",
    "weak_efficiency",
    "efficiency_min",
    "efficiency_max",
    "karp_flatt_serial_fraction",
    "target_reached",
    "time_to_target_s_median",
    "time_to_target_s_min",
    "time_to_target_s_max",
    "kfac_vs_first_order_tts_ratio",
    *(f"{c}_median" for c in MEDIAN_COLUMNS),
)


def _values(rows: list[Row], column: str) -> list[float]:
    return [float(r[column]) for r in rows if isinstance(r.get(column), int | float)]


def _cell(group_rows: list[Row], all_rows: list[Row]) -> Row:
    """Repeat statistics of one (group, nodes) cell; ``group_rows`` are its done runs."""
    first = all_rows[0]
    cell: Row = {
        "schema": schema.TABLE_SCHEMA,
        "group": first["group"],
        "first_order_group": first.get("first_order_group"),
        "optimizer_label": first["optimizer_label"],
        "scaling": first.get("scaling") or "strong",
        "nodes": first["nodes"],
        "world_size": first.get("world_size"),
        "points": len(all_rows),
        "runs": len(group_rows),
    }
    for column in SPREAD_COLUMNS:
        values = _values(group_rows, column)
        cell[f"{column}_median"] = median(values)
        cell[f"{column}_min"] = min(values) if values else None
        cell[f"{column}_max"] = max(values) if values else None
    for column in MEDIAN_COLUMNS:
        cell[f"{column}_median"] = median(_values(group_rows, column))
    reached = len(_values(group_rows, "time_to_target_s"))
    cell["target_reached"] = f"{reached}/{len(group_rows)}"
    return cell


def _add_scaling(cells: list[Row]) -> None:
    """Fill speedup, efficiency and Karp-Flatt of one group's cells (sorted by nodes)."""
    base = next((c for c in cells if (c["samples_per_s_median"] or 0) > 0), None)
    for cell in cells:
        for key in ("ideal_speedup", "speedup", "speedup_min", "speedup_max"):
            cell[key] = None
        for key in ("parallel_efficiency", "weak_efficiency", "efficiency_min", "efficiency_max"):
            cell[key] = None
        cell["karp_flatt_serial_fraction"] = None
        if base is None or cell["samples_per_s_median"] is None:
            continue
        p = cell["nodes"] / base["nodes"]
        speedup = cell["samples_per_s_median"] / base["samples_per_s_median"]
        efficiency = speedup / p
        cell["ideal_speedup"] = p
        cell["speedup"] = speedup
        cell["speedup_min"] = ratio(cell["samples_per_s_min"], base["samples_per_s_max"])
        cell["speedup_max"] = ratio(cell["samples_per_s_max"], base["samples_per_s_min"])
        cell["efficiency_min"] = ratio(cell["speedup_min"], p)
        cell["efficiency_max"] = ratio(cell["speedup_max"], p)
        if cell["scaling"] == "weak":
            cell["weak_efficiency"] = efficiency
        else:
            cell["parallel_efficiency"] = efficiency
            if p > 1:
                cell["karp_flatt_serial_fraction"] = (1 / speedup - 1 / p) / (1 - 1 / p)


def _add_tts_ratio(cells: list[Row]) -> None:
    """Time-to-solution ratio of a method (K-FAC, FOSI: ``sgd+kfac``) over its first-order
    baseline (``sgd``) per node count; the column keeps its K-FAC name for old readers."""
    by_key = {(c["group"], c["nodes"]): c for c in cells if "+" not in str(c["optimizer_label"])}
    for cell in cells:
        baseline = by_key.get((cell["first_order_group"], cell["nodes"]))
        second = "+" in str(cell["optimizer_label"])
        cell["kfac_vs_first_order_tts_ratio"] = (
            ratio(cell["time_to_target_s_median"], baseline["time_to_target_s_median"])
            if second and baseline is not None
            else None
        )


def scaling_rows(run_rows: list[Row]) -> list[Row]:
    """One row per (group, node count) with repeat statistics and scaling metrics."""
    by_cell: dict[tuple[str, Any], list[Row]] = defaultdict(list)
    for row in run_rows:
        nodes = row.get("nodes")
        # bools, strings and junk from a damaged manifest are not node counts
        if isinstance(nodes, int | float) and not isinstance(nodes, bool) and nodes > 0:
            by_cell[(row["group"], nodes)].append(row)
    by_group: dict[str, list[Row]] = defaultdict(list)
    for (group, _), rows in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        done = [r for r in rows if r["state"] == schema.DONE]
        by_group[group].append(_cell(done, rows))
    cells: list[Row] = []
    for group_cells in by_group.values():
        _add_scaling(group_cells)
        cells.extend(group_cells)
    _add_tts_ratio(cells)
    return [{c: cell.get(c) for c in SCALING_COLUMNS} for cell in cells]
