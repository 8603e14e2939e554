"""A per-run cache of what the collector read: collecting a sweep again (while it runs, or after
one more point finished) re-reads only the run directories whose files changed.

One file, ``<source>/.cache/collect.jsonl``: a header line, then one line per run directory,
``[path, signature] TAB run``. The signature holds the size, modification time (ns) and inode
of each file the reader opens, and the run's manifest point (its state decides the row's state
too); the run is the :class:`RunData` read then, its float arrays base64-packed. A line whose
signature differs from the run's files now is read again; a cache written by another version
is ignored. Writing it is best effort (a read-only sweep directory is collected without one).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import sys
from array import array
from dataclasses import fields
from pathlib import Path
from typing import Any

from kfac_hpc import __version__
from kfac_hpc.analysis.aggregate import WindowStats
from kfac_hpc.analysis.rundir import EvalPoint, RunData, Segment, new_run
from kfac_hpc.contracts.rundir import CONFIG, METRICS, RUN, Marker

JSON = dict[str, Any]
CACHE_DIR = ".cache"
CACHE_FILE = "collect.jsonl"
# Every file read_run_dir opens in a run directory.
RUN_FILES = (CONFIG, RUN, METRICS, *(str(m.value) for m in Marker))
_HEADER = json.dumps(
    {"cache": "collect", "version": 1, "kfac_hpc": __version__, "byteorder": sys.byteorder}
)
_ARRAYS = ("step_s", "wall_s", "loss")
# run.json's per-rank lists (world size x phases numbers).
_PER_RANK = ("rank_phases_s", "samples_per_s_per_rank")
_INT_KEYED = ("compute_by_attempt", "spans")


def signature(path: Path, point: JSON | None) -> str:
    """What must be unchanged for a cached read of ``path`` to stand."""
    files: list[Any] = []
    base = os.fspath(path)
    for name in RUN_FILES:
        try:
            st = os.stat(os.path.join(base, name))
        except OSError:  # absent (or path is no directory)
            files.append(None)
            continue
        files.append((st.st_size, st.st_mtime_ns, st.st_ino))
    return json.dumps([os.path.isdir(base), files, point], default=str)


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


def _pack(values: Any) -> Any:
    """A list of floats as base64 of its doubles (exact, and parsed at C speed), else as is."""
    if isinstance(values, list) and values and set(map(type, values)) == {float}:
        return {"f8": base64.b64encode(array("d", values).tobytes()).decode("ascii")}
    return values


def _unpack(value: Any) -> Any:
    if isinstance(value, dict) and len(value) == 1 and "f8" in value:
        column = array("d")
        column.frombytes(base64.b64decode(value["f8"]))
        return column.tolist()
    return value


def _pack_summary(summary: JSON) -> JSON:
    """run.json with its per-rank lists packed: they are most of its numbers."""
    out = dict(summary)
    for key, value in summary.items():
        if key in _PER_RANK and isinstance(value, dict):
            out[key] = {k: _pack(v) for k, v in value.items()}
        elif key in _PER_RANK:
            out[key] = _pack(value)
    return out


def _unpack_summary(summary: JSON) -> JSON:
    for key in _PER_RANK:
        value = summary.get(key)
        if isinstance(value, dict) and "f8" not in value:
            summary[key] = {k: _unpack(v) for k, v in value.items()}
        elif value is not None:
            summary[key] = _unpack(value)
    return summary


def encode(run: RunData) -> str:
    """The file-derived parts of ``run`` as one JSON line (no newline)."""
    return json.dumps(
        {
            "run_id": run.run_id,
            "state": run.state,
            "reason": run.reason,
            "config": run.config,
            "summary": _pack_summary(run.summary),
            "notes": run.notes,
            "evals": [list(vars_of(e)) for e in run.evals],
            "segments": [list(vars_of(s)) for s in run.segments],
            "stats": _encode_stats(run.stats),
        },
        separators=(",", ":"),
    )


def vars_of(item: EvalPoint | Segment) -> tuple[Any, ...]:
    """The fields of a slotted record, in declaration order."""
    return tuple(getattr(item, f.name) for f in fields(item))


def decode(text: str, path: Path, point: JSON | None) -> RunData:
    """The :class:`RunData` of an :func:`encode` line, with ``path`` and its manifest point."""
    data = json.loads(text)
    run = new_run(path, point)
    run.run_id, run.state, run.reason = data["run_id"], data["state"], data["reason"]
    run.config, run.notes = data["config"], data["notes"]
    run.summary = _unpack_summary(data["summary"])
    run.evals = [EvalPoint(*e) for e in data["evals"]]
    run.segments = [Segment(*s) for s in data["segments"]]
    run.stats = _decode_stats(data["stats"])
    return run


class RunCache:
    """The cache of one source directory: :meth:`lookup` before reading, :meth:`save` after."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.path = source / CACHE_DIR / CACHE_FILE
        self._old: dict[str, tuple[str, str]] = {}  # run path -> (signature, line)
        self._new: list[str] = []
        try:
            lines = self.path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError):
            return
        if lines[0] != _HEADER:
            return
        for line in lines[1:]:
            head, tab, _ = line.partition("\t")
            if tab:
                key, sig = json.loads(head)
                self._old[key] = (sig, line)

    def lookup(self, path: Path, point: JSON | None) -> tuple[RunData | None, str]:
        """(the cached run or None, the signature of its files now)."""
        sig = signature(path, point)
        hit = self._old.get(self._key(path))
        if hit is None or hit[0] != sig:
            return None, sig
        line = hit[1]
        self._new.append(line)
        return decode(line.partition("\t")[2], path, point), sig

    def add(self, run: RunData, sig: str, encoded: str) -> None:
        """Remember a fresh read of ``run`` (``encoded`` by :func:`encode`)."""
        self._new.append(json.dumps([self._key(run.path), sig]) + "\t" + encoded)

    def _key(self, path: Path) -> str:
        """``path`` relative to the source when inside it: the same run whichever way the
        source is spelt (relative, absolute, through a link)."""
        try:
            return path.relative_to(self.source).as_posix()
        except ValueError:
            return str(path)

    def save(self) -> None:
        """Write the runs looked up or added since loading; silently skipped when the
        directory is not writable."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(exist_ok=True)
            # No fsync: a cache lost in a crash is only read again.
            tmp.write_text("\n".join([_HEADER, *self._new]) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
