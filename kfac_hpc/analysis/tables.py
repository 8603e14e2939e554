"""Tidy per-run tables: one row per run, one per (run, phase), one per (run, segment).

Units are in the column names (``_s`` seconds, ``_bytes``, ``samples_per_s``); ``fraction``
columns are dimensionless in [0, 1]. run.json (the job's own summary) is preferred; a run
without one (failed, preempted, killed) gets what its metrics.jsonl allows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.aggregate import float_list, number
from kfac_hpc.analysis.rundir import RunData
from kfac_hpc.analysis.stats import percentiles, ratio, relative_spread
from kfac_hpc.contracts.options import FIRST_ORDER, METHOD_SWITCHES
from kfac_hpc.contracts.targets import Target
from kfac_hpc.contracts.workload_names import short_name

Row = dict[str, Any]

# Parameters that identify a configuration; a run's group is these minus the node count.
IDENTITY = (
    "model",
    "dataset",
    "optimizer",
    "kfac",
    "grad_worker_fraction",
    "scaling",
    "ranks_per_node",
)
# Manifest parameters that vary across repeats or node counts, never part of a group.
NOT_IDENTITY = frozenset({"nodes", "world_size", "repeat", "seed", "run_dir", "global_batch_size"})

RUN_COLUMNS: tuple[str, ...] = (
    "schema",
    "run_id",
    "point_id",
    "run_dir",
    "state",
    "reason",
    "notes",
    "group",
    "first_order_group",
    "optimizer_label",
    "method",
    *IDENTITY,
    "nodes",
    "world_size",
    "global_batch_size",
    "per_rank_batch_size",
    "repeat",
    "config_hash",
    "job_state",
    "array_job_id",
    "job_id",
    "segments",
    "restarts",
    "steps",
    "epochs",
    "wall_s",
    "compute_s",
    "step_mean_s",
    "step_p50_s",
    "step_p90_s",
    "samples_per_s",
    "samples_per_s_per_rank",
    "samples_per_s_per_rank_min",
    "samples_per_s_per_rank_max",
    "final_loss",
    "final_accuracy",
    "best_accuracy",
    "target_accuracy",
    "target_loss",
    "time_to_target_s",
    "step_to_target",
    "comm_fraction",
    "straggler_spread_fraction",
    *(f"phase_{p}_s" for p in schema.PHASES),
    "peak_rss_bytes",
    "peak_cuda_bytes",
    "host_memory",
)
PHASE_COLUMNS: tuple[str, ...] = (
    "schema",
    "run_id",
    "state",
    "group",
    "optimizer_label",
    "nodes",
    "phase",
    "mean_s",
    "p50_s",
    "p90_s",
    "share_fraction",
    "rank_min_s",
    "rank_max_s",
    "rank_spread_s",
)
SEGMENT_COLUMNS: tuple[str, ...] = (
    "schema",
    "run_id",
    "segment",
    "start_step",
    "end_step",
    "wall_s",
    "compute_s",
    "end",
)


def run_method(run: RunData) -> str:
    """The training method of a run: run.json's ``method``, else the switch its config turns
    on (``kfac``, ``fosi``), else ``first_order``."""
    method = run.summary.get("method")
    if isinstance(method, str):
        return method
    for switch, name in METHOD_SWITCHES.items():
        if run.value(switch) is True:
            return name
    return FIRST_ORDER


def optimizer_label(run: RunData) -> str:
    """``sgd``, ``sgd+kfac`` or ``sgd+fosi``: the first-order optimizer and the method around
    it."""
    base = str(run.value("optimizer") or "unknown")
    method = run_method(run)
    return base if method == FIRST_ORDER else f"{base}+{method}"


# Parameter names that belong to a method: dropped when matching a K-FAC or FOSI configuration
# with its first-order baseline.
_OPTIMIZER_WORDS = (
    *METHOD_SWITCHES,
    "factor",
    "inv",
    "damping",
    "grad_worker",
    "precondition",
    "ese",
    "lanczos",
    "curvature",
    "staleness",
)


def batch_size(run: RunData, key: str) -> Any:
    """``global_batch_size`` or ``per_rank_batch_size``; from the config's ``batch_size``
    (global for strong scaling, per rank for weak) when the run wrote no summary."""
    value = run.value(key)
    if value is not None:
        return value
    weak = run.value("scaling") == "weak"
    if (key == "per_rank_batch_size") == weak:
        return run.value("batch_size")
    return None


def varying_params(runs: list[RunData]) -> frozenset[str]:
    """Manifest parameters that take more than one value across ``runs``: the ones a group
    label must show (constant ones, e.g. ``cpus_per_task``, would only lengthen it)."""
    return varying_of(run.params for run in runs)


def varying_of(params: Iterable[dict[str, Any]]) -> frozenset[str]:
    """:func:`varying_params` of the runs whose manifest parameters are ``params``."""
    seen: dict[str, set[str]] = {}
    for values in params:
        for key, value in values.items():
            seen.setdefault(key, set()).add(json.dumps(value, sort_keys=True, default=str))
    return frozenset(k for k, values in seen.items() if len(values) > 1)


def group_label(run: RunData, varying: frozenset[str], *, first_order: bool = False) -> str:
    """A configuration: everything but the node count and the repeat.

    Strong scaling keeps the global batch fixed, weak scaling the per-rank batch, so the batch
    that is constant across node counts is part of the label. ``first_order=True`` gives the
    label of the same configuration without K-FAC (the baseline of the time-to-solution ratio).
    Of the other manifest parameters, those in ``varying`` are shown.
    """
    scaling = str(run.value("scaling") or "strong")
    batch_key = "per_rank_batch_size" if scaling == "weak" else "global_batch_size"
    method = FIRST_ORDER if first_order else run_method(run)
    kfac = method == "kfac"
    parts = [
        workload_label(run, "model"),
        workload_label(run, "dataset"),
        optimizer_label(run) if method != FIRST_ORDER else str(run.value("optimizer") or "unknown"),
        scaling,
        f"bs={batch_size(run, batch_key)}",
    ]
    if kfac and run.value("grad_worker_fraction") is not None:
        parts.append(f"gwf={run.value('grad_worker_fraction')}")
    rpn = run.value("ranks_per_node")
    if rpn is not None and rpn != 1:
        parts.append(f"rpn={rpn}")
    standard = {*IDENTITY, *NOT_IDENTITY, "per_rank_batch_size", "batch_size"}
    for key, value in sorted(run.params.items()):
        optimizer_param = any(word in key for word in _OPTIMIZER_WORDS)
        if key in varying and key not in standard and not (first_order and optimizer_param):
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _step_stats(run: RunData) -> tuple[float | None, float | None, float | None]:
    summary = run.summary.get("step_s")
    if isinstance(summary, dict) and number(summary.get("mean")) is not None:
        return number(summary.get("mean")), number(summary.get("p50")), number(summary.get("p90"))
    values = run.stats.step_s
    p50, p90 = percentiles(values, (50, 90))
    return run.stats.step_mean_s(), p50, p90


def _throughput(run: RunData, world_size: int | None) -> Row:
    """Global samples/s and per-rank samples/s (mean, min, max over ranks)."""
    total = number(run.summary.get("samples_per_s"))
    if total is None:
        total = run.stats.samples_per_s()
    per_rank = run.summary.get("samples_per_s_per_rank")
    ranks = [number(v) for v in per_rank] if isinstance(per_rank, list) else []
    clean = [v for v in ranks if v is not None]
    return {
        "samples_per_s": total,
        "samples_per_s_per_rank": ratio(total, world_size),
        "samples_per_s_per_rank_min": min(clean) if clean else None,
        "samples_per_s_per_rank_max": max(clean) if clean else None,
    }


def phase_means(run: RunData) -> dict[str, float]:
    """Per-step seconds of each phase over the whole run (run.json, else the windows)."""
    summary = run.summary.get("phases_s")
    if isinstance(summary, dict):
        return {k: v for k, raw in summary.items() if (v := number(raw)) is not None}
    return run.stats.phase_means()


def _straggler_spread(run: RunData) -> float | None:
    """``(max - min) / mean`` of the ranks' mean step times; from run.json's per-rank
    throughput (step time is batch / throughput) when the windows carry no per-rank times."""
    if run.stats.rank_step_s:
        return relative_spread(run.stats.rank_step_s)
    per_rank = run.summary.get("samples_per_s_per_rank")
    if isinstance(per_rank, list) and per_rank:
        rates = [number(v) for v in per_rank]
        if all(r is not None and r > 0 for r in rates):
            return relative_spread([1.0 / r for r in rates if r is not None])
    return None


def time_to_target(
    run: RunData, target: float | None, *, lower_is_better: bool = False
) -> tuple[float | None, int | None]:
    """Seconds of running time (and the step) at the first eval reaching ``target``: an
    accuracy at or above it, or with ``lower_is_better`` a test loss at or below it.

    Without eval records, run.json's own ``time_to_target_s`` is used if its target is
    ``target``. None when the target was never reached (or no target is known).
    """
    if target is None:
        return None, None
    if run.evals:
        for point in sorted(run.evals, key=lambda e: (e.wall_s, e.step)):
            value = point.loss if lower_is_better else point.accuracy
            if value is not None and (value <= target if lower_is_better else value >= target):
                return point.wall_s, point.step
        return None, None
    key = "target_loss" if lower_is_better else "target_accuracy"
    if number(run.summary.get(key)) == target:
        step = number(run.summary.get("step_to_target"))
        return number(run.summary.get("time_to_target_s")), None if step is None else int(step)
    return None, None


def run_target(run: RunData, override: Target | None = None) -> tuple[float | None, str]:
    """The run's target and its metric (``accuracy`` or ``loss``): ``override`` when given,
    else the run's own ``--target-accuracy``, else its ``--target-loss``."""
    if override is not None:
        return override.value, override.metric
    accuracy = number(run.value("target_accuracy"))
    if accuracy is not None:
        return accuracy, "accuracy"
    loss = number(run.value("target_loss"))
    return (loss, "loss") if loss is not None else (None, "accuracy")


