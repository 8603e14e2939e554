"""Reading one run directory (docs/contracts.md) tolerantly: every problem becomes a note.

A run directory may be complete, still running, preempted, failed, truncated or corrupt; the
reader never raises for what it finds on disk. It returns a :class:`RunData` whose ``state`` and
``reason`` say what happened and whose ``notes`` list every file problem it worked around.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.run_state import row_state
from kfac_hpc.contracts.records import EVAL, TRAIN
from kfac_hpc.contracts.rundir import CONFIG, METRICS, RUN, Marker, read_markers
from kfac_hpc.contracts.states import ENDED_BADLY, PointState

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Window:
    """One ``kind: train`` record: per-step means over ``window_steps`` steps, rank-averaged."""

    attempt: int
    step: int
    wall_s: float
    window_steps: int
    step_s: float
    loss: float | None
    samples_per_s: float | None
    phases_s: dict[str, float]
    rank_step_s: list[float]
    rank_phases_s: dict[str, list[float]]


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
    windows: list[Window] = field(default_factory=list)
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


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, strings, NaN and infinities are not)."""
    kind = type(value)  # exact types: bool is not a number here, and this is the hot path
    if kind is float:
        return value if math.isfinite(value) else None
    return float(value) if kind is int else None


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


def float_list(value: Any) -> list[float]:
    """A list of finite floats, or [] when ``value`` is not one (checked at C speed: per-rank
    lists hold world-size x phases numbers per record, the bulk of a large metrics.jsonl)."""
    if not isinstance(value, list):
        return []
    try:
        out = list(map(float, value))
    except (TypeError, ValueError):
        return []
    return out if all(map(math.isfinite, out)) else []


