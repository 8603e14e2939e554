"""``SWEEP_DIR/manifest.json``: the source of truth of a sweep, rewritten atomically.

Every command (``sweep``, ``status``, ``resume``, ``cancel``, the workflows, the collector)
rebuilds its view from this file and the run directories; no long-lived process is needed.
Writers hold ``manifest.lock`` (an ``flock``) for their read-modify-write, and replace the
file with tmp + fsync + rename so a reader never sees half a manifest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.atomic import write_text_atomic

__all__ = ["ArrayRecord", "Manifest", "PointRecord", "locked_manifest", "read_manifest"]

SCHEMA = 1
MANIFEST = "manifest.json"


@dataclass
class PointRecord:
    """One point. ``job_id`` is Slurm's ``<array_job_id>_<index>`` (or ``local``); ``state``
    is a :class:`~kfac_hpc.contracts.states.PointState` value."""

    point_id: str
    params: dict[str, Any]
    group_hash: str
    run_dir: str
    array: str
    array_index: int
    array_job_id: str | None = None
    job_id: str | None = None
    attempts: int = 0
    state: str = "pending"
    detail: str = ""


@dataclass
class ArrayRecord:
    """One rendered script and every ``sbatch`` of it (first submission, then resumes)."""

    name: str
    nodes: int
    script: str
    size: int
    submissions: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Manifest:
    name: str
    backend: str
    created: float
    spec: dict[str, Any]
    profile: dict[str, Any]
    arrays: list[ArrayRecord]
    points: list[PointRecord]
    schema: int = SCHEMA
    kind: str = "sweep_manifest"

    def array(self, name: str) -> ArrayRecord:
        return next(a for a in self.arrays if a.name == name)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"manifest schema {data.get('schema')!r} is not {SCHEMA}")
        data = dict(data)
        data["arrays"] = [ArrayRecord(**a) for a in data["arrays"]]
        # ``group_hash`` was called ``config_hash`` (a name the job's own hash has too).
        data["points"] = [
            PointRecord(**{("group_hash" if k == "config_hash" else k): v for k, v in p.items()})
            for p in data["points"]
        ]
        return cls(**data)

    def write(self, sweep_dir: Path) -> None:
        """Atomically replace the manifest (tmp file, fsync, rename)."""
        write_text_atomic(sweep_dir / MANIFEST, self.to_json())


def read_manifest(sweep_dir: Path) -> Manifest:
    """The manifest of a sweep; FileNotFoundError when the directory holds none."""
    return Manifest.from_dict(json.loads((sweep_dir / MANIFEST).read_text()))


@contextlib.contextmanager
def locked_manifest(sweep_dir: Path) -> Iterator[Manifest]:
    """Read under an exclusive lock; the caller's changes are written back on exit."""
    with open(sweep_dir / "manifest.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest = read_manifest(sweep_dir)
            yield manifest
            manifest.write(sweep_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def now() -> float:
    """Seconds since the epoch (one place, so records agree)."""
    return time.time()