def workload_label(run: RunData, kind: str) -> str:
    """The run's model or dataset as named, a file by its name, with its factory arguments
    (``my_model.py:build(width=64)``); ``?`` when unknown."""
    name = run.value(kind)
    if not isinstance(name, str):
        return "?"
    label = short_name(name)
    args = run.value(f"{kind}_args")
    if not isinstance(args, dict):  # a run without run.json: its config's key=value list
        listed = run.value(f"{kind}_arg")
        args = dict(a.partition("=")[::2] for a in listed) if isinstance(listed, list) else {}
    if args:
        label += "(" + ",".join(f"{k}={v}" for k, v in sorted(args.items())) + ")"
    return label


def _accuracy(run: RunData) -> tuple[float | None, float | None, float | None]:
    """Final loss, final and best accuracy (run.json, else the records)."""
    accs = [e.accuracy for e in run.evals if e.accuracy is not None]
    final_loss = run.stats.last_loss
    final = number(run.summary.get("final_accuracy"))
    best = number(run.summary.get("best_accuracy"))
    return (
        final_loss,
        final if final is not None else (accs[-1] if accs else None),
        best if best is not None else (max(accs) if accs else None),
    )


def run_row(
    run: RunData, varying: frozenset[str] = frozenset(), target: Target | None = None
) -> Row:
    """The runs-table row of ``run``; ``varying`` as for :func:`group_label`; ``target``
    overrides each run's own target."""
    world = number(run.value("world_size"))
    if world is None and number(run.value("nodes")) and number(run.value("ranks_per_node")):
        world = float(run.value("nodes") * run.value("ranks_per_node"))
    world_size = None if world is None else int(world)
    wall = number(run.summary.get("wall_s"))
    if wall is None and run.segments:
        walls = [s.wall_s for s in run.segments if s.wall_s is not None]
        wall = sum(walls) if walls else None
    compute = number(run.summary.get("compute_s"))
    if compute is None and run.stats.windows:
        compute = run.stats.step_weighted_s
    target_value, metric = run_target(run, target)
    tts, tts_step = time_to_target(run, target_value, lower_is_better=metric == "loss")
    phases = phase_means(run)
    phase_total = sum(phases.values())
    comm = sum(phases.get(p, 0.0) for p in schema.COMM_PHASES)
    step_mean, step_p50, step_p90 = _step_stats(run)
    final_loss, final_acc, best_acc = _accuracy(run)
    last_step = run.stats.last_step
    row: Row = {
        "schema": schema.TABLE_SCHEMA,
        "run_id": run.run_id,
        "point_id": run.point_id,
        "run_dir": str(run.path),
        "state": run.state,
        "reason": run.reason,
        "notes": "; ".join(run.notes),
        "group": group_label(run, varying),
        "first_order_group": group_label(run, varying, first_order=True),
        "optimizer_label": optimizer_label(run),
        "method": run_method(run),
        **{key: run.value(key) for key in IDENTITY},
        "model": workload_label(run, "model"),
        "dataset": workload_label(run, "dataset"),
        "nodes": run.value("nodes"),
        "world_size": world_size,
        "global_batch_size": batch_size(run, "global_batch_size"),
        "per_rank_batch_size": batch_size(run, "per_rank_batch_size"),
        "repeat": run.value("repeat") if run.value("repeat") is not None else run.value("seed"),
        "config_hash": run.value("config_hash"),
        "job_state": run.manifest.get("state"),
        "array_job_id": run.manifest.get("array_job_id"),
        "job_id": run.manifest.get("job_id"),
        "segments": len(run.segments),
        "restarts": max(0, len(run.segments) - 1),
        "steps": run.summary.get("steps", last_step),
        "epochs": run.value("epochs"),
        "wall_s": wall,
        "compute_s": compute,
        "step_mean_s": step_mean,
        "step_p50_s": step_p50,
        "step_p90_s": step_p90,
        **_throughput(run, world_size),
        "final_loss": final_loss,
        "final_accuracy": final_acc,
        "best_accuracy": best_acc,
        "target_accuracy": target_value if metric == "accuracy" else None,
        "target_loss": target_value if metric == "loss" else None,
        "time_to_target_s": tts,
        "step_to_target": tts_step,
        "comm_fraction": ratio(comm, phase_total) if phases else None,
        "straggler_spread_fraction": _straggler_spread(run),
        **{f"phase_{p}_s": phases.get(p) for p in schema.PHASES},
        "peak_rss_bytes": run.summary.get("peak_rss_bytes"),
        "peak_cuda_bytes": run.summary.get("peak_cuda_bytes"),
        "host_memory": run.summary.get("host_memory"),
    }
    return row