def _phase_map(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    out = {k: v for k, v in value.items() if type(v) is float and math.isfinite(v)}
    if len(out) < len(value):  # integers are numbers too; anything else is dropped
        out.update((k, float(v)) for k, v in value.items() if type(v) is int)
    return out


def _window(obj: JSON) -> Window | None:
    step, wall, step_s = (
        number(obj.get("step")),
        number(obj.get("wall_s")),
        number(obj.get("step_s")),
    )
    if step is None or wall is None or step_s is None:
        return None
    rank_phases = obj.get("rank_phases_s")
    return Window(
        attempt=int(number(obj.get("attempt")) or 0),
        step=int(step),
        wall_s=wall,
        window_steps=max(1, int(number(obj.get("window_steps")) or 1)),
        step_s=step_s,
        loss=number(obj.get("loss")),
        samples_per_s=number(obj.get("samples_per_s")),
        phases_s=_phase_map(obj.get("phases_s")),
        rank_step_s=float_list(obj.get("rank_step_s")),
        rank_phases_s=(
            {k: float_list(v) for k, v in rank_phases.items()}
            if isinstance(rank_phases, dict)
            else {}
        ),
    )


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


# Per-rank arrays of a train record; skipped when run.json already summarises them per rank.
_RANK_KEYS = ('"rank_phases_s"', '"rank_step_s"')


def _without_rank_arrays(line: str) -> str:
    """``line`` with its per-rank arrays cut out textually (str.find runs at memchr speed;
    parsing them would dominate the collector's time on large sweeps).

    Only the plain shape is cut: ``, "rank_step_s": [numbers]`` and
    ``, "rank_phases_s": {"name": [numbers], ...}``; anything else is left for the parser.
    """
    for key in _RANK_KEYS:
        start = line.find(key)
        if start < 0:
            continue
        comma = line.rfind(",", 0, start)
        if comma < 0 or line[comma + 1 : start].strip():
            continue
        value = line.find("[" if key == '"rank_step_s"' else "{", start)
        end = line.find("]" if key == '"rank_step_s"' else "}", value)
        if (
            value < 0
            or end < 0
            or line[start + len(key) : value].strip() != ":"  # the value opens right here
            or line.find("{", value + 1, end) >= 0
        ):
            continue
        line = line[:comma] + line[end + 1 :]
    return line


def read_metrics(path: Path, run: RunData, *, rank_arrays: bool = True) -> None:
    """Fill ``run.windows`` and ``run.evals`` from metrics.jsonl; bad lines become notes.

    A last line without its newline is a record being written (or cut by a crash): skipped
    with a note. Any other bad line is skipped and counted. ``rank_arrays=False`` skips the
    per-rank arrays of train records (the windows then have none).
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as exc:
        run.notes.append(f"metrics.jsonl: unreadable ({exc})")
        return
    # Undecodable bytes become U+FFFD: their record then fails to parse and is counted.
    lines = raw.decode("utf-8", errors="replace").split("\n")
    truncated = bad = 0
    for index, line in enumerate(lines):
        if not line or line.isspace():
            continue
        try:
            obj = json.loads(line if rank_arrays else _without_rank_arrays(line))
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or obj.get("schema", schema.RUN_SCHEMA) != schema.RUN_SCHEMA:
            # The unterminated last line is a record being written, or cut by a crash.
            if index == len(lines) - 1:
                truncated = 1
            else:
                bad += 1
            continue
        kind = obj.get("kind")
        if kind == TRAIN:
            window = _window(obj)
            bad += window is None
            if window is not None:
                run.windows.append(window)
        elif kind == EVAL:
            point = _eval(obj)
            bad += point is None
            if point is not None:
                run.evals.append(point)
        # other kinds (events, config echoes) are the job's business
    if truncated:
        run.notes.append("metrics.jsonl: last line truncated (skipped)")
    if bad:
        run.notes.append(f"metrics.jsonl: {bad} malformed record(s) skipped")


def _segments_from_summary(run: RunData) -> list[Segment]:
    attempts = run.summary.get("attempts")
    if not isinstance(attempts, list):
        return []
    compute = _compute_by_attempt(run.windows)
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


def _compute_by_attempt(windows: list[Window]) -> dict[int, float]:
    out: dict[int, float] = {}
    for w in windows:
        out[w.attempt] = out.get(w.attempt, 0.0) + w.step_s * w.window_steps
    return out


def _segments_from_records(run: RunData, last_end: str) -> list[Segment]:
    """Segments rebuilt from the records' ``attempt`` field when run.json has none.

    ``wall_s`` of a record counts running time since the first start, so an attempt's wall
    time is its last ``wall_s`` minus the previous attempt's last ``wall_s`` (a lower bound:
    time after the attempt's last record is not visible).
    """
    by_attempt: dict[int, list[tuple[int, int, float]]] = {}
    for w in run.windows:
        by_attempt.setdefault(w.attempt, []).append((w.step - w.window_steps, w.step, w.wall_s))
    for e in run.evals:
        by_attempt.setdefault(e.attempt, []).append((e.step, e.step, e.wall_s))
    compute = _compute_by_attempt(run.windows)
    out, previous_wall = [], 0.0
    attempts = sorted(by_attempt)
    for attempt in attempts:
        items = by_attempt[attempt]
        last_wall = max(i[2] for i in items)
        out.append(
            Segment(
                attempt=attempt,
                start_step=max(0, min(i[0] for i in items)),
                end_step=max(i[1] for i in items),
                wall_s=last_wall - previous_wall,
                compute_s=compute.get(attempt),
                end=last_end if attempt == attempts[-1] else "requeued",
            )
        )
        previous_wall = last_wall
    return out


def read_run_dir(path: Path, point: JSON | None = None) -> RunData:
    """Read ``path`` (and its manifest ``point``, if any) into a :class:`RunData`; never raises."""
    point = point or {}
    params = point.get("params") if isinstance(point.get("params"), dict) else {}
    point_id = point.get("point_id")
    run = RunData(
        path=path,
        run_id=str(point_id or path.name),
        state=schema.INCOMPLETE,
        point_id=None if point_id is None else str(point_id),
        params=dict(params or {}),
        manifest=point,
    )
    if not path.is_dir():
        job_state = str(point.get("state") or "")
        if job_state in (PointState.PENDING, PointState.SUBMITTED, ""):
            run.reason = f"not started (job {job_state or 'unknown'})"
        elif job_state in ENDED_BADLY:
            run.state, run.reason = schema.FAILED, f"job {job_state} before creating its run dir"
        else:
            run.state, run.reason = schema.MISSING, f"run directory {path} does not exist"
        return run
    for name, target in ((CONFIG, "config"), (RUN, "summary")):
        try:
            setattr(run, target, _read_json(path / name) or {})
        except FileProblem as exc:
            run.notes.append(str(exc))
    markers = read_markers(path)
    # A finished run's summary holds the per-rank figures; the records' arrays are not needed.
    finished = markers.done is not None and run.summary.get("state") == str(Marker.DONE)
    per_rank = all(key in run.summary for key in ("rank_phases_s", "samples_per_s_per_rank"))
    read_metrics(path / METRICS, run, rank_arrays=not (finished and per_rank))
    run.state, run.reason = row_state(markers, run.summary, run.manifest)
    if run.state == schema.DONE and not run.config:
        run.notes.append("config.json missing: parameters taken from run.json")
    for key in ("nodes", "ranks_per_node", "world_size"):
        asked, seen = run.params.get(key), run.summary.get(key)
        if asked is not None and seen is not None and asked != seen:
            # e.g. a local sweep emulating nodes with ranks on one host
            run.notes.append(f"{key}: the sweep asked for {asked}, the job saw {seen}")
    if isinstance(run.summary.get("run_id"), str) and not point_id:
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
