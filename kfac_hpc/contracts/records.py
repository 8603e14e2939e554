"""The records of a run directory: the fields of ``train`` and ``eval`` records
(metrics.jsonl) and of the summary (run.json), with their types, and the strict validator.

The job writes these records (train/records.py, train/summary.py), the collector reads them
tolerantly (analysis/rundir.py); :func:`validate_run_dir` is the strict check the tests hold
every real run directory to. Readers ignore fields they do not know, so adding a field needs no
schema change; removing one or changing its meaning bumps ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.phases import PHASES
from kfac_hpc.contracts.rundir import SCHEMA_VERSION, Marker, RunDir

__all__ = [
    "EVAL",
    "EVAL_FIELDS",
    "RUN_FIELDS",
    "TRAIN",
    "TRAIN_FIELDS",
    "HostMemory",
    "phase_step_s",
    "validate_run_dir",
]

# The ``kind`` of a metrics.jsonl record; other kinds may appear and are skipped by readers.
TRAIN = "train"
EVAL = "eval"
_NONE = type(None)

# One ``train`` record per logging window: per-step means in seconds, rank-averaged, and the
# same per rank (``rank_*``: one value per rank, rank order).
TRAIN_FIELDS: dict[str, Any] = {
    "schema": int,
    "kind": str,
    "attempt": int,
    "step": int,
    "epoch": int,
    "wall_s": float,
    "window_steps": int,
    "loss": float,
    "samples_per_s": float,
    "step_s": float,
    "phases_s": dict,
    "rank_step_s": list,
    "rank_phases_s": dict,
}
EVAL_FIELDS: dict[str, Any] = {
    "schema": int,
    "kind": str,
    "attempt": int,
    "step": int,
    "epoch": int,
    "wall_s": float,
    "loss": float,
    "accuracy": float,
}


class HostMemory(str, enum.Enum):
    """run.json's ``host_memory``: what became of the rank's freed host memory (docs/train.md,
    "Host memory")."""

    KEPT = "kept"  # glibc set up to keep freed blocks for reuse
    DEFAULT = "default"  # not asked (--no-keep-freed-memory)
    ENVIRONMENT = "environment"  # the user's MALLOC_*, glibc.malloc tunables or LD_PRELOAD
    UNSUPPORTED = "unsupported"  # not glibc, or mallopt refused

    def __str__(self) -> str:
        return self.value


# run.json; ``state`` is the name of the marker written with it (done, error, preempted), and a
# state ``error`` comes with an ``error`` message.
RUN_FIELDS: dict[str, Any] = {
    "schema": int,
    "state": str,
    "run_id": str,
    "config_hash": str,
    "model": str,
    "model_args": dict,
    "dataset": str,
    "dataset_args": dict,
    "optimizer": str,
    "kfac": bool,
    "grad_worker_fraction": float,
    "scaling": str,
    "world_size": int,
    "nodes": int,
    "ranks_per_node": int,
    "launcher": str,
    "backend": str,
    "global_batch_size": int,
    "per_rank_batch_size": int,
    "steps": int,
    "epochs": int,
    "final_accuracy": (float, _NONE),
    "best_accuracy": (float, _NONE),
    "metric": str,
    "higher_is_better": bool,
    "final_test_loss": (float, _NONE),
    "best_test_loss": (float, _NONE),
    "target_accuracy": (float, _NONE),
    "target_loss": (float, _NONE),
    "time_to_target_s": (float, _NONE),
    "step_to_target": (int, _NONE),
    "wall_s": float,
    "compute_s": float,
    "attempts": list,
    "restarts": int,
    "step_s": dict,
    "samples_per_s": float,
    "samples_per_s_per_rank": list,
    "phases_s": dict,
    "rank_phases_s": dict,
    "peak_rss_bytes": int,
    "peak_cuda_bytes": (int, _NONE),
    "host_memory": str,
    "threads": int,
    "threads_from": str,
    "versions": dict,
}


def phase_step_s(summary: dict[str, Any]) -> float | None:
    """The step that ``run.json``'s ``phases_s`` split: the mean over ranks of each rank's mean
    step (``rank_step_s``), so that the step minus its phases is the mean time outside every
    phase (each rank's is >= 0). ``step_s`` is rank 0's steps alone: a rank that leaves
    out-of-step work (records, evaluation) first waits for the others inside its next step's
    collective, so rank 0's step and the ranks' mean phases differ. A ``run.json`` written
    before ``rank_step_s`` existed gives ``step_s``'s mean; None without either."""
    ranks = summary.get("rank_step_s")
    if isinstance(ranks, list) and ranks:
        return sum(float(s) for s in ranks) / len(ranks)
    step = summary.get("step_s")
    if isinstance(step, dict):
        step = step.get("mean")
    return None if step is None else float(step)


def _check(obj: dict[str, Any], keys: dict[str, Any], where: str) -> list[str]:
    problems = []
    for key, kind in keys.items():
        if key not in obj:
            problems.append(f"{where}: missing {key!r}")
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = obj[key]
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            problems.append(f"{where}: {key!r} is {type(value).__name__}, not {kind}")
    if obj.get("schema") != SCHEMA_VERSION:
        problems.append(f"{where}: schema {obj.get('schema')!r} is not {SCHEMA_VERSION}")
    return problems


def _check_phases(obj: dict[str, Any], where: str, world_size: int | None) -> list[str]:
    problems = []
    for key in ("phases_s", "rank_phases_s"):
        missing = set(PHASES) - set(obj.get(key, {}))  # a method may add its own phases
        if missing:
            problems.append(f"{where}: {key} lacks the contract phases {sorted(missing)}")
    if world_size is not None:
        for name, values in obj.get("rank_phases_s", {}).items():
            if len(values) != world_size:
                problems.append(f"{where}: rank_phases_s[{name!r}] has {len(values)} ranks")
    return problems


def validate_run_dir(root: str | Path) -> list[str]:
    """Problems with a finished run directory (empty when it follows the contract)."""
    run_dir = RunDir(root)
    problems: list[str] = []
    present = [str(m) for m in (Marker.DONE, Marker.ERROR) if run_dir.marker(m).exists()]
    if len(present) != 1:
        problems.append(f"expected exactly one of done/error, found {present or 'none'}")
    if not run_dir.config.exists():
        problems.append("config.json missing")
    else:
        config = json.loads(run_dir.config.read_text())
        if config.get("schema") != SCHEMA_VERSION or "config_hash" not in config:
            problems.append("config.json lacks schema or config_hash")
    world_size = None
    if not run_dir.run.exists():
        problems.append("run.json missing")
    else:
        summary = json.loads(run_dir.run.read_text())
        problems += _check(summary, RUN_FIELDS, "run.json")
        world_size = summary.get("world_size")
        problems += _check_phases(summary, "run.json", world_size)
        if len(summary.get("samples_per_s_per_rank", [])) != world_size:
            problems.append("run.json: samples_per_s_per_rank is not one per rank")
        ranks = summary.get("rank_step_s")  # absent in run.json files written before it
        if ranks is not None and len(ranks) != world_size:
            problems.append("run.json: rank_step_s is not one per rank")
        if summary.get("state") == str(Marker.ERROR) and not summary.get("error"):
            problems.append("run.json: state error without an error message")
        if summary.get("host_memory") not in {str(state) for state in HostMemory}:
            problems.append(f"run.json: host_memory {summary.get('host_memory')!r} is unknown")
    for i, record in enumerate(run_dir.read_metrics()):
        where = f"metrics.jsonl line {i + 1}"
        if record.get("kind") == TRAIN:
            problems += _check(record, TRAIN_FIELDS, where)
            problems += _check_phases(record, where, world_size)
        elif record.get("kind") == EVAL:
            problems += _check(record, EVAL_FIELDS, where)
        else:
            problems.append(f"{where}: unknown kind {record.get('kind')!r}")
    return problems
