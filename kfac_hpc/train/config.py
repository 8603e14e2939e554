"""The resolved configuration of one training run: a dataclass, validated once at the edge.

Values come from a TOML file (flat keys, the field names below) overridden by command-line
flags. Torch is not imported here, so the sweep can import the field names cheaply.

``--scaling strong`` keeps the global batch fixed (``batch_size`` is the global batch, split
over ranks); ``weak`` keeps the per-rank batch fixed (``batch_size`` is per rank).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "COMPUTE_METHODS",
    "DATASETS",
    "KFAC_OPTIONS",
    "LR_SCHEDULES",
    "MODELS",
    "OPERATIONAL_FIELDS",
    "OPTIMIZERS",
    "BatchSizes",
    "ConfigError",
    "TrainConfig",
    "check_run_dir",
    "field_help",
    "load_config",
    "parse_duration_s",
]

MODELS = ("small_cnn", "mlp", "resnet20", "resnet32", "resnet56", "resnet50")
DATASETS = ("digits", "synthetic_cifar", "synthetic_imagenet", "cifar10", "imagefolder")
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "step", "cosine")
SCALINGS = ("strong", "weak")
BACKENDS = ("auto", "gloo", "nccl")
COMPUTE_METHODS = ("eigen", "inverse")
# Passed to KFACPreconditioner by these exact keyword names.
KFAC_OPTIONS = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "grad_worker_fraction",
    "compute_method",
    "assignment_strategy",
    "colocate_factors",
    "symmetry_aware",
    "compute_eigenvalue_outer_product",
    "allreduce_bucket_cap_mb",
    "skip_layers",
    "update_factors_in_hook",
)
GRAD_WORKER_NAMES = ("comm-opt", "mem-opt", "hybrid-opt")
ASSIGNMENT_STRATEGIES = ("compute", "memory")
# Fields that change how a run is operated, not what it computes: left out of the config hash
# so a resumed or time-limited run keeps the hash of its experiment.
OPERATIONAL_FIELDS = frozenset(
    {
        "time_limit_s",
        "checkpoint_every_steps",
        "checkpoint_every_min",
        "keep_checkpoints",
        "log_every",
        "resume_from",
        "collective_timeout_s",
        "cuda_sync",
        "progress",
    }
)


class ConfigError(ValueError):
    """Bad user input; ``str()`` is one line naming the field and the fix."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.field = name
        self.reason = message


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a training run; ``validate()`` is called by :func:`load_config`."""

    model: str = _f("small_cnn", f"network: {', '.join(MODELS)}")
    dataset: str = _f("digits", f"data: {', '.join(DATASETS)}")
    data_path: str | None = _f(None, "folder of the CIFAR-10 binary batches or the image folder")
    num_samples: int = _f(4096, "training samples of a synthetic dataset")
    augment: bool = _f(True, "random crop + flip for 32x32 image data (cifar10)")
    optimizer: str = _f("sgd", f"first-order optimizer: {', '.join(OPTIMIZERS)}")
    lr: float = _f(0.1, "peak learning rate")
    momentum: float = _f(0.9, "SGD momentum (beta1 is 0.9 for adam/adamw)")
    weight_decay: float = _f(1e-4, "L2 (sgd, adam) or decoupled (adamw) weight decay")
    lr_schedule: str = _f("cosine", f"after warm-up: {', '.join(LR_SCHEDULES)}")
    warmup_epochs: float = _f(0.0, "linear warm-up to --lr over this many epochs")
    lr_decay_epochs: tuple[int, ...] = _f((), "epochs at which 'step' multiplies lr by the factor")
    lr_decay_factor: float = _f(0.1, "factor of the 'step' schedule")
    kfac: bool = _f(True, "precondition gradients with K-FAC")
    factor_update_steps: int = _f(1, "K-FAC: steps between factor (A, G) updates")
    inv_update_steps: int = _f(10, "K-FAC: steps between eigen/inverse updates")
    damping: float = _f(0.003, "K-FAC: Tikhonov damping")
    factor_decay: float = _f(0.95, "K-FAC: running-average decay of the factors")
    kl_clip: float = _f(0.001, "K-FAC: KL clip of the preconditioned step (0 disables)")
    grad_worker_fraction: str = _f(
        "comm-opt",
        "K-FAC: ranks that precondition each layer: comm-opt (all), mem-opt (one), hybrid-opt "
        "(half) or a fraction in (0, 1]",
    )
    compute_method: str = _f("eigen", f"K-FAC: {', '.join(COMPUTE_METHODS)}")
    assignment_strategy: str = _f(
        "compute", "K-FAC: balance second-order work by compute (n^3) or memory (n^2)"
    )
    colocate_factors: bool = _f(True, "K-FAC: a layer's A and G on the same rank")
    symmetry_aware: bool = _f(False, "K-FAC: communicate only the upper triangle of factors")
    compute_eigenvalue_outer_product: bool = _f(
        True, "K-FAC: precompute the eigenvalue outer product (eigen method)"
    )
    allreduce_bucket_cap_mb: float = _f(25.0, "K-FAC: factor allreduce bucket size (MB)")
    skip_layers: tuple[str, ...] = _f((), "K-FAC: module or class names left unpreconditioned")
    update_factors_in_hook: bool = _f(True, "K-FAC: compute factors in the module hooks")
    epochs: int = _f(5, "passes over the training data (ignored when --steps is given)")
    steps: int | None = _f(None, "total optimizer steps (overrides --epochs)")
    batch_size: int = _f(128, "global batch (strong scaling) or per-rank batch (weak scaling)")
    scaling: str = _f("strong", "strong: global batch fixed; weak: per-rank batch fixed")
    seed: int = _f(0, "seed of model init, data order and synthetic data")
    target_accuracy: float | None = _f(None, "test accuracy in (0, 1] whose first time is recorded")
    stop_at_target: bool = _f(False, "stop once --target-accuracy is reached")
    time_limit_s: float | None = _f(None, "stop training after this much wall time")
    checkpoint_every_steps: int | None = _f(None, "checkpoint every N steps")
    checkpoint_every_min: float | None = _f(None, "checkpoint every M minutes")
    keep_checkpoints: int = _f(2, "complete checkpoints kept in RUN_DIR/checkpoints")
    log_every: int = _f(20, "steps per metrics.jsonl window")
    backend: str = _f("auto", "torch.distributed backend: auto (nccl on GPU), gloo, nccl")
    collective_timeout_s: float = _f(300.0, "a collective waiting longer fails the run")
    cuda_sync: bool = _f(False, "synchronize CUDA at phase boundaries (exact GPU phase times)")
    progress: bool = _f(True, "a progress line per epoch on rank 0 (a bar on a terminal)")
    resume_from: str | None = _f(
        None, "start from the whole state of this checkpoint (.h5 file, run dir or checkpoints/)"
    )
    init_factors: str | None = _f(None, "start from the K-FAC factors of this checkpoint file")

    def validate(self) -> None:
        """Raise :class:`ConfigError` on the first bad field."""
        for name, choices in (
            ("model", MODELS),
            ("dataset", DATASETS),
            ("optimizer", OPTIMIZERS),
            ("lr_schedule", LR_SCHEDULES),
            ("scaling", SCALINGS),
            ("backend", BACKENDS),
            ("compute_method", COMPUTE_METHODS),
            ("assignment_strategy", ASSIGNMENT_STRATEGIES),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(name, f"{value!r} is not one of {', '.join(choices)}")
        _positive(self, ("num_samples", "epochs", "batch_size", "factor_update_steps"))
        _positive(self, ("inv_update_steps", "log_every", "keep_checkpoints", "lr"))
        _positive(self, ("collective_timeout_s", "lr_decay_factor"))
        _positive_or_none(self, ("steps", "time_limit_s", "checkpoint_every_steps"))
        _positive_or_none(self, ("checkpoint_every_min",))
        for name in ("momentum", "weight_decay", "warmup_epochs", "damping", "kl_clip"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(name, f"{getattr(self, name)} must be a finite number >= 0")
        if not 0 <= self.factor_decay < 1:
            raise ConfigError("factor_decay", f"{self.factor_decay} must be in [0, 1)")
        if self.grad_worker_fraction not in GRAD_WORKER_NAMES:
            try:
                fraction = float(self.grad_worker_fraction)
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 1:
                raise ConfigError(
                    "grad_worker_fraction",
                    f"{self.grad_worker_fraction!r} must be one of "
                    f"{', '.join(GRAD_WORKER_NAMES)} or a number in (0, 1]",
                )
        _positive(self, ("allreduce_bucket_cap_mb",))
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError("target_accuracy", f"{self.target_accuracy} must be in (0, 1]")
        if self.stop_at_target and self.target_accuracy is None:
            raise ConfigError("stop_at_target", "needs --target-accuracy")
        if self.dataset in ("cifar10", "imagefolder"):
            if not self.data_path:
                raise ConfigError("data_path", f"dataset {self.dataset!r} needs --data-path DIR")
            if not Path(self.data_path).is_dir():
                raise ConfigError("data_path", f"{self.data_path!r} is not a directory")
        if self.resume_from is not None and not Path(self.resume_from).exists():
            raise ConfigError(
                "resume_from", f"{self.resume_from!r} does not exist; give a checkpoint or run dir"
            )
        if self.init_factors is not None and not Path(self.init_factors).is_file():
            raise ConfigError(
                "init_factors", f"{self.init_factors!r} is not a file; give a checkpoint .h5 file"
            )
        if any(e <= 0 for e in self.lr_decay_epochs):
            raise ConfigError("lr_decay_epochs", "epochs must be positive integers")

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
        options: dict[str, Any] = {name: getattr(self, name) for name in KFAC_OPTIONS}
        options["kl_clip"] = self.kl_clip or None
        options["skip_layers"] = list(self.skip_layers)
        if self.grad_worker_fraction not in GRAD_WORKER_NAMES:
            options["grad_worker_fraction"] = float(self.grad_worker_fraction)
        return options

    def grad_worker_share(self, world_size: int) -> float:
        """The fraction of ranks that precondition each layer (1.0 without K-FAC)."""
        if not self.kfac or self.grad_worker_fraction == "comm-opt":
            return 1.0
        if self.grad_worker_fraction == "mem-opt":
            return 1.0 / world_size
        if self.grad_worker_fraction == "hybrid-opt":
            return max(0.5, 1.0 / world_size)
        return float(self.grad_worker_fraction)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
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
    """Field name -> help text (used by the CLI and docs)."""
    return {f.name: f.metadata["help"] for f in fields(TrainConfig)}


def _positive(cfg: TrainConfig, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ConfigError(name, f"{value!r} must be > 0")


def _positive_or_none(cfg: TrainConfig, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(cfg, name) is not None:
            _positive(cfg, (name,))


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str | float, name: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``2h``, ``1d`` or Slurm's ``[D-]HH:MM:SS``."""
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION.match(text)
    if match:
        return float(match.group(1)) * _UNIT_S[match.group(2)]
    clock = re.match(r"^\s*(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)\s*$", text)
    if clock:
        days, hours, minutes, seconds = (int(g) if g else 0 for g in clock.groups())
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    raise ConfigError(name, f"{text!r} is not a duration; write e.g. 90s, 30m, 2h or 01:30:00")


