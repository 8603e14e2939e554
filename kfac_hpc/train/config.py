"""The resolved configuration of one training run: a dataclass, validated once at the edge.

Its fields, types, defaults, help and ranges are the option table of
:mod:`kfac_hpc.contracts.options` (one place for the job, the sweep and the docs). Values come
from a TOML file (flat keys, the field names) overridden by command-line flags. Torch is not
imported here.

``--scaling strong`` keeps the global batch fixed (``batch_size`` is the global batch, split
over ranks); ``weak`` keeps the per-rank batch fixed (``batch_size`` is per rank).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kfac_hpc.contracts.durations import parse_duration_s
from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.grad_workers import check_grad_worker_fraction, parse_grad_worker_fraction
from kfac_hpc.contracts.option_values import check_value, coerce_value, expand_aliases
from kfac_hpc.contracts.options import (
    LIBRARY_PARAMETERS,
    OPTIONS,
    TEXT_DATASETS,
    TEXT_MODELS,
    method_of,
    resolve_switches,
)
from kfac_hpc.contracts.targets import Target
from kfac_hpc.contracts.textfile import read_user_text
from kfac_hpc.contracts.workload_names import (
    BUILTIN_DATASETS,
    BUILTIN_MODELS,
    KINDS,
    absolute_name,
    parse_reference,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "OPERATIONAL_FIELDS",
    "BatchSizes",
    "ConfigError",
    "TrainConfig",
    "check_run_dir",
    "field_help",
    "load_config",
    "parse_duration_s",
]

# Fields that change how a run is operated, not what it computes: left out of the config hash
# so a resumed or time-limited run keeps the hash of its experiment.
OPERATIONAL_FIELDS = frozenset(o.name for o in OPTIONS.values() if o.operational)


class ConfigError(InputError):
    """Bad input of the job; ``str()`` is one line naming the field and the fix."""


_PY_TYPES = {"bool": "bool", "int": "int", "float": "float", "str": "str"}
_PY_TYPES.update(strs="tuple[str, ...]", ints="tuple[int, ...]")


def _with_option_fields(cls: type) -> type:
    """Make ``cls`` a frozen dataclass whose fields are the option table, in its order."""
    annotations = dict(inspect.get_annotations(cls))
    for option in OPTIONS.values():
        kind = _PY_TYPES[option.kind]
        annotations[option.name] = f"{kind} | None" if option.optional else kind
        setattr(cls, option.name, dataclasses.field(default=option.default))
    cls.__annotations__ = annotations
    return dataclass(frozen=True)(cls)


@_with_option_fields
class TrainConfig:
    """Every setting of a training run (one field per option of the table);
    ``validate()`` is called by :func:`load_config`."""

    if TYPE_CHECKING:  # the fields come from the option table at run time

        def __init__(self, **values: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

    def validate(self) -> None:
        """Raise :class:`ConfigError` on the first bad field."""
        for option in OPTIONS.values():
            try:
                check_value(option, getattr(self, option.name))
            except InputError as exc:
                raise ConfigError(exc.field, exc.reason) from None
        for kind in KINDS:
            try:
                parse_reference(kind, getattr(self, kind))
            except InputError as exc:
                raise ConfigError(exc.field, exc.reason) from None
            self.factory_args(kind)
        self._validate_workload()
        try:
            method_of(self.to_dict())
        except InputError as exc:
            raise ConfigError(exc.field, exc.reason) from None
        if self.fosi:
            self._validate_fosi()
        if self.target_accuracy is not None and self.target_loss is not None:
            raise ConfigError("target_loss", "give one target: --target-accuracy or --target-loss")
        if self.stop_at_target and self.target is None:
            raise ConfigError("stop_at_target", "needs --target-accuracy or --target-loss")
        if self.dataset in ("cifar10", "imagefolder", "text") and not self.data_path:
            what = "a file or DIR" if self.dataset == "text" else "DIR"
            raise ConfigError("data_path", f"dataset {self.dataset!r} needs --data-path {what}")
        text_file = self.dataset == "text" and self.data_path and Path(self.data_path).is_file()
        if self.data_path and not text_file and not Path(self.data_path).is_dir():
            what = "a file or directory" if self.dataset == "text" else "a directory"
            raise ConfigError("data_path", f"{self.data_path!r} is not {what}")
        if self.resume_from is not None and not Path(self.resume_from).exists():
            raise ConfigError(
                "resume_from", f"{self.resume_from!r} does not exist; give a checkpoint or run dir"
            )
        if self.init_factors is not None and not Path(self.init_factors).is_file():
            raise ConfigError(
                "init_factors", f"{self.init_factors!r} is not a file; give a checkpoint .h5 file"
            )

    def _validate_workload(self) -> None:
        """A built-in model fits a built-in dataset: gpt takes only the text datasets, cnn1d
        the mnist1d sequences, the image models images, mlp any but text."""
        builtin = self.model in BUILTIN_MODELS and self.dataset in BUILTIN_DATASETS
        text = self.dataset in TEXT_DATASETS
        if builtin and text != (self.model in TEXT_MODELS):
            raise ConfigError(
                "model",
                f"{self.model!r} does not fit dataset {self.dataset!r}: the text datasets "
                f"({', '.join(TEXT_DATASETS)}) take --model gpt, and gpt takes only them",
            )
        sequences = self.dataset == "mnist1d"
        if builtin and not text and sequences != (self.model == "cnn1d") and self.model != "mlp":
            raise ConfigError(
                "model",
                f"{self.model!r} does not fit dataset {self.dataset!r}: use cnn1d or mlp for "
                "the mnist1d sequences, an image model for the image datasets",
            )
        if self.model == "gpt" and self.gpt_d_model % self.gpt_heads:
            raise ConfigError(
                "gpt_d_model",
                f"{self.gpt_d_model} is not a multiple of --gpt-heads {self.gpt_heads}",
            )
        if self.precision == "fp16" and self.fosi:
            raise ConfigError(
                "precision",
                "fp16 loss scaling does not reach FOSI's Hessian-vector products; "
                "use --precision bf16 or fp32 with --fosi",
            )

    def _validate_fosi(self) -> None:
        """The FOSI options that depend on each other (docs/fosi.md, "Options")."""
        pairs = self.fosi_k + self.fosi_l
        if pairs < 1:
            raise ConfigError("fosi_k", "k + l must be >= 1; give --fosi-k 1 or more")
        if self.lanczos_iters is not None and self.lanczos_iters < pairs:
            raise ConfigError("lanczos_iters", f"must be >= k + l = {pairs}, or left out")
        if self.max_staleness >= self.ese_every:
            raise ConfigError(
                "max_staleness", f"{self.max_staleness} must be < --ese-every {self.ese_every}"
            )

    def factory_args(self, kind: str) -> dict[str, str]:
        """The ``--model-arg`` (``kind`` "model") or ``--dataset-arg`` pairs as a dict;
        ConfigError naming the flag for an item that is not ``key=value``."""
        out: dict[str, str] = {}
        for item in getattr(self, f"{kind}_arg"):
            key, sep, value = item.partition("=")
            if not sep or not key.strip().isidentifier():
                raise ConfigError(f"{kind}_arg", f"{item!r} is not key=value (key a Python name)")
            out[key.strip()] = value
        return out

    def workload(self) -> dict[str, Any]:
        """The workload as checkpoints and run.json record it: names and factory arguments."""
        return {
            "model": self.model,
            "model_args": self.factory_args("model"),
            "dataset": self.dataset,
            "dataset_args": self.factory_args("dataset"),
        }

    @property
    def target(self) -> Target | None:
        """The time-to-target's metric and value: ``--target-accuracy`` (higher is better) or
        ``--target-loss`` (lower is better); None without one."""
        if self.target_accuracy is not None:
            return Target("accuracy", self.target_accuracy)
        if self.target_loss is not None:
            return Target("loss", self.target_loss)
        return None

    @property
    def method(self) -> str:
        """The training method the switches select (``first_order``, ``kfac``, ``fosi``)."""
        return method_of(self.to_dict())

    def check_world_size(self, world_size: int) -> None:
        """ConfigError for settings that do not fit ``world_size`` ranks (beyond the batch)."""
        if self.fosi and self.curvature_ranks and not self.curvature_ranks < world_size:
            raise ConfigError(
                "curvature_ranks",
                f"{self.curvature_ranks} curvature ranks leave no training rank of {world_size}; "
                "use fewer (or 0) or more ranks",
            )

    def fosi_options(self) -> dict[str, Any]:
        """The FOSI keyword arguments, by ``kfac_hpc.FOSI``'s names (the option table's
        ``LIBRARY_PARAMETERS``)."""
        return {param: getattr(self, name) for param, name in LIBRARY_PARAMETERS["fosi"].items()}

    def batch_sizes(self, world_size: int) -> BatchSizes:
        """The global and per-rank batch at ``world_size`` ranks; ConfigError if they don't
        divide."""
        if self.scaling == "weak":
            return BatchSizes(self.batch_size * world_size, self.batch_size)
        if self.batch_size % world_size:
            raise ConfigError(
                "batch_size",
                f"strong scaling splits the global batch {self.batch_size} over {world_size} "
                "ranks: choose a multiple of the world size or --scaling weak",
            )
        return BatchSizes(self.batch_size, self.batch_size // world_size)

    def kfac_options(self) -> dict[str, Any]:
        """The K-FAC keyword arguments, by the preconditioner's names."""
        names = [o.name for o in OPTIONS.values() if o.method == "kfac"]
        options: dict[str, Any] = {name: getattr(self, name) for name in names}
        options["kl_clip"] = self.kl_clip or None
        options["skip_layers"] = list(self.skip_layers)
        options["grad_worker_fraction"] = check_grad_worker_fraction(self.grad_worker_fraction)
        return options

    def grad_worker_share(self, world_size: int) -> float:
        """The fraction of ranks that precondition each layer (1.0 without K-FAC);
        ConfigError when it is not valid at ``world_size``."""
        if not self.kfac:
            return 1.0
        try:
            return parse_grad_worker_fraction(self.grad_worker_fraction, world_size)
        except ValueError as exc:
            raise ConfigError("grad_worker_fraction", str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)  # type: ignore[call-overload]
        out["lr_decay_epochs"] = list(self.lr_decay_epochs)
        out["skip_layers"] = list(self.skip_layers)
        return out

    def config_hash(self) -> str:
        """16 hex digits identifying the experiment (operational fields left out)."""
        data = {k: v for k, v in self.to_dict().items() if k not in OPERATIONAL_FIELDS}
        blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BatchSizes:
    """Samples per optimizer step over all ranks, and on each rank."""

    global_batch_size: int
    per_rank_batch_size: int


