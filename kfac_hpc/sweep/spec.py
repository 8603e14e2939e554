"""The sweep definition and its expansion into points.

A sweep comes from flags and/or a TOML file with the same field names (flags win). The file
has top-level sweep fields, a ``[train]`` table (fixed training settings) and an ``[axes]``
table (lists of values to sweep). The train settings and axes are the job's options
(:mod:`kfac_hpc.contracts.options`): a new option of ``kfac-hpc train`` is a sweep setting, or
an axis, without editing this module. Validation happens once, here; everything downstream
trusts the resulting :class:`SweepSpec`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.grad_workers import check_grad_worker_fraction
from kfac_hpc.contracts.option_values import check_value, coerce_value, expand_aliases
from kfac_hpc.contracts.options import ALIASES, OPTIONS, Option, method_of, resolve_switches
from kfac_hpc.contracts.scripts import check_script
from kfac_hpc.contracts.workload_names import KINDS, absolute_name
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.safety import check_identifier, check_line, check_slurm_time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "AXES",
    "MAX_COUNT",
    "MAX_POINTS",
    "TRAIN_SETTINGS",
    "Point",
    "SweepSpec",
    "TrainSettings",
    "expand_points",
    "load_spec",
    "point_id",
]

# Upper bounds checked before anything is expanded: a count (nodes, ranks, repeats...) and the
# number of points of one sweep.
MAX_COUNT = 100_000
MAX_POINTS = 10_000
_ALIASED = {name for names, _ in ALIASES.values() for name in names}
# Options a sweep may vary (each given as a list), and the fixed settings of its [train] table
# (the aliases stand for the fields they set, as on the train command line).
AXES: dict[str, Option] = {o.name: o for o in OPTIONS.values() if o.sweep and o.axis}
TRAIN_SETTINGS: dict[str, Option | None] = {
    **{alias: None for alias in ALIASES},
    **{o.name: o for o in OPTIONS.values() if o.sweep and not o.axis and o.name not in _ALIASED},
}
# Axes of one method (K-FAC, FOSI): dropped from points of another method so they are not
# duplicated.
METHOD_AXES = {name: o.method for name, o in AXES.items() if o.method != "common"}
_TOP_FIELDS: dict[str, type] = {
    "name": str,
    "nodes": list,
    "ranks_per_node": int,
    "gpus_per_node": int,
    "cpus_per_task": int,
    "repeats": int,
    "max_concurrent": int,
    "serial": bool,
    "profile": str,
    "time": str,
    "signal_seconds": int,
    "sbatch_args": list,
    "allow_gpu_rank_mismatch": bool,
    "script": str,
    "script_args": list,
}


@dataclass(frozen=True)
class TrainSettings:
    """Training settings shared by every point (passed to ``kfac-hpc train`` as flags): only
    those given; the job's own defaults apply to the others. ``settings.steps`` reads one
    (None when not given)."""

    values: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name in TRAIN_SETTINGS:
            return self.values.get(name)
        raise AttributeError(name)


@dataclass(frozen=True)
class SweepSpec:
    """A validated sweep. ``axes`` maps an axis name to its values (in the given order)."""

    name: str
    nodes: tuple[int, ...]
    ranks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    repeats: int = 1
    train: TrainSettings = field(default_factory=TrainSettings)
    axes: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    max_concurrent: int | None = None
    serial: bool = False
    profile: str = "local"
    time: str | None = None
    signal_seconds: int | None = None
    sbatch_args: tuple[str, ...] = ()
    allow_gpu_rank_mismatch: bool = False
    # The user's own training script (absolute path) and its arguments: each point runs it
    # instead of ``kfac-hpc train`` (kfac_hpc.Run writes the run directory).
    script: str | None = None
    script_args: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["axes"] = {k: list(v) for k, v in self.axes.items()}
        return out


@dataclass(frozen=True)
class Point:
    """One training run of the sweep. ``params`` holds every parameter, ``nodes`` included."""

    point_id: str
    params: dict[str, Any]

    @property
    def nodes(self) -> int:
        return int(self.params["nodes"])


def point_id(params: Mapping[str, Any]) -> str:
    """A stable 12-hex-digit id: the hash of the canonical JSON of the parameters."""
    canonical = json.dumps(dict(params), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _coerce(fld: str, value: Any, kind: type) -> Any:
    """One scalar of the given type; strings from the command line are converted."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise SweepInputError(fld, f"{value!r} is not a boolean (use true/false)")
    if kind in (int, float):
        wanted = "an integer" if kind is int else "a number"
        if not isinstance(value, int | float | str) or isinstance(value, bool):
            raise SweepInputError(fld, f"{value!r} is not {wanted}")
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):
            raise SweepInputError(fld, f"{value!r} is not {wanted}") from None
        if kind is float and not math.isfinite(number):
            raise SweepInputError(fld, f"{value!r} is not a finite number")
        if kind is int and isinstance(value, float) and value != number:
            raise SweepInputError(fld, f"{value!r} is not an integer")
        return number
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise SweepInputError(fld, f"{value!r} is not a string")
    return check_line(fld, str(value))