def _split_checkpoint_every(value: str | int, raw: dict[str, Any]) -> None:
    """``checkpoint_every``: an integer is steps, a duration (``10m``) is minutes."""
    text = str(value).strip()
    raw.pop("checkpoint_every_steps", None)
    raw.pop("checkpoint_every_min", None)
    if text.isdigit():
        raw["checkpoint_every_steps"] = int(text)
    else:
        raw["checkpoint_every_min"] = parse_duration_s(text, "checkpoint_every") / 60.0


def _coerce(name: str, value: Any, annotation: str) -> Any:
    """Type-check one raw value (TOML or CLI) against the field's annotation."""
    if value is None and "None" in annotation:
        return None
    base = annotation.replace(" | None", "")
    ok: bool
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif base == "str":
        ok = isinstance(value, str)
        if name == "grad_worker_fraction" and isinstance(value, int | float):
            value, ok = str(float(value)), not isinstance(value, bool)
    elif base == "tuple[str, ...]":
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:  # tuple[int, ...]
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        try:
            value = tuple(int(v) for v in value)
            ok = True
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ConfigError(name, f"{value!r} is not a {base}")
    return value


def load_config(path: str | Path | None, overrides: Mapping[str, Any]) -> TrainConfig:
    """Read ``path`` (TOML, flat keys) if given, apply ``overrides`` (None = not given),
    and validate. ``checkpoint_every`` and ``time_limit`` are accepted as friendly aliases."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw.update(tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError("config", f"cannot read {str(path)!r}: {exc}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    if "time_limit" in raw:
        raw["time_limit_s"] = parse_duration_s(raw.pop("time_limit"), "time_limit")
    if "checkpoint_every" in raw:
        _split_checkpoint_every(raw.pop("checkpoint_every"), raw)
    annotations = {f.name: str(f.type) for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - set(annotations))
    if unknown:
        hint = difflib.get_close_matches(unknown[0], list(annotations), n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"valid keys: {', '.join(annotations)}"
        raise ConfigError(unknown[0], f"unknown setting; {fix}")
    values = {k: _coerce(k, v, annotations[k]) for k, v in raw.items()}
    config = TrainConfig(**values)
    config.validate()
    return config
