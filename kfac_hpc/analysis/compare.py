"""A sweep against a baseline sweep: matched (group, node count) cells, regressions flagged."""

from __future__ import annotations

from typing import Any

from kfac_hpc.analysis import schema

Row = dict[str, Any]

# Scaling-table column -> True when larger is better.
COMPARED: dict[str, bool] = {
    "samples_per_s_median": True,
    "step_mean_s_median": False,
    "parallel_efficiency": True,
    "weak_efficiency": True,
    "time_to_target_s_median": False,
    "final_accuracy_median": True,
}
COMPARE_COLUMNS: tuple[str, ...] = (
    "schema",
    "group",
    "nodes",
    "metric",
    "baseline",
    "current",
    "change_fraction",
    "regression",
)


def compare(current: list[Row], baseline: list[Row], threshold: float) -> list[Row]:
    """One row per (group, nodes, metric) present in both scaling tables.

    ``change_fraction = (current - baseline) / baseline``; a row is a regression when the
    change goes the worse way by more than ``threshold`` (a fraction, e.g. 0.05).
    """
    base = {(r["group"], r["nodes"]): r for r in baseline}
    out = []
    for row in current:
        other = base.get((row["group"], row["nodes"]))
        if other is None:
            continue
        for metric, larger_is_better in COMPARED.items():
            now, before = row.get(metric), other.get(metric)
            if not isinstance(now, int | float) or not isinstance(before, int | float):
                continue
            change = (now - before) / before if before else None
            worse = change is not None and (-change if larger_is_better else change) > threshold
            out.append(
                {
                    "schema": schema.TABLE_SCHEMA,
                    "group": row["group"],
                    "nodes": row["nodes"],
                    "metric": metric,
                    "baseline": before,
                    "current": now,
                    "change_fraction": change,
                    "regression": worse,
                }
            )
    return out