def _as_list(fld: str, value: Any, kind: type) -> tuple[Any, ...]:
    """A non-empty list of values; ``"1,2,4"`` from the command line is split on commas."""
    if isinstance(value, str):
        items: list[Any] = [v.strip() for v in value.split(",")]
        if any(not v for v in items):
            raise SweepInputError(
                fld, f"{value!r} is malformed (expected a comma-separated list such as 1,2,4)"
            )
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    if not items:
        raise SweepInputError(fld, "is empty; give at least one value")
    out = tuple(_coerce(fld, v, kind) for v in items)
    if len(set(out)) != len(out):
        raise SweepInputError(fld, f"{list(out)} has duplicates")
    return out


def _positive(fld: str, value: int, minimum: int = 1) -> int:
    if not minimum <= value <= MAX_COUNT:
        raise SweepInputError(fld, f"{value} must be in [{minimum}, {MAX_COUNT}]")
    return value


def _read_file(path: Path) -> dict[str, Any]:
    """The TOML file flattened to ``{field: value}``, unknown keys rejected."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise SweepInputError("sweep_file", f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise SweepInputError(
            "sweep_file", f"{path} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise SweepInputError("sweep_file", f"{path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    train_keys = [*TRAIN_SETTINGS, "extra_args"]
    for key, value in data.items():
        if key == "train" and isinstance(value, dict):
            for sub, subval in value.items():
                if sub in AXES:  # an axis fixed to one value (model = "resnet32")
                    if isinstance(subval, list):
                        raise SweepInputError(
                            f"train.{sub}", "a list of values is an axis: put it in [axes]"
                        )
                    flat[sub] = [subval]
                elif sub in train_keys:
                    flat[sub] = subval
                else:
                    raise SweepInputError(
                        f"train.{sub}",
                        f"unknown train setting; valid: {', '.join(train_keys)} "
                        f"(or, fixed to one value, an axis: {', '.join(AXES)})",
                    )
        elif key == "axes" and isinstance(value, dict):
            for sub, subval in value.items():
                if sub not in AXES:
                    raise SweepInputError(f"axes.{sub}", f"unknown axis; valid: {', '.join(AXES)}")
                flat[sub] = subval
        elif key in ("train", "axes"):
            raise SweepInputError(key, f"must be a table ([{key}]), got {value!r}")
        elif key in _TOP_FIELDS:
            flat[key] = value
        else:
            raise SweepInputError(
                key, f"unknown sweep field; valid: {', '.join(_TOP_FIELDS)}, [train], [axes]"
            )
    return flat


def _option_value(option: Option, value: Any) -> Any:
    """One value of a train option, from TOML or the command line, validated by the table.
    Grad-worker fractions that are numbers become floats (``0.5``), names stay names."""
    try:
        if option.check == "grad_workers":
            return check_grad_worker_fraction(value)
        coerced = coerce_value(option, value, text=True)
        check_value(option, coerced)
    except (InputError, ValueError) as exc:
        raise SweepInputError(option.name, str(exc).removeprefix(f"{option.name}: ")) from None
    if isinstance(coerced, str):
        check_line(option.name, coerced)
    if option.name in KINDS:  # a file.py:callable is found from the job's folder too
        return absolute_name(coerced)
    return coerced


def _axis(name: str, value: Any) -> tuple[Any, ...]:
    """A non-empty list of an axis's values; ``"1,2,4"`` from the command line is split."""
    option = AXES[name]
    items = [_axis_text(name, v) for v in value] if isinstance(value, list | tuple) else value
    return tuple(_option_value(option, v) for v in _as_list(name, _axis_text(name, items), str))


