"""Per-run aggregates of the ``kind: train`` records, folded as each metrics.jsonl is read.

A 20-epoch run logs hundreds of windows; a sweep, hundreds of thousands. Keeping each window
as an object costs about a kilobyte, so the reader folds a run's windows into a
:class:`WindowStats` once its file is parsed: sums and per-rank means for the tables, the
p50/p90 of each phase, and three flat float arrays (step time, wall time, loss: 8 bytes a
window each) for the plots and step-time percentiles.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter, mul, sub
from typing import Any

from kfac_hpc.analysis.stats import percentiles

JSON = dict[str, Any]
# The largest integer the tables hold (Parquet int64); a larger one in a record is a bad value.
INT64_MAX = 2**63 - 1


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools, strings, NaN and infinities are not)."""
    kind = type(value)  # exact types: bool is not a number here, and this is the hot path
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is int:
        return float(value) if -INT64_MAX <= value <= INT64_MAX else None
    return None


def wrong_type(value: Any, allowed: tuple[type, ...]) -> bool:
    """Whether ``value`` (parsed JSON: exact types) is none of the types ``allowed`` (a bool
    is no number)."""
    return type(value) not in allowed


def wrong_typed(
    records: list[JSON], types: Mapping[str, tuple[type, ...]], skip: frozenset[str] = frozenset()
) -> int:
    """How many of ``records`` hold a value of a field of ``types`` (but ``skip``) that is of
    none of its types (null and absent values aside): each column's set of types at C speed,
    record by record only in a column that holds a wrong one."""
    if not records:
        return 0
    names = [name for name in types if name not in skip]
    bad: set[int] = set()
    for name, column in zip(names, _columns(records, names), strict=True):
        allowed = {*types[name], type(None)}
        if set(map(type, column)) <= allowed:
            continue
        bad.update(i for i, value in enumerate(column) if type(value) not in allowed)
    return len(bad)


def float_list(value: Any) -> list[float]:
    """A list of finite floats, or [] when ``value`` is not one (checked at C speed: per-rank
    lists hold world-size x phases numbers per record)."""
    if not isinstance(value, list):
        return []
    try:
        out = list(map(float, value))
    except (TypeError, ValueError):
        return []
    return out if all(map(math.isfinite, out)) else []


class _RankMeans:
    """Step-weighted per-rank sums, kept apart per list length (a window from another world
    size must not mix in); the length seen in most windows wins, the first seen on a tie."""

    __slots__ = ("by_length",)

    def __init__(self) -> None:
        self.by_length: dict[int, list[Any]] = {}  # length -> [windows, steps, sums]

    def add(self, values: list[float], steps: int) -> None:
        if not values:
            return
        slot = self.by_length.get(len(values))
        if slot is None:
            self.by_length[len(values)] = [1, steps, [v * steps for v in values]]
            return
        slot[0] += 1
        slot[1] += steps
        sums = slot[2]
        for r, v in enumerate(values):
            sums[r] += v * steps

    def means(self) -> list[float]:
        if not self.by_length:
            return []
        windows = max(slot[0] for slot in self.by_length.values())
        _, steps, sums = next(s for s in self.by_length.values() if s[0] == windows)
        return [s / steps for s in sums]


@dataclass
class WindowStats:
    """What the tables and plots need of a run's train windows (``window_steps`` steps each).

    ``step_s``, ``wall_s`` and ``loss`` hold one value per window in file order (loss NaN
    where absent). Phase and rank figures are step-weighted over the windows.
    """

    windows: int = 0
    steps: int = 0  # sum of window_steps
    last_step: int | None = None
    last_loss: float | None = None
    step_s: array[float] = field(default_factory=lambda: array("d"))
    wall_s: array[float] = field(default_factory=lambda: array("d"))
    loss: array[float] = field(default_factory=lambda: array("d"))
    step_weighted_s: float = 0.0  # sum of step_s * window_steps: the compute time
    samples_weighted: float = 0.0  # sum of samples_per_s * seconds, over timed windows
    samples_seconds: float = 0.0
    timed_windows: int = 0
    compute_by_attempt: dict[int, float] = field(default_factory=dict)
    phase_sums: dict[str, float] = field(default_factory=dict)  # sum of phase_s * window_steps
    phase_p50_s: dict[str, float] = field(default_factory=dict)
    phase_p90_s: dict[str, float] = field(default_factory=dict)
    rank_step_s: list[float] = field(default_factory=list)  # per-rank step-weighted means
    rank_phases_s: dict[str, list[float]] = field(default_factory=dict)
    with_rank_phases: bool = False
    out_of_range: int = 0  # window_steps or attempt values beyond int64, read as missing
    # attempt -> [first step, last step, last wall_s], from windows and evals alike
    spans: dict[int, list[float]] = field(default_factory=dict)

    def phase_means(self) -> dict[str, float]:
        """Per-step seconds of each phase; a window without the phase counts as 0."""
        if self.steps <= 0:
            return {}
        return {p: s / self.steps for p, s in self.phase_sums.items()}

    def step_mean_s(self) -> float | None:
        return self.step_weighted_s / self.steps if self.windows and self.steps > 0 else None

    def samples_per_s(self) -> float | None:
        """Global throughput weighted by each timed window's seconds."""
        if not self.timed_windows or self.samples_seconds <= 0:
            return None
        return self.samples_weighted / self.samples_seconds