def check_run_dir(config: TrainConfig, saved_hash: str | None, root: str) -> None:
    """ConfigError when the run directory holds another experiment (another config hash)."""
    if saved_hash is not None and saved_hash != config.config_hash():
        raise ConfigError(
            "run_dir",
            f"{root!r} holds another experiment (config hash {saved_hash}, this one "
            f"{config.config_hash()}); use a new --run-dir",
        )


def field_help() -> dict[str, str]:
    """Field name -> help text with its choices and unit (used by the CLI and docs)."""
    return {name: option.describe() for name, option in OPTIONS.items()}


def load_config(path: str | Path | None, overrides: Mapping[str, Any]) -> TrainConfig:
    """Read ``path`` (TOML, flat keys) if given, apply ``overrides`` (None = not given),
    and validate. ``checkpoint_every`` and ``time_limit`` are accepted as friendly aliases."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw.update(tomllib.loads(read_user_text(path, "config", error=ConfigError)))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"cannot read {str(path)!r}: {exc}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        raw = expand_aliases(raw)
        unknown = sorted(set(raw) - set(OPTIONS))
        if unknown:
            hint = difflib.get_close_matches(unknown[0], list(OPTIONS), n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"valid keys: {', '.join(OPTIONS)}"
            raise ConfigError(unknown[0], f"unknown setting; {fix}")
        values = resolve_switches({k: coerce_value(OPTIONS[k], v) for k, v in raw.items()})
    except InputError as exc:
        raise ConfigError(exc.field, exc.reason) from None
    for kind in KINDS:  # a file.py:callable is recorded absolute (ranks may start elsewhere)
        if isinstance(values.get(kind), str):
            values[kind] = absolute_name(values[kind])
    config = TrainConfig(**values)
    config.validate()
    return config