def _axis_text(fld: str, value: Any) -> Any:
    """A TOML scalar of an axis as the text the command line would give (lists pass through)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | list):
        return value
    raise SweepInputError(fld, f"{value!r} is not a number, boolean or string")


def load_spec(sweep_file: Path | None, overrides: Mapping[str, Any]) -> SweepSpec:
    """Merge the file (if any) and the flags (``None`` = not given), validate, build the spec."""
    raw: dict[str, Any] = _read_file(sweep_file) if sweep_file is not None else {}
    for key, value in overrides.items():
        known = (*_TOP_FIELDS, *TRAIN_SETTINGS, *AXES, "extra_args")
        if key not in known:
            raise SweepInputError(key, "unknown sweep field")
        if value is not None and value != ():
            raw[key] = value
    if "nodes" not in raw:
        raise SweepInputError("nodes", "missing; give --nodes 1,2,4 or nodes = [1, 2, 4]")
    nodes = tuple(_positive("nodes", n) for n in _as_list("nodes", raw["nodes"], int))

    def scalar(name: str, kind: type, default: Any) -> Any:
        return _coerce(name, raw[name], kind) if raw.get(name) is not None else default

    repeats = scalar("repeats", int, 1)
    if not 1 <= repeats <= MAX_POINTS:
        raise SweepInputError("repeats", f"{repeats} must be in [1, {MAX_POINTS}]")
    script = _script(raw)
    train = _train_settings(raw, scalar)
    axes = {name: _axis(name, raw[name]) for name in AXES if name in raw}
    total = len(nodes) * repeats * math.prod(len(values) for values in axes.values())
    if total > MAX_POINTS:
        raise SweepInputError(
            "axes",
            f"nodes x axes x repeats make {total} points, more than {MAX_POINTS}; "
            "sweep fewer values or split the sweep",
        )
    max_concurrent = scalar("max_concurrent", int, None)
    signal_seconds = scalar("signal_seconds", int, None)
    time = scalar("time", str, None)
    return SweepSpec(
        name=check_identifier("name", scalar("name", str, "sweep")),
        nodes=nodes,
        ranks_per_node=_positive("ranks_per_node", scalar("ranks_per_node", int, 1)),
        gpus_per_node=_positive("gpus_per_node", scalar("gpus_per_node", int, 0), 0),
        cpus_per_task=_positive("cpus_per_task", scalar("cpus_per_task", int, 1)),
        repeats=repeats,
        train=train,
        axes=axes,
        max_concurrent=None
        if max_concurrent is None
        else _positive("max_concurrent", max_concurrent),
        serial=scalar("serial", bool, False),
        profile=check_line("profile", scalar("profile", str, "local")),
        time=None if time is None else check_slurm_time("time", time),
        signal_seconds=None
        if signal_seconds is None
        else _positive("signal_seconds", signal_seconds),
        sbatch_args=_string_list("sbatch_args", raw.get("sbatch_args", ())),
        allow_gpu_rank_mismatch=scalar("allow_gpu_rank_mismatch", bool, False),
        script=script,
        script_args=_string_list("script_args", raw.get("script_args", ())),
    )


def _script(raw: Mapping[str, Any]) -> str | None:
    """The script's absolute path (checked: a readable Python file), None without one; a
    script's points take no ``kfac-hpc train`` setting, axis or ``--train-arg``."""
    if raw.get("script_args") and raw.get("script") is None:
        raise SweepInputError(
            "--script", "missing: the arguments after -- go to a script; give --script PATH.py"
        )
    if raw.get("script") is None:
        return None
    for name in (*TRAIN_SETTINGS, *AXES, "extra_args"):
        if raw.get(name) not in (None, ()):
            flag = "--train-arg" if name == "extra_args" else "--" + name.replace("_", "-")
            raise SweepInputError(
                flag,
                "a kfac-hpc train setting, but --script runs your own script: give it the "
                "script's arguments after -- (kfac-hpc sweep --script train.py ... -- --lr 0.1)",
            )
    if not isinstance(raw["script"], str):
        raise SweepInputError("--script", f"{raw['script']!r} is not a path")
    return str(check_script(check_line("--script", raw["script"]), error=SweepInputError))