def _numbers(column: list[Any]) -> list[float] | None:
    """``column`` as floats when every value is a finite int or float (checked at C speed),
    else None."""
    kinds = set(map(type, column))
    if not kinds <= {float, int}:
        return None
    if int in kinds:  # an int beyond int64 is a bad value (as for number): value by value
        ints = column if len(kinds) == 1 else [v for v in column if type(v) is int]
        if ints and not -INT64_MAX <= min(ints) <= max(ints) <= INT64_MAX:
            return None
    if not all(map(math.isfinite, column)):
        return None
    return column if kinds == {float} else list(map(float, column))


def _ints_at_least(column: list[Any], floor: int) -> tuple[list[int], int]:
    """``column`` as ints >= ``floor`` (a missing, bad or out-of-range value becomes ``floor``),
    and how many of its numbers were beyond int64."""
    if set(map(type, column)) == {int} and floor <= min(column) <= max(column) <= INT64_MAX:
        return column, 0
    beyond = sum(type(v) in (int, float) and not abs(v) <= INT64_MAX for v in column)
    return [_int_at_least(number(v), floor) for v in column], beyond


def _int_at_least(value: float | None, floor: int) -> int:
    """``value`` as an int >= ``floor``; ``floor`` when it is missing or beyond int64."""
    return floor if value is None or not floor <= value <= INT64_MAX else int(value)


def _valid(records: list[JSON]) -> list[JSON]:
    """The records with a number for each of step, wall_s and step_s."""
    return [
        r
        for r in records
        if number(r.get("step")) is not None
        and number(r.get("wall_s")) is not None
        and number(r.get("step_s")) is not None
    ]


# The fields of a train record that every run's figures are folded from.
_FIELDS = (
    "step",
    "wall_s",
    "step_s",
    "window_steps",
    "attempt",
    "loss",
    "samples_per_s",
    "phases_s",
)


def _columns(dicts: list[JSON], names: Sequence[str]) -> list[list[Any]]:
    """The value of each of ``names`` in every dict (None where absent), one list per name:
    at C speed (itemgetter, then a transpose) when every dict holds every name."""
    if not dicts:
        return [[] for _ in names]
    if len(names) > 1:
        try:
            return [list(c) for c in zip(*map(itemgetter(*names), dicts), strict=True)]
        except KeyError:  # some window lacks a phase
            pass
    return [[d.get(name) for d in dicts] for name in names]