def phase_rows(run: RunData, row: Row) -> list[Row]:
    """The long per-phase rows of one run: per-step mean, p50, p90 over logging windows,
    share of the summed phases, and the spread of the ranks' means."""
    means = phase_means(run)
    total = sum(means.values())
    rank_summary = run.summary.get("rank_phases_s")
    out = []
    ordered = [p for p in schema.PHASES if p in means] + sorted(set(means) - set(schema.PHASES))
    for phase in ordered:
        ranks: list[float] = []
        if isinstance(rank_summary, dict):  # the job's own per-rank means
            ranks = float_list(rank_summary.get(phase))
        elif run.stats.with_rank_phases:
            ranks = run.stats.rank_phases_s.get(phase, [])
        out.append(
            {
                "schema": schema.TABLE_SCHEMA,
                "run_id": run.run_id,
                "state": run.state,
                "group": row["group"],
                "optimizer_label": row["optimizer_label"],
                "nodes": row["nodes"],
                "phase": phase,
                "mean_s": means[phase],
                "p50_s": run.stats.phase_p50_s.get(phase),
                "p90_s": run.stats.phase_p90_s.get(phase),
                "share_fraction": ratio(means[phase], total),
                "rank_min_s": min(ranks) if ranks else None,
                "rank_max_s": max(ranks) if ranks else None,
                "rank_spread_s": max(ranks) - min(ranks) if ranks else None,
            }
        )
    return out


def segment_rows(run: RunData) -> list[Row]:
    """One row per attempt of ``run``."""
    return [
        {
            "schema": schema.TABLE_SCHEMA,
            "run_id": run.run_id,
            "segment": s.attempt,
            "start_step": s.start_step,
            "end_step": s.end_step,
            "wall_s": s.wall_s,
            "compute_s": s.compute_s,
            "end": s.end,
        }
        for s in run.segments
    ]