def _string_list(fld: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise SweepInputError(fld, f"expected a list of strings, got {value!r}")
    return tuple(check_line(fld, v) for v in value)


def _train_settings(raw: Mapping[str, Any], scalar: Any) -> TrainSettings:
    if raw.get("steps") is not None and raw.get("epochs") is not None:
        raise SweepInputError("steps", "give either steps or epochs, not both")
    values: dict[str, Any] = {}
    for name, option in TRAIN_SETTINGS.items():
        value = raw.get(name)
        if value is None:
            continue
        if option is None:  # an alias: checked as the job reads it, passed on as written
            values[name] = _alias_value(name, value)
        else:
            values[name] = _option_value(option, value)
    return TrainSettings(values, _string_list("extra_args", raw.get("extra_args", ())))


def _alias_value(name: str, value: Any) -> Any:
    """A duration (``30m``, seconds) or, for ``checkpoint_every``, a step count: a string or a
    finite number, checked as the job reads it and passed on as written."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (isinstance(value, str) or (number and math.isfinite(value))):
        raise SweepInputError(name, f"{value!r} is not a duration; write e.g. 90s, 30m or 01:30:00")
    try:
        fields = expand_aliases({name: value})
        for key, expanded in fields.items():
            check_value(OPTIONS[key], expanded)
    except InputError as exc:
        raise SweepInputError(name, exc.reason) from None
    return check_line(name, value) if isinstance(value, str) else value


def expand_points(spec: SweepSpec) -> list[Point]:
    """Every combination of nodes × axes × repeats, in a stable order. A combination that turns
    two methods on (``kfac`` and ``fosi`` both true) is no point; a method's own axes are
    dropped from points of another method (so they are not run several times)."""
    names = list(spec.axes)
    points: dict[str, Point] = {}
    for nodes in spec.nodes:
        for combo in itertools.product(*(spec.axes[n] for n in names)):
            values = dict(zip(names, combo, strict=True))
            given = resolve_switches({**spec.train.values, **values})
            try:
                method = method_of(given)
            except InputError:
                continue
            for name, owner in METHOD_AXES.items():
                if owner != method:
                    values.pop(name, None)
            for repeat in range(spec.repeats):
                params: dict[str, Any] = {
                    "nodes": nodes,
                    "ranks_per_node": spec.ranks_per_node,
                    "gpus_per_node": spec.gpus_per_node,
                    "cpus_per_task": spec.cpus_per_task,
                    **_train_params(spec.train),
                    **values,
                    "repeat": repeat,
                }
                pid = point_id(params)
                points.setdefault(pid, Point(pid, params))
    return list(points.values())


def _train_params(train: TrainSettings) -> dict[str, Any]:
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in train.values.items()}
    if train.extra_args:
        out["extra_args"] = list(train.extra_args)
    return out
