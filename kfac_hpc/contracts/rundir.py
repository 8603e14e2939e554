"""The run directory: its file names, markers and schema version, the one writer (the job,
through :class:`RunDir`) and the raw readers every reader of it uses.

One directory per training run (docs/contracts.md)::

    config.json       the resolved config, written at the start
    metrics.jsonl     one record per line: ``train`` windows and ``eval`` points
    run.json          the summary, rewritten atomically at the end of every attempt
    checkpoints/      HDF5 checkpoints and the pointer to the latest complete one
    .attempts.jsonl   the job's own bookkeeping of its attempts (not read by the collector)
    done | error | preempted   how the last attempt ended (exactly one of done/error at the end)
"""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from kfac_hpc.contracts.atomic import write_text_atomic
from kfac_hpc.contracts.errors import InputError

__all__ = [
    "ATTEMPTS",
    "CHECKPOINTS",
    "CONFIG",
    "METRICS",
    "PREDICTED",
    "RUN",
    "SCHEMA_VERSION",
    "Marker",
    "Markers",
    "RunDir",
    "read_marker",
    "read_markers",
    "write_json_atomic",
]

# Version of config.json, metrics.jsonl and run.json; bump it when a field changes meaning or
# goes away (readers then say which version they read instead of misreading the files).
SCHEMA_VERSION = 1
CONFIG = "config.json"
METRICS = "metrics.jsonl"
RUN = "run.json"
CHECKPOINTS = "checkpoints"
ATTEMPTS = ".attempts.jsonl"
# At a sweep's root (not in a run directory): what `kfac-hpc plan --explain` predicted for each
# run directory, for `kfac-hpc report` to show beside the measurements.
PREDICTED = "predicted.json"


class Marker(str, enum.Enum):
    """Empty-or-one-line files that say how the last attempt ended."""

    DONE = "done"  # run.json is final
    ERROR = "error"  # holds the first failing rank's message
    PREEMPTED = "preempted"  # checkpointed on a signal (exit 75), waiting for a requeue

    def __str__(self) -> str:
        return self.value


class Markers(NamedTuple):
    """The first line of each marker ('' when empty), None when the marker is absent."""

    done: str | None = None
    error: str | None = None
    preempted: str | None = None


def read_marker(path: Path) -> str | None:
    """The first non-empty line of a marker file, '' for an empty or unreadable marker, None
    if absent (or its run directory is not a directory)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ""


def read_markers(root: Path) -> Markers:
    """Every marker of the run directory ``root``."""
    return Markers(*(read_marker(root / str(m)) for m in Marker))


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


class RunDir:
    """Paths and writes of one run directory. Only rank 0 writes, except ``error`` (any rank
    that fails writes it, first writer wins)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.config = self.root / CONFIG
        self.metrics = self.root / METRICS
        self.run = self.root / RUN
        self.checkpoints = self.root / CHECKPOINTS
        self.attempts = self.root / ATTEMPTS

    def saved_config_hash(self) -> str | None:
        """The config hash in ``config.json``, or None when there is none yet; InputError
        (field ``run_dir``) when it cannot be read."""
        if not self.config.exists():
            return None
        try:
            saved = json.loads(self.config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise InputError(
                "run_dir", f"{str(self.config)!r} is not readable JSON ({exc})"
            ) from None
        if not isinstance(saved, dict):
            raise InputError("run_dir", f"{str(self.config)!r} does not hold a JSON object")
        hash_ = saved.get("config_hash")
        return None if hash_ is None else str(hash_)

    def check_usable(self) -> None:
        """InputError (field ``run_dir``) unless the directory exists as one or can be
        created, and its ``checkpoints`` is a directory or absent. Writes nothing."""
        text = str(self.root)
        for part in self.root.parts:
            if len(os.fsencode(part)) > 255:
                raise InputError("run_dir", f"the name {part[:20]!r}... is over 255 bytes long")
        if self.root.exists() and not self.root.is_dir():
            raise InputError("run_dir", f"{text!r} exists and is not a directory")
        if self.checkpoints.exists() and not self.checkpoints.is_dir():
            raise InputError("run_dir", f"{str(self.checkpoints)!r} is not a directory")
        existing = self.root
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise InputError("run_dir", f"{str(existing)!r} is not a directory")
        target = self.root if self.root.exists() else existing
        if not os.access(target, os.W_OK | os.X_OK):
            raise InputError("run_dir", f"{str(target)!r} is not writable")

    def marker(self, name: str | Marker) -> Path:
        return self.root / str(name)

    def markers(self) -> Markers:
        return read_markers(self.root)

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)

    def clear_markers(self) -> None:
        """Remove ``error`` and ``preempted`` left by an earlier attempt that is now retried."""
        for name in (Marker.ERROR, Marker.PREEMPTED):
            self.marker(name).unlink(missing_ok=True)

    def write_marker(self, name: str | Marker, message: str = "") -> bool:
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