class WindowAccumulator:
    """Collects ``kind: train`` records and eval spans; :meth:`finish` folds them, column by
    column at C speed where the records are clean, into a :class:`WindowStats`."""

    def __init__(self) -> None:
        self.stats = WindowStats()
        self._records: list[JSON] = []
        self.kept: list[JSON] = []  # after finish: the records folded into the stats

    def span(self, attempt: int, start: int, end: int, wall: float) -> None:
        """Widen ``attempt``'s step range and last wall time (windows and evals both count)."""
        seen = self.stats.spans.get(attempt)
        if seen is None:
            self.stats.spans[attempt] = [start, end, wall]
            return
        seen[0] = min(seen[0], start)
        seen[1] = max(seen[1], end)
        seen[2] = max(seen[2], wall)

    def add(self, obj: JSON) -> None:
        """Keep one ``kind: train`` record for :meth:`finish`."""
        self._records.append(obj)

    def finish(self) -> tuple[WindowStats, int]:
        """The stats, and how many records were skipped for lacking step, wall_s or step_s."""
        records = self._records
        column = dict(zip(_FIELDS, _columns(records, _FIELDS), strict=True))
        numeric = [_numbers(column[k]) for k in ("step", "wall_s", "step_s")]
        if any(c is None for c in numeric):
            records = _valid(records)
            column = dict(zip(_FIELDS, _columns(records, _FIELDS), strict=True))
            numeric = [_numbers(column[k]) for k in ("step", "wall_s", "step_s")]
        self.kept = records
        steps_col, wall, step_s = (c or [] for c in numeric)
        step = list(map(int, steps_col))
        window, beyond_w = _ints_at_least(column["window_steps"], 1)
        attempts, beyond_a = _ints_at_least(column["attempt"], 0)
        seconds = list(map(mul, step_s, window))
        s = self.stats
        s.out_of_range = beyond_w + beyond_a
        s.windows, s.steps = len(records), sum(window)
        s.last_step = max(step, default=None)
        s.step_s, s.wall_s = array("d", step_s), array("d", wall)
        raw_losses = column["loss"]
        losses = _numbers(raw_losses)
        if losses is None:  # some window without a loss: NaN there
            losses = [math.nan if v is None else v for v in map(number, raw_losses)]
        s.loss = array("d", losses)
        s.last_loss = losses[-1] if losses and losses[-1] == losses[-1] else None
        s.step_weighted_s = sum(seconds)
        if len(set(attempts)) == 1:  # one attempt: its figures at C speed
            s.compute_by_attempt[attempts[0]] = s.step_weighted_s
            self.span(attempts[0], min(map(sub, step, window)), max(step), max(wall))
        else:
            for a, sec, end, w, t in zip(attempts, seconds, step, window, wall, strict=True):
                s.compute_by_attempt[a] = s.compute_by_attempt.get(a, 0.0) + sec
                self.span(a, end - w, end, t)  # a window starts window_steps before its step
        samples = _numbers(column["samples_per_s"])
        if samples is not None:
            s.timed_windows = len(samples)
            s.samples_weighted = sum(map(mul, samples, seconds))
            s.samples_seconds = s.step_weighted_s
        else:
            for r, sec in zip(records, seconds, strict=True):
                value = number(r.get("samples_per_s"))
                if value is not None:
                    s.timed_windows += 1
                    s.samples_weighted += value * sec
                    s.samples_seconds += sec
        self._fold_phases(column["phases_s"], window)
        self._fold_ranks(records, window)
        return s, len(self._records) - len(records)

    def _fold_phases(self, maps: list[Any], window: list[int]) -> None:
        """Step-weighted sums, p50 and p90 of each phase (a window without it adds 0)."""
        pairs = [(m, w) for m, w in zip(maps, window, strict=True) if type(m) is dict]
        if not pairs:
            return
        dicts, weights = [m for m, _ in pairs], [w for _, w in pairs]
        s = self.stats
        names = list(dict.fromkeys(chain.from_iterable(dicts)))
        for name, raw in zip(names, _columns(dicts, names), strict=True):
            values = _numbers(raw)
            if values is not None:
                total = sum(map(mul, values, weights))
            else:  # absent or bad in some windows: those are skipped
                kept = [(number(v), w) for v, w in zip(raw, weights, strict=True)]
                values = [v for v, _ in kept if v is not None]
                total = sum(v * w for v, w in kept if v is not None)
            if values:
                s.phase_sums[name] = total
                p50, p90 = percentiles(values, (50, 90))
                s.phase_p50_s[name] = p50 or 0.0
                s.phase_p90_s[name] = p90 or 0.0

    def _fold_ranks(self, records: list[JSON], window: list[int]) -> None:
        """Per-rank means of the records' arrays (absent when the reader cut them)."""
        rank_step = _RankMeans()
        rank_phases: dict[str, _RankMeans] = {}
        kinds = set(map(type, [r.get("rank_step_s") for r in records]))
        kinds |= set(map(type, [r.get("rank_phases_s") for r in records]))
        if not kinds & {list, dict}:  # none present, or cut by the reader
            return
        for r, steps in zip(records, window, strict=True):
            rank_step.add(float_list(r.get("rank_step_s")), steps)
            phases = r.get("rank_phases_s")
            if isinstance(phases, dict) and phases:
                self.stats.with_rank_phases = True
                for name, values in phases.items():
                    rank_phases.setdefault(name, _RankMeans()).add(float_list(values), steps)
        self.stats.rank_step_s = rank_step.means()
        self.stats.rank_phases_s = {
            name: means for name, acc in rank_phases.items() if (means := acc.means())
        }
