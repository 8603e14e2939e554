"""Reading one run directory (docs/contracts.md) tolerantly: every problem becomes a note.

A run directory may be complete, still running, preempted, failed, truncated or corrupt; the
reader never raises for what it finds on disk. It returns a :class:`RunData` whose ``state`` and
``reason`` say what happened and whose ``notes`` list every file problem it worked around.

A value of the wrong type (a list where run.json, config.json or the manifest's parameters
hold a node count, a string where a record holds a number) is dropped with a note. A run whose
markers say done is ``invalid`` ("damaged: ...") when anything it is judged by is damaged: such
a value, an unreadable config.json, or a metrics.jsonl that is missing, empty, cut short or
holds a malformed record. It is never counted as finished.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.aggregate import (
    INT64_MAX,
    WindowAccumulator,
    WindowStats,
    number,
    wrong_type,
    wrong_typed,
)
from kfac_hpc.analysis.run_state import row_state
from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.contracts.records import EVAL, EVAL_FIELDS, RUN_FIELDS, TRAIN, TRAIN_FIELDS
from kfac_hpc.contracts.rundir import CONFIG, METRICS, RUN, Marker, read_markers
from kfac_hpc.contracts.states import ENDED_BADLY, PointState

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class EvalPoint:
    """One ``kind: eval`` record."""

    attempt: int
    step: int
    wall_s: float
    loss: float | None
    accuracy: float | None


@dataclass(frozen=True, slots=True)
class Segment:
    """One attempt (start or requeue) of a run: its step range and the time it took.

    ``wall_s`` is the running time of the attempt; ``compute_s`` the time inside training steps
    (sum of ``step_s * window_steps`` over its windows), None when no window was recorded.
    """

    attempt: int
    start_step: int | None
    end_step: int | None
    wall_s: float | None
    compute_s: float | None
    end: str


@dataclass
class RunData:
    """Everything read from one run directory, plus its manifest point when there is one."""

    path: Path
    run_id: str
    state: str
    reason: str = ""
    point_id: str | None = None
    params: JSON = field(default_factory=dict)
    manifest: JSON = field(default_factory=dict)
    config: JSON = field(default_factory=dict)
    summary: JSON = field(default_factory=dict)
    stats: WindowStats = field(default_factory=WindowStats)
    evals: list[EvalPoint] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def value(self, key: str) -> Any:
        """``key`` from the manifest params (what the sweep asked for: the axes of its
        analysis), else run.json, else config.json; None if absent."""
        for source in (self.params, self.summary, self.config):
            if source.get(key) is not None:
                return source[key]
        return None


class FileProblem(Exception):
    """A file that exists but cannot be used; the message names the file and the problem."""


def _read_json(path: Path) -> JSON | None:
    """The object in ``path``; None if the file is absent; FileProblem if it is unusable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise FileProblem(f"{path.name}: unreadable ({exc})") from exc
    if not text.strip():
        raise FileProblem(f"{path.name}: empty")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileProblem(f"{path.name}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(obj, dict):
        raise FileProblem(f"{path.name}: expected a JSON object, found {type(obj).__name__}")
    _check_schema(obj, path.name)
    return obj


def _check_schema(obj: JSON, where: str) -> None:
    version = obj.get("schema")
    if version is not None and version != schema.RUN_SCHEMA:
        raise FileProblem(
            f"{where}: schema {version!r} is not {schema.RUN_SCHEMA}; "
            "use a kfac-hpc version that reads it"
        )


def _bad_value(value: Any, kind: Any) -> bool:
    """A value that no table column can hold as its contract type: an integer beyond int64, a
    non-integral or out-of-range number where an integer belongs, a number beyond a float."""
    if type(value) is int:
        return not -INT64_MAX <= value <= INT64_MAX
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if type(value) is float and int in kinds and float not in kinds:
        return not (value.is_integer() and -INT64_MAX <= value <= INT64_MAX)
    return False


def _types(kind: Any) -> tuple[type, ...]:
    """The JSON types a value of the contract's ``kind`` may have (an int is a float too)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    out: list[type] = []
    for k in kinds:
        out += [t for t in ((int, float) if k in (int, float) else (k,)) if t not in out]
    return tuple(out)


_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "int": (int, float),
    "float": (int, float),
    "str": (str,),
    "strs": (list, str),
    "ints": (list, str),
}
# run.json's fields (docs/contracts.md), and what config.json and the manifest's parameters
# hold: the job's options and the facts of the run (a node count, a repeat).
RUN_TYPES: dict[str, tuple[type, ...]] = {k: _types(v) for k, v in RUN_FIELDS.items()}
RUN_TYPES["skipped_checkpoints"] = (list,)
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    **RUN_TYPES,
    **{name: _OPTION_TYPES[option.kind] for name, option in OPTIONS.items()},
    "grad_worker_fraction": (str, int, float),  # a name (comm-opt) or the fraction it means
    "repeat": (int, float),
}
TRAIN_TYPES = {k: _types(v) for k, v in TRAIN_FIELDS.items()}
# Per-rank arrays the reader cut (:func:`_without_rank_arrays`) read as 0.
_TRAIN_TYPES_CUT = {**TRAIN_TYPES, "rank_step_s": (list, int), "rank_phases_s": (dict, int)}
EVAL_TYPES = {k: _types(v) for k, v in EVAL_FIELDS.items()}
_NUMBER = (int, float)


def _numbers_in(value: Any, *, nulls: bool = False) -> bool:
    values = value.values() if isinstance(value, dict) else value
    return all((v is None and nulls) or not wrong_type(v, _NUMBER) for v in values)


# What run.json's containers must hold (the tables read into them).
_NESTED: dict[str, Any] = {
    "step_s": lambda v: _numbers_in(v, nulls=True),
    "phases_s": _numbers_in,
    "samples_per_s_per_rank": _numbers_in,
    "rank_phases_s": lambda v: all(isinstance(x, list) and _numbers_in(x) for x in v.values()),
    "attempts": lambda v: all(isinstance(x, dict) for x in v),
}


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def drop_wrong_types(
    obj: JSON, where: str, types: dict[str, tuple[type, ...]], notes: list[str]
) -> list[str]:
    """Remove from ``obj`` (in place) each value of a known key whose type is wrong, each with
    a note; returns those notes (what makes a finished run damaged). null is absence."""
    problems = []
    for key, value in list(obj.items()):
        allowed = types.get(key)
        if allowed is None or value is None:
            continue
        nested = _NESTED.get(key) if types is RUN_TYPES else None
        if wrong_type(value, allowed):
            kinds = " or ".join(t.__name__ for t in allowed)
            problem = f"{key} = {str(value)[:40]} is {_type_name(value)}, not {kinds}"
        elif nested is not None and not nested(value):
            problem = f"{key} = {str(value)[:40]} holds values of the wrong type"
        else:
            continue
        del obj[key]
        problems.append(f"{where}: {problem} (ignored)")
    notes.extend(problems)
    return problems


def _drop_bad_values(obj: JSON, where: str, notes: list[str]) -> None:
    """Remove from ``obj`` (run.json or config.json, in place) the values of the wrong shape,
    each with a note: the run stays in the tables without them."""
    for key in [k for k, v in obj.items() if _bad_value(v, RUN_FIELDS.get(k, ()))]:
        notes.append(f"{where}: {key} = {str(obj.pop(key))[:40]} is out of range (ignored)")


def _drop_bad_steps(run: RunData) -> None:
    """Attempts and steps of the records beyond int64 (a corrupt record) become a note."""
    stats = run.stats
    bad = [a for a in stats.spans if _bad_value(a, int) or _bad_value(stats.spans[a][1], int)]
    bad_last = stats.last_step is not None and _bad_value(stats.last_step, int)
    evals = [e for e in run.evals if not (_bad_value(e.attempt, int) or _bad_value(e.step, int))]
    if not (bad or bad_last or len(evals) < len(run.evals) or stats.out_of_range):
        return
    for attempt in bad:
        stats.spans.pop(attempt, None)
        stats.compute_by_attempt.pop(attempt, None)
    if bad_last:
        stats.last_step = None
    run.evals = evals
    run.notes.append("metrics.jsonl: an attempt or step beyond int64 (ignored)")


def _eval(obj: JSON) -> EvalPoint | None:
    step, wall = number(obj.get("step")), number(obj.get("wall_s"))
    if step is None or wall is None:
        return None
    return EvalPoint(
        attempt=int(number(obj.get("attempt")) or 0),
        step=int(step),
        wall_s=wall,
        loss=number(obj.get("loss")),
        accuracy=number(obj.get("accuracy")),
    )


_RANK_KEY = b'"rank_'
# A per-rank value in its plain shape: ``"rank_step_s": [numbers]`` (group 1) or
# ``"rank_phases_s": {"name": [numbers], ...}`` (group 2); any other shape is left to the parser.
_RANK_HEAD = re.compile(rb'("rank_step_s")\s*:\s*\[|("rank_phases_s")\s*:\s*\{')


def _without_rank_arrays(raw: bytes | mmap.mmap) -> bytes:
    """``raw`` (metrics.jsonl) with the value of each plain per-rank array replaced by 0.

    Parsing those arrays would dominate the collector's time on large sweeps (they are most of
    the bytes); bytes.find skips to each at memchr speed, and the records stay valid JSON
    whatever the position of the key. A value is plain when nothing is nested in it: a ``{``
    before its closing bracket would be nested, or the next line's record (unterminated value).
    """
    pieces: list[bytes] = []
    done = 0
    find, match = raw.find, _RANK_HEAD.match
    start = find(_RANK_KEY)
    while start >= 0:
        head = match(raw, start)
        if head is not None:
            group = head.lastindex or 0
            value = head.end()
            end = find(b"]" if group == 1 else b"}", value)
            if (
                end >= 0
                and find(b"{", value, end) < 0
                and (group == 2 or find(b"[", value, end) < 0)
            ):
                pieces += (raw[done : head.end(group)], b":0")
                done = end + 1
                start = find(_RANK_KEY, done)
                continue
        start = find(_RANK_KEY, start + 1)
    pieces.append(raw[done:])
    return b"".join(pieces)


def _read_without_rank_arrays(path: Path) -> bytes:
    """``path``'s bytes through :func:`_without_rank_arrays`, scanned in a memory map: the
    arrays (most of a finished run's file) are skipped without being copied. Only finished
    runs are read this way; their files no longer change."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return b""
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return _without_rank_arrays(mapped)


def _parse_fast(body: bytes) -> list[Any] | None:
    """Every line of ``body`` (complete lines, no trailing newline) parsed by orjson, at about
    three times the standard library's speed (benchmarks/bench_collect.py measures it). None
    when any line fails: orjson is strict (no NaN, no invalid UTF-8, no blank line), so the
    caller then parses line by line with the standard library to keep and count what it can.
    orjson reads an integer of 20 or more digits (corrupt in any record) as a float: such a
    value then fails the int64 checks as out of range, with a note, as the integer would."""
    if not body:
        return []
    loads = orjson.loads
    try:
        return [loads(line) for line in body.split(b"\n")]
    except orjson.JSONDecodeError:
        return None


def _parse_one(line: str) -> JSON | None:
    """One record, or None when it is not a JSON object of this schema."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    if type(obj) is not dict or obj.get("schema", schema.RUN_SCHEMA) != schema.RUN_SCHEMA:
        return None
    return obj


def read_metrics(path: Path, run: RunData, *, rank_arrays: bool = True) -> list[str]:
    """Fold metrics.jsonl into ``run.stats`` and ``run.evals``; bad lines become notes.

    A last line without its newline is a record being written (or cut by a crash): kept when
    it parses, else skipped with a note. Any other bad line is skipped and counted; a train
    record with a value of the wrong type is counted apart (its other values are used), an
    eval record with one is skipped. ``rank_arrays=False`` skips the per-rank arrays of train
    records. Returns the file's problems: what makes a finished run damaged (a missing or
    empty file among them, which are no note: a run that just started has none yet).
    """
    try:
        raw = path.read_bytes() if rank_arrays else _read_without_rank_arrays(path)
    except FileNotFoundError:
        return ["metrics.jsonl: missing"]
    except OSError as exc:
        run.notes.append(f"metrics.jsonl: unreadable ({exc})")
        return run.notes[-1:]
    if not raw.strip():
        return ["metrics.jsonl: empty"]
    problems: list[str] = []
    body, newline, tail = raw.rpartition(b"\n")
    if not newline:
        body, tail = b"", raw
    objs = _parse_fast(body)
    bad = 0
    if objs is None:
        # Undecodable bytes become U+FFFD: their record then fails to parse and is counted.
        text = body.decode("utf-8", errors="replace")
        objs = [_parse_one(line) for line in text.split("\n") if line and not line.isspace()]
    tail_text = tail.decode("utf-8", errors="replace")
    truncated = 0
    if tail_text and not tail_text.isspace():
        last = _parse_one(tail_text)
        truncated = last is None
        objs.append(last)
    acc = WindowAccumulator()
    for obj in objs:
        if type(obj) is not dict or obj.get("schema", schema.RUN_SCHEMA) != schema.RUN_SCHEMA:
            bad += 1
            continue
        kind = obj.get("kind")
        if type(kind) is not str:  # other kinds are the job's business; no kind is damage
            bad += 1
        elif kind == TRAIN:
            acc.add(obj)
        elif kind == EVAL:
            point = None if wrong_typed([obj], EVAL_TYPES) else _eval(obj)
            bad += point is None
            if point is not None:
                run.evals.append(point)
                acc.span(point.attempt, point.step, point.step, point.wall_s)
        # other kinds (events, config echoes) are the job's business
    run.stats, skipped = acc.finish()
    mistyped = wrong_typed(acc.kept, TRAIN_TYPES if rank_arrays else _TRAIN_TYPES_CUT)
    bad += skipped - truncated  # the cut last line is counted apart
    if truncated:
        problems.append("metrics.jsonl: last line truncated (skipped)")
    if bad:
        problems.append(f"metrics.jsonl: {bad} malformed record(s) skipped")
    if mistyped:
        problems.append(f"metrics.jsonl: {mistyped} record(s) with a value of the wrong type")
    run.notes.extend(problems)
    if not (problems or run.stats.windows or run.evals):
        problems.append("metrics.jsonl: no train or eval record")
    return problems


def _segments_from_summary(run: RunData) -> list[Segment]:
    attempts = run.summary.get("attempts")
    if not isinstance(attempts, list):
        return []
    compute = run.stats.compute_by_attempt
    out = []
    for i, item in enumerate(attempts):
        if not isinstance(item, dict):
            continue
        attempt = int(number(item.get("attempt")) or i)
        start, end = number(item.get("start_step")), number(item.get("end_step"))
        out.append(
            Segment(
                attempt=attempt,
                start_step=None if start is None else int(start),
                end_step=None if end is None else int(end),
                wall_s=number(item.get("wall_s")),
                compute_s=number(item.get("compute_s")) or compute.get(attempt),
                end=str(item.get("end") or "unknown"),
            )
        )
    return out


def _segments_from_records(run: RunData, last_end: str) -> list[Segment]:
    """Segments rebuilt from the records' ``attempt`` field when run.json has none.

    ``wall_s`` of a record counts running time since the first start, so an attempt's wall
    time is its last ``wall_s`` minus the previous attempt's last ``wall_s`` (a lower bound:
    time after the attempt's last record is not visible).
    """
    compute = run.stats.compute_by_attempt
    out, previous_wall = [], 0.0
    attempts = sorted(run.stats.spans)
    for attempt in attempts:
        first, last, last_wall = run.stats.spans[attempt]
        out.append(
            Segment(
                attempt=attempt,
                start_step=max(0, int(first)),
                end_step=int(last),
                wall_s=last_wall - previous_wall,
                compute_s=compute.get(attempt),
                end=last_end if attempt == attempts[-1] else "requeued",
            )
        )
        previous_wall = last_wall
    return out


def new_run(path: Path, point: JSON | None) -> RunData:
    """An empty :class:`RunData` of ``path`` with what its manifest ``point`` says; its
    ``notes`` hold the parameters refused for their type (nothing else has been read yet)."""
    point = point or {}
    raw = point.get("params")
    params = dict(raw) if isinstance(raw, dict) else {}
    notes: list[str] = []
    if raw is not None and not isinstance(raw, dict):
        notes.append(f"manifest: params is {_type_name(raw)}, not an object (ignored)")
    drop_wrong_types(params, "manifest: params", PARAM_TYPES, notes)
    point_id = point.get("point_id")
    return RunData(
        path=path,
        run_id=str(point_id or path.name),
        state=schema.INCOMPLETE,
        point_id=None if point_id is None else str(point_id),
        params=params,
        manifest=point,
        notes=notes,
    )


# The job id of a point the local backend ran (sweep/manifest.py): every rank on this host.
LOCAL_JOB_ID = "local"


def _asked(run: RunData, key: str) -> Any:
    """What the point's launch asked for ``key``: the manifest's parameter, except the ranks
    per node of a local point, which the local backend starts all on this host (its nodes
    emulated): ``nodes x ranks_per_node`` of them."""
    asked = run.params.get(key)
    nodes = run.params.get("nodes")
    local = run.manifest.get("job_id") == LOCAL_JOB_ID
    if key == "ranks_per_node" and local and type(asked) is int and type(nodes) is int:
        return asked * nodes
    return asked


def read_run_dir(path: Path, point: JSON | None = None) -> RunData:
    """Read ``path`` (and its manifest ``point``, if any) into a :class:`RunData`; never raises."""
    point = point or {}
    run = new_run(path, point)
    damage = list(run.notes)  # what a finished run cannot be counted with
    if not path.is_dir():
        job_state = str(point.get("state") or "")
        if job_state in (PointState.PENDING, PointState.SUBMITTED, ""):
            run.reason = f"not started (job {job_state or 'unknown'})"
        elif job_state in ENDED_BADLY:
            detail = str(point.get("detail") or "")[:200]
            run.state = schema.FAILED
            run.reason = f"job {job_state} before creating its run dir" + (
                f": {detail}" if detail else ""
            )
        else:
            run.state, run.reason = schema.MISSING, f"run directory {path} does not exist"
        return run
    for name, target in ((CONFIG, "config"), (RUN, "summary")):
        try:
            setattr(run, target, _read_json(path / name) or {})
        except FileProblem as exc:
            run.notes.append(str(exc))
            damage.append(str(exc))  # run.json's is judged by row_state already
        types = RUN_TYPES if name == RUN else PARAM_TYPES
        damage += drop_wrong_types(getattr(run, target), name, types, run.notes)
        _drop_bad_values(getattr(run, target), name, run.notes)
    markers = read_markers(path)
    # A finished run's summary holds the per-rank figures; the records' arrays are not needed.
    finished = markers.done is not None and run.summary.get("state") == str(Marker.DONE)
    per_rank = all(key in run.summary for key in ("rank_phases_s", "samples_per_s_per_rank"))
    damage += read_metrics(path / METRICS, run, rank_arrays=not (finished and per_rank))
    _drop_bad_steps(run)
    run.state, run.reason = row_state(markers, run.summary, run.manifest)
    if run.state == schema.DONE and damage:
        run.state, run.reason = schema.INVALID, "damaged: " + "; ".join(damage)
    if run.state == schema.DONE and not run.config:
        run.notes.append("config.json missing: parameters taken from run.json")
    for key in ("nodes", "ranks_per_node", "world_size"):
        asked, seen = _asked(run, key), run.summary.get(key)
        if asked is not None and seen is not None and asked != seen:
            run.notes.append(f"{key}: the sweep asked for {asked}, the job saw {seen}")
    if isinstance(run.summary.get("run_id"), str) and not run.point_id:
        run.run_id = run.summary["run_id"]
    # run.json covers the attempts up to its writing; a requeued attempt running now (or
    # killed) is visible only in the records.
    summarised = _segments_from_summary(run)
    last = max((s.attempt for s in summarised), default=-1)
    newer = [
        s
        for s in _segments_from_records(run, "done" if run.state == schema.DONE else run.state)
        if s.attempt > last
    ]
    run.segments = summarised + newer
    if summarised and newer and run.state == schema.INCOMPLETE:
        run.reason = (
            f"attempt {newer[-1].attempt} started after the preemption and has not ended: "
            "still running, or killed before it could write a marker"
        )
    if run.state == schema.INCOMPLETE and any("not valid JSON" in n for n in run.notes):
        run.state, run.reason = schema.INVALID, "; ".join(run.notes)
    return run
