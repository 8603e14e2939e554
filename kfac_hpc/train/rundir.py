"""The run directory of docs/contracts.md: paths, atomic writes, markers, and a schema checker.

Torch-free on purpose: the collector may import :func:`validate_run_dir` without the job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kfac_hpc.atomic_write import write_text_atomic
from kfac_hpc.phases import PHASES

__all__ = [
    "MARKERS",
    "PHASES",
    "SCHEMA_VERSION",
    "RunDir",
    "validate_run_dir",
    "write_json_atomic",
]

SCHEMA_VERSION = 1
MARKERS = ("done", "error", "preempted")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


class RunDir:
    """Paths and writes of one run directory. Only rank 0 writes, except ``error`` (any rank
    that fails writes it, first writer wins)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.config = self.root / "config.json"
        self.metrics = self.root / "metrics.jsonl"
        self.run = self.root / "run.json"
        self.checkpoints = self.root / "checkpoints"

    def saved_config_hash(self) -> str | None:
        """The config hash in ``config.json``, or None when there is none yet."""
        if not self.config.exists():
            return None
        saved = json.loads(self.config.read_text()).get("config_hash")
        return None if saved is None else str(saved)

    def marker(self, name: str) -> Path:
        return self.root / name

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)

    def clear_markers(self) -> None:
        """Remove ``error`` and ``preempted`` left by an earlier attempt that is now retried."""
        for name in ("error", "preempted"):
            self.marker(name).unlink(missing_ok=True)

    def write_marker(self, name: str, message: str = "") -> bool:
        """Create marker ``name`` atomically holding ``message``; False if it already existed."""
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(message + ("\n" if message and not message.endswith("\n") else ""))
        try:
            os.link(tmp, self.marker(name))
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line per record, flushed so a killed run keeps every finished window."""
        with open(self.metrics, "a") as fh:
            fh.write(json.dumps(record, separators=(",", ":")) + "\n")
            fh.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        """Every complete record (a line cut short by a kill is skipped)."""
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


_TRAIN_KEYS = {
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
_EVAL_KEYS = {
    "schema": int,
    "kind": str,
    "attempt": int,
    "step": int,
    "epoch": int,
    "wall_s": float,
    "loss": float,
    "accuracy": float,
}
_RUN_KEYS = {
    "schema": int,
    "state": str,
    "run_id": str,
    "config_hash": str,
    "model": str,
    "dataset": str,
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
    "final_accuracy": (float, type(None)),
    "best_accuracy": (float, type(None)),
    "target_accuracy": (float, type(None)),
    "time_to_target_s": (float, type(None)),
    "step_to_target": (int, type(None)),
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
    "peak_cuda_bytes": (int, type(None)),
    "versions": dict,
}


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
        names = set(obj.get(key, {}))
        if names != set(PHASES):
            problems.append(f"{where}: {key} names {sorted(names)} differ from the contract")
    if world_size is not None:
        for name, values in obj.get("rank_phases_s", {}).items():
            if len(values) != world_size:
                problems.append(f"{where}: rank_phases_s[{name!r}] has {len(values)} ranks")
    return problems


def validate_run_dir(root: str | Path) -> list[str]:
    """Problems with a finished run directory (empty when it follows docs/contracts.md)."""
    run_dir = RunDir(root)
    problems: list[str] = []
    present = [m for m in ("done", "error") if run_dir.marker(m).exists()]
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
        problems += _check(summary, _RUN_KEYS, "run.json")
        world_size = summary.get("world_size")
        problems += _check_phases(summary, "run.json", world_size)
        if len(summary.get("samples_per_s_per_rank", [])) != world_size:
            problems.append("run.json: samples_per_s_per_rank is not one per rank")
        if summary.get("state") == "error" and not summary.get("error"):
            problems.append("run.json: state error without an error message")
    for i, record in enumerate(run_dir.read_metrics()):
        where = f"metrics.jsonl line {i + 1}"
        if record.get("kind") == "train":
            problems += _check(record, _TRAIN_KEYS, where)
            problems += _check_phases(record, where, world_size)
        elif record.get("kind") == "eval":
            problems += _check(record, _EVAL_KEYS, where)
        else:
            problems.append(f"{where}: unknown kind {record.get('kind')!r}")
    return problems
