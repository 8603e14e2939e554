"""The sweep definition and its expansion into points.

A sweep comes from flags and/or a TOML file with the same field names (flags win). The file
has top-level sweep fields, a ``[train]`` table (fixed training settings) and an ``[axes]``
table (lists of values to sweep). Validation happens once, here; everything downstream trusts
the resulting :class:`SweepSpec`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.safety import check_identifier, check_line, check_slurm_time

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["AXES", "Point", "SweepSpec", "TrainSettings", "expand_points", "load_spec", "point_id"]

# Axes a sweep may vary, with the value type of each.
AXES: dict[str, type] = {
    "optimizer": str,
    "kfac": bool,
    "grad_worker_fraction": float,
    "factor_update_steps": int,
    "inv_update_steps": int,
    "batch_size": int,
    "seed": int,
}
# Axes that mean nothing without K-FAC: dropped from non-K-FAC points so they are not duplicated.
KFAC_ONLY_AXES = ("grad_worker_fraction", "factor_update_steps", "inv_update_steps")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCALINGS = ("strong", "weak")
_TRAIN_FIELDS: dict[str, type] = {
    "model": str,
    "dataset": str,
    "steps": int,
    "epochs": int,
    "scaling": str,
    "lr": float,
    "target_accuracy": float,
    "checkpoint_every": int,
    "extra_args": list,
}
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
}


@dataclass(frozen=True)
class TrainSettings:
    """Training settings shared by every point (passed to ``kfac-hpc train`` as flags)."""

    model: str = "mlp"
    dataset: str = "digits"
    steps: int | None = None
    epochs: int | None = None
    scaling: str = "strong"
    lr: float | None = None
    target_accuracy: float | None = None
    checkpoint_every: int | None = None
    extra_args: tuple[str, ...] = ()


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
        if isinstance(value, bool):
            raise SweepInputError(fld, f"{value!r} is not a number")
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise SweepInputError(
                fld, f"{value!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if kind is int and isinstance(value, float) and value != number:
            raise SweepInputError(fld, f"{value!r} is not an integer")
        return number
    return check_line(fld, value if isinstance(value, str) else str(value))


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
    if value < minimum:
        raise SweepInputError(fld, f"{value} must be >= {minimum}")
    return value


def _read_file(path: Path) -> dict[str, Any]:
    """The TOML file flattened to ``{field: value}``, unknown keys rejected."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SweepInputError("sweep_file", f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SweepInputError("sweep_file", f"{path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key == "train" and isinstance(value, dict):
            for sub, subval in value.items():
                if sub not in _TRAIN_FIELDS:
                    raise SweepInputError(
                        f"train.{sub}", f"unknown train setting; valid: {', '.join(_TRAIN_FIELDS)}"
                    )
                flat[sub] = subval
        elif key == "axes" and isinstance(value, dict):
            for sub, subval in value.items():
                if sub not in AXES:
                    raise SweepInputError(f"axes.{sub}", f"unknown axis; valid: {', '.join(AXES)}")
                flat[sub] = subval
        elif key in _TOP_FIELDS:
            flat[key] = value
        else:
            raise SweepInputError(
                key, f"unknown sweep field; valid: {', '.join(_TOP_FIELDS)}, [train], [axes]"
            )
    return flat


def load_spec(sweep_file: Path | None, overrides: Mapping[str, Any]) -> SweepSpec:
    """Merge the file (if any) and the flags (``None`` = not given), validate, build the spec."""
    raw: dict[str, Any] = _read_file(sweep_file) if sweep_file is not None else {}
    for key, value in overrides.items():
        if key not in _TOP_FIELDS and key not in _TRAIN_FIELDS and key not in AXES:
            raise SweepInputError(key, "unknown sweep field")
        if value is not None and value != ():
            raw[key] = value
    if "nodes" not in raw:
        raise SweepInputError("nodes", "missing; give --nodes 1,2,4 or nodes = [1, 2, 4]")
    nodes = tuple(_positive("nodes", n) for n in _as_list("nodes", raw["nodes"], int))

    def scalar(name: str, kind: type, default: Any) -> Any:
        return _coerce(name, raw[name], kind) if raw.get(name) is not None else default

    train = _train_settings(raw, scalar)
    axes = {name: _as_list(name, raw[name], kind) for name, kind in AXES.items() if name in raw}
    for opt in axes.get("optimizer", ()):
        if opt not in OPTIMIZERS:
            raise SweepInputError("optimizer", f"{opt!r} is not one of {', '.join(OPTIMIZERS)}")
    for name in ("factor_update_steps", "inv_update_steps", "batch_size"):
        for v in axes.get(name, ()):
            _positive(name, v)
    for v in axes.get("grad_worker_fraction", ()):
        if not 0.0 < v <= 1.0:
            raise SweepInputError("grad_worker_fraction", f"{v} must be in (0, 1]")
    max_concurrent = scalar("max_concurrent", int, None)
    signal_seconds = scalar("signal_seconds", int, None)
    time = scalar("time", str, None)
    return SweepSpec(
        name=check_identifier("name", scalar("name", str, "sweep")),
        nodes=nodes,
        ranks_per_node=_positive("ranks_per_node", scalar("ranks_per_node", int, 1)),
        gpus_per_node=_positive("gpus_per_node", scalar("gpus_per_node", int, 0), 0),
        cpus_per_task=_positive("cpus_per_task", scalar("cpus_per_task", int, 1)),
        repeats=_positive("repeats", scalar("repeats", int, 1)),
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
    )


def _string_list(fld: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise SweepInputError(fld, f"expected a list of strings, got {value!r}")
    return tuple(check_line(fld, v) for v in value)


def _train_settings(raw: Mapping[str, Any], scalar: Any) -> TrainSettings:
    steps, epochs = scalar("steps", int, None), scalar("epochs", int, None)
    if steps is not None and epochs is not None:
        raise SweepInputError("steps", "give either steps or epochs, not both")
    scaling = scalar("scaling", str, "strong")
    if scaling not in SCALINGS:
        raise SweepInputError("scaling", f"{scaling!r} is not one of {', '.join(SCALINGS)}")
    checkpoint_every = scalar("checkpoint_every", int, None)
    return TrainSettings(
        model=check_identifier("model", scalar("model", str, "mlp")),
        dataset=check_identifier("dataset", scalar("dataset", str, "digits")),
        steps=None if steps is None else _positive("steps", steps),
        epochs=None if epochs is None else _positive("epochs", epochs),
        scaling=scaling,
        lr=scalar("lr", float, None),
        target_accuracy=scalar("target_accuracy", float, None),
        checkpoint_every=None
        if checkpoint_every is None
        else _positive("checkpoint_every", checkpoint_every),
        extra_args=_string_list("extra_args", raw.get("extra_args", ())),
    )


def expand_points(spec: SweepSpec) -> list[Point]:
    """Every combination of nodes × axes × repeats, in a stable order, K-FAC-only axes dropped
    from points without K-FAC (so they are not run several times)."""
    names = list(spec.axes)
    points: dict[str, Point] = {}
    for nodes in spec.nodes:
        for combo in itertools.product(*(spec.axes[n] for n in names)):
            values = dict(zip(names, combo, strict=True))
            if values.get("kfac") is False:
                for name in KFAC_ONLY_AXES:
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
    out = {k: v for k, v in asdict(train).items() if v is not None and k != "extra_args"}
    if train.extra_args:
        out["extra_args"] = list(train.extra_args)
    return out
