"""A per-run cache of what the collector read: collecting a sweep again (while it runs, or after
one more point finished) re-reads only the run directories whose files changed, and rewrites
only their cache files.

A run's cache files (:class:`RunCache`) hold its :class:`RunData` as read (window arrays
base64-packed) and, once tables were built from it, its table rows. Each is keyed by the run's
signature: the size, modification time (ns) and inode of the run directory and of the files the
job changes in place, and the run's manifest point (its state decides the row's state too).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import os
import sys
from array import array
from dataclasses import fields
from pathlib import Path
from typing import Any

import orjson

from kfac_hpc import __version__
from kfac_hpc.analysis.aggregate import WindowStats
from kfac_hpc.analysis.rundir import EvalPoint, RunData, Segment, new_run
from kfac_hpc.contracts.rundir import CONFIG, METRICS, RUN

JSON = dict[str, Any]
CACHE_DIR = ".cache"
CACHE_FOLDER = "collect"
# The folder's own entry changes whenever a file is created, removed or renamed into it (the
# job creates its markers, and replaces run.json and config.json by rename); metrics.jsonl is
# appended in place, and the JSON files are watched too in case one is edited where it lies.
WATCHED = ("", CONFIG, METRICS, RUN)
# Part of every cache file's first line: files of another version or byte order never match.
_HEADER = f"collect-cache 7 kfac-hpc {__version__} {sys.byteorder}"
_ARRAYS = ("step_s", "wall_s", "loss")
_STDLIB = "="  # marks a payload for the standard library's parser
_INT_KEYED = ("compute_by_attempt", "spans")


def signature(path: Path, point: JSON | None) -> str:
    """What must be unchanged for a cached read of ``path`` to stand: the size, modification
    time and inode of the run directory and of the files in :data:`WATCHED`, and the point."""
    files: list[Any] = []
    base = os.fspath(path)
    for name in WATCHED:
        try:
            st = os.stat(os.path.join(base, name))
        except OSError:  # absent (or path is no directory)
            files.append(None)
            continue
        files.append((st.st_size, st.st_mtime_ns, st.st_ino))
    return json.dumps([files, point], default=str)


def _encode_stats(stats: WindowStats) -> JSON:
    out: JSON = {}
    for f in fields(stats):
        value = getattr(stats, f.name)
        if f.name in _ARRAYS:
            value = base64.b64encode(value.tobytes()).decode("ascii")
        elif f.name in _INT_KEYED:
            value = list(value.items())
        out[f.name] = value
    return out


def _decode_stats(data: JSON) -> WindowStats:
    values = dict(data)
    for name in _ARRAYS:
        column = array("d")
        column.frombytes(base64.b64decode(data[name]))
        values[name] = column
    for name in _INT_KEYED:
        values[name] = {int(k): v for k, v in data[name]}
    return WindowStats(**values)


def _finite(value: Any) -> bool:
    """True when no float in ``value`` (nested lists and dicts) is NaN or infinite."""
    kind = type(value)
    if kind is float:
        return math.isfinite(value)
    if kind is dict:
        return all(_finite(v) for v in value.values())
    if kind is list or kind is tuple:
        if set(map(type, value)) == {float}:
            return all(map(math.isfinite, value))
        return all(_finite(v) for v in value)
    return True


def dumps(value: Any) -> str:
    """``value`` as JSON text that :func:`loads` reads back equal: orjson's (ten times faster)
    when it writes ``value`` exactly, else the standard library's, marked: orjson writes NaN and
    infinities as null and refuses integers beyond 64 bits."""
    if _finite(value):
        try:
            return orjson.dumps(value).decode("utf-8")
        except orjson.JSONEncodeError:  # an integer beyond 64 bits
            pass
    return _STDLIB + json.dumps(value, separators=(",", ":"))


def loads(text: str) -> Any:
    """The value of a :func:`dumps` text."""
    if text.startswith(_STDLIB):
        return json.loads(text[1:])
    return orjson.loads(text)


def encode(run: RunData) -> str:
    """The file-derived parts of ``run`` as one JSON line (no newline)."""
    return dumps(
        {
            "run_id": run.run_id,
            "state": run.state,
            "reason": run.reason,
            "config": run.config,
            "summary": run.summary,
            "notes": run.notes,
            "evals": [list(vars_of(e)) for e in run.evals],
            "segments": [list(vars_of(s)) for s in run.segments],
            "stats": _encode_stats(run.stats),
        }
    )


def vars_of(item: EvalPoint | Segment) -> tuple[Any, ...]:
    """The fields of a slotted record, in declaration order."""
    return tuple(getattr(item, f.name) for f in fields(item))


def decode(text: str, path: Path, point: JSON | None) -> RunData:
    """The :class:`RunData` of an :func:`encode` line, with ``path`` and its manifest point."""
    data = loads(text)
    run = new_run(path, point)
    run.run_id, run.state, run.reason = data["run_id"], data["state"], data["reason"]
    run.config, run.notes = data["config"], data["notes"]
    run.summary = data["summary"]
    run.evals = [EvalPoint(*e) for e in data["evals"]]
    run.segments = [Segment(*s) for s in data["segments"]]
    run.stats = _decode_stats(data["stats"])
    return run


class RunCache:
    """The cache of one source directory, one pair of files per run directory in
    ``<source>/.cache/collect/``: ``<digest>.run`` (the :func:`encode`-d run) and
    ``<digest>.rows`` (its table rows, see :mod:`kfac_hpc.analysis.incremental`). Each file's
    first line is ``[header, path, signature]``: it stands only while that line is unchanged.
    Writing is best effort (a read-only sweep directory is collected without a cache) and not
    fsync'd: a cache file lost in a crash is only read again."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.folder = source / CACHE_DIR / CACHE_FOLDER
        self._writable = True

    def _key(self, path: Path) -> str:
        """``path`` relative to the source when inside it: the same run whichever way the
        source is spelt (relative, absolute, through a link)."""
        try:
            return path.relative_to(self.source).as_posix()
        except ValueError:
            return str(path)

    def _file(self, path: Path, suffix: str) -> Path:
        digest = hashlib.sha1(self._key(path).encode("utf-8")).hexdigest()[:24]
        return self.folder / f"{digest}.{suffix}"

    def _first_line(self, path: Path, sig: str) -> str:
        return json.dumps([_HEADER, self._key(path), sig])

    def _read(self, path: Path, sig: str, suffix: str) -> str | None:
        """The payload of ``path``'s ``suffix`` file if it was written for signature ``sig``."""
        try:
            text = self._file(path, suffix).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        head, _, payload = text.partition("\n")
        return payload if head == self._first_line(path, sig) else None

    def _write(self, path: Path, sig: str, suffix: str, payload: str) -> None:
        if not self._writable:
            return
        target = self._file(path, suffix)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(f"{self._first_line(path, sig)}\n{payload}", encoding="utf-8")
            os.replace(tmp, target)
        except OSError:
            self._writable = False
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def lookup(self, path: Path, point: JSON | None) -> tuple[RunData | None, str]:
        """(the cached run or None, the signature of its files now)."""
        sig = signature(path, point)
        return self.run(path, point, sig), sig

    def run(self, path: Path, point: JSON | None, sig: str) -> RunData | None:
        """The run kept for ``path`` under signature ``sig``, or None."""
        payload = self._read(path, sig, "run")
        return None if payload is None else decode(payload, path, point)

    def add(self, run: RunData, sig: str, encoded: str) -> None:
        """Keep a fresh read of ``run`` (``encoded`` by :func:`encode`) under signature ``sig``."""
        self._write(run.path, sig, "run", encoded)

    def rows(self, path: Path, sig: str, context: str) -> JSON | None:
        """The rows kept by :meth:`set_rows` for ``path`` when its files still have signature
        ``sig`` and the rows were built in ``context``; else None."""
        payload = self._read(path, sig, "rows")
        if payload is None:
            return None
        rows = loads(payload)
        return rows if isinstance(rows, dict) and rows.get("context") == context else None

    def set_rows(self, path: Path, sig: str, rows: JSON) -> None:
        """Keep ``rows`` (a JSON object with a ``context`` key) for ``path`` under ``sig``."""
        self._write(path, sig, "rows", dumps(rows))

    def prune(self, paths: list[Path]) -> None:
        """Remove the cache files of run directories other than ``paths``."""
        keep = {self._file(p, suffix).name for p in paths for suffix in ("run", "rows")}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.folder):
                if entry.name not in keep:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
