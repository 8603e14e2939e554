"""Capture and restore the whole training state as plain nested values (no pickle).

A :class:`TrainingState` has two parts:

- ``shared``: identical on every rank (model, optimizer, the training method's shared state
  tree, data position, config, versions); rank 0 writes it;
- ``per_rank``: what only this rank holds (its RNG states and the method's shard, e.g. K-FAC
  second-order data); gathered to rank 0 and written under ``ranks/<r>``.

The training method's state is a :class:`~kfac_hpc.contracts.method_state.MethodState` of
plain trees: this module stores them, checks the shapes the method declares, and hands every
saved rank's shard back, so a state saved at world size P with strategy S loads at P' with S'.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kfac_hpc import __version__
from kfac_hpc.contracts.method_state import Checkpointable, SavedState, UnitShapes

__all__ = [
    "READABLE_SCHEMAS",
    "SCHEMA_VERSION",
    "CheckpointError",
    "CheckpointMismatchError",
    "DataPosition",
    "LoadedCheckpoint",
    "RestoredState",
    "TrainingState",
    "capture_training_state",
    "check_restorable",
    "check_schema",
    "check_shapes",
    "restore_training_state",
    "saved_method_state",
]

# 2: the file carries an integrity record (checkpoint/integrity.py); 1 (before it) still loads.
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or of an unknown schema."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the model/preconditioner it is loaded into."""


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: ``batch_index`` batches of ``epoch`` are consumed."""

    epoch: int
    batch_index: int
    sampler_seed: int


@dataclass
class TrainingState:
    """A captured state, ready for :meth:`CheckpointManager.save`.

    ``frozen`` names the top-level groups (of ``shared`` or ``per_rank``) whose tensors nobody
    modifies in place after the capture, so an asynchronous writer may hold references to
    them instead of copies (it still checks each one's ``_version`` before publishing).
    """

    step: int
    shared: dict[str, Any]
    per_rank: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    frozen: frozenset[str] = frozenset()


@dataclass
class LoadedCheckpoint:
    """A checkpoint file read and verified (every checksum checked) into memory."""

    path: Path
    tree: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.tree["step"])

    @property
    def world_size(self) -> int:
        return int(self.tree["world_size"])


@dataclass
class RestoredState:
    """What :func:`restore_training_state` put back, for the job to continue from."""

    step: int
    data_position: DataPosition
    config: dict[str, Any]
    config_hash: str | None
    saved_world_size: int
    saved_strategy: str | None
    rng_restored: bool
    extra: dict[str, Any] = field(default_factory=dict)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel (or similar) wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _model_tree(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``model.state_dict()`` grouped per module: ``{"layer1.0.conv1": {"weight": T, ...}}``."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _unwrap(model).state_dict().items():
        module, _, name = key.rpartition(".")
        grouped.setdefault(module, {})[name] = tensor.detach().cpu().clone()
    return grouped


def _flat_model_state(tree: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        f"{module}.{name}" if module else name: tensor
        for module, params in tree.items()
        for name, tensor in params.items()
    }


def _rng_tree() -> dict[str, Any]:
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    py_version, py_state, py_gauss = random.getstate()
    tree: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": {
            "kind": str(np_kind),
            "keys": np.asarray(np_keys),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tree["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return tree


def _set_rng(tree: Mapping[str, Any]) -> None:
    torch.set_rng_state(tree["torch_cpu"])
    npt = tree["numpy"]
    np.random.set_state(
        (npt["kind"], npt["keys"], npt["pos"], npt["has_gauss"], npt["cached_gaussian"])
    )
    py = tree["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    cuda = tree.get("torch_cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _reseed(sampler_seed: int, step: int, rank: int) -> None:
    """Fresh, reproducible RNG streams when the saved ones do not map onto this world size."""
    digest = hashlib.sha256(f"{sampler_seed}:{step}:{rank}".encode()).digest()
    seed = int.from_bytes(digest[:4], "little")
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _versions() -> dict[str, str]:
    return {
        "kfac_hpc": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def capture_training_state(
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    preconditioner: Checkpointable | None = None,
    data_position: DataPosition,
    config: Mapping[str, Any] | None = None,
    config_hash: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    strategy: str | None = None,
    include_shards: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> TrainingState:
    """Copy everything needed to resume after ``step`` optimizer steps (tensors go to CPU).

    ``preconditioner`` is the training method's own state (the K-FAC preconditioner, or any
    :class:`~kfac_hpc.contracts.method_state.Checkpointable`). ``include_shards`` stores its
    per-rank shards (K-FAC: eigendecompositions/inverses), so a resume needs no O(n³) recompute
    and is bit-for-bit identical between inverse updates.
    """
    shared: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "step": int(step),
        "world_size": int(world_size),
        "strategy": strategy,
        "config_hash": config_hash,
        "created_unix_s": time.time(),
        "versions": _versions(),
        "config_json": json.dumps(dict(config or {}), sort_keys=True),
        "data_position": {
            "epoch": data_position.epoch,
            "batch_index": data_position.batch_index,
            "sampler_seed": data_position.sampler_seed,
        },
        "extra": dict(extra or {}),
        "model": _model_tree(model),
    }
    if optimizer is not None:
        shared["optimizer"] = optimizer.state_dict()
    per_rank: dict[str, Any] = {"rng": _rng_tree()}
    frozen = {"model", "rng"}  # fresh copies; the optimizer's state is live
    if preconditioner is not None:
        state = preconditioner.checkpoint_state(include_shard=include_shards)
        shared[preconditioner.state_group] = state.shared
        if state.shard:
            per_rank[preconditioner.shard_group] = state.shard
        shared["strategy"] = strategy or state.strategy
        if state.assignment:
            shared["assignment"] = state.assignment
        if getattr(preconditioner, "state_by_reference", False):
            frozen |= {preconditioner.state_group, preconditioner.shard_group}
    return TrainingState(int(step), shared, per_rank, rank, world_size, frozenset(frozen))


def _check_model(model: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    """Raise naming the first entry whose presence or shape differs."""
    current = _unwrap(model).state_dict()
    for key in list(dict.fromkeys([*current, *saved])):
        if key not in saved:
            raise CheckpointMismatchError(
                f"model mismatch at {key!r}: the model has shape {tuple(current[key].shape)}, "
                "the checkpoint has no such entry"
            )
        if key not in current:
            raise CheckpointMismatchError(
                f"model mismatch at {key!r}: the checkpoint has shape "
                f"{tuple(saved[key].shape)}, the model has no such entry"
            )
        if current[key].shape != saved[key].shape:
            raise CheckpointMismatchError(
                f"model mismatch at {key!r}: checkpoint shape {tuple(saved[key].shape)} != "
                f"model shape {tuple(current[key].shape)}"
            )


def _require(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{path}: not a training checkpoint of this schema ({what})")


def check_schema(path: Path, tree: Mapping[str, Any]) -> None:
    """CheckpointError unless ``tree`` has every entry a resume reads, of the right type (a
    file can pass every checksum and still lack a dataset)."""
    for key in ("step", "world_size"):
        value = tree.get(key)
        _require(isinstance(value, int) and value >= 0, path, f"{key} missing or not a count")
    try:
        config = json.loads(tree.get("config_json", ""))
    except (TypeError, ValueError):
        config = None
    _require(isinstance(config, dict), path, "config_json missing or not a JSON object")
    pos = tree.get("data_position")
    fields = ("epoch", "batch_index", "sampler_seed")
    _require(
        isinstance(pos, Mapping) and all(isinstance(pos.get(k), int) for k in fields),
        path,
        "data_position incomplete",
    )
    model = tree.get("model")
    _require(isinstance(model, Mapping) and bool(model), path, "no model state")
    optimizer = tree.get("optimizer")
    _require(
        optimizer is None
        or (
            isinstance(optimizer, Mapping)
            and isinstance(optimizer.get("param_groups"), list)
            and isinstance(optimizer.get("state"), Mapping)
        ),
        path,
        "optimizer state incomplete",
    )
    ranks = tree.get("ranks", {})
    for r in range(int(tree["world_size"])):
        rank = ranks.get(str(r)) if isinstance(ranks, Mapping) else None
        _require(isinstance(rank, Mapping) and "rng" in rank, path, f"rank {r} RNG state missing")
    layers = tree.get("kfac_state", {}).get("layers", {})
    for name, layer in layers.items() if isinstance(layers, Mapping) else ():
        has_both = isinstance(layer, Mapping) and all(f in layer for f in ("A", "G"))
        _require(has_both, path, f"K-FAC layer {name!r} lacks A or G")


def _check_optimizer(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], path: Path
) -> None:
    """Raise unless the saved optimizer state is of this optimizer (its groups' settings
    and parameter counts)."""
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        raise CheckpointMismatchError(
            f"{path}: {len(saved_groups)} optimizer parameter groups, this run has {len(groups)}"
        )
    for group, saved_group in zip(groups, saved_groups, strict=True):
        missing = sorted(set(group) - set(saved_group) - {"params"})
        if missing or len(group["params"]) != len(saved_group.get("params", ())):
            what = f"lacks {', '.join(missing)}" if missing else "has other parameters"
            raise CheckpointMismatchError(
                f"{path}: the saved optimizer state {what}: saved by another optimizer "
                f"({type(optimizer).__name__} here)"
            )


def check_restorable(
    checkpoint: LoadedCheckpoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    preconditioner: Checkpointable | None = None,
) -> SavedState | None:
    """:class:`CheckpointMismatchError` unless ``checkpoint`` fits the live objects (changes
    nothing); returns the preconditioner's saved state."""
    tree = checkpoint.tree
    _check_model(model, _flat_model_state(tree["model"]))
    saved = None if preconditioner is None else _saved_state_of(checkpoint, preconditioner)
    if optimizer is not None:
        if "optimizer" not in tree:
            raise CheckpointMismatchError(
                f"{checkpoint.path}: the checkpoint has no optimizer state"
            )
        _check_optimizer(optimizer, tree["optimizer"], checkpoint.path)
    return saved


def saved_method_state(
    tree: Mapping[str, Any], method: Checkpointable, with_shards: bool = True
) -> SavedState | None:
    """``method``'s state in a checkpoint tree: its shared tree and every saved rank's shard
    (in rank order); None when the checkpoint has none."""
    if method.state_group not in tree:
        return None
    ranks = tree.get("ranks", {}) if with_shards else {}
    shards = [ranks[r].get(method.shard_group, {}) for r in sorted(ranks, key=int)]
    return SavedState(dict(tree[method.state_group]), [s for s in shards if s])


def check_shapes(expected: UnitShapes, saved: SavedState, label: str, where: Path) -> None:
    """Raise naming the first unit (K-FAC: layer) whose presence or shape differs."""
    units: Any = saved.shared
    for key in expected.path:
        units = units.get(key, {}) if isinstance(units, Mapping) else {}
    if not units:  # saved before the first update: nothing to compare
        return
    for name in list(dict.fromkeys([*expected.shapes, *units])):
        if name not in units or name not in expected.shapes:
            side = "checkpoint" if name not in units else "model"
            raise CheckpointMismatchError(
                f"{label} {expected.unit} {name!r} is missing from the {side}"
            )
        for entry, shape in expected.shapes[name].items():
            tensor = units[name].get(entry)
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
            if got != tuple(shape):
                raise CheckpointMismatchError(
                    f"{label} {expected.unit} {name!r} {expected.entry} {entry}: shape {got} in "
                    f"{where} != model shape {tuple(shape)}"
                )


def _saved_state_of(checkpoint: LoadedCheckpoint, method: Checkpointable) -> SavedState:
    saved = saved_method_state(checkpoint.tree, method)
    if saved is None:
        raise CheckpointMismatchError(
            f"{checkpoint.path}: the checkpoint has no {method.label} state (saved without it)"
        )
    check_shapes(method.expected_shapes(), saved, method.label, checkpoint.path)
    return saved


def restore_training_state(
    checkpoint: LoadedCheckpoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    preconditioner: Checkpointable | None = None,
    rank: int = 0,
    world_size: int = 1,
    restore_rng: bool = True,
) -> RestoredState:
    """Put a loaded checkpoint back into live objects; checks everything before changing any.

    ``preconditioner`` is the training method's own state, as for
    :func:`capture_training_state`.

    Raises :class:`CheckpointMismatchError` naming the first mismatched layer and shapes.
    RNG streams are restored when the world size is unchanged; otherwise every rank is
    re-seeded from (sampler seed, step, rank) and ``rng_restored`` is False.
    """
    tree = checkpoint.tree
    saved_model = _flat_model_state(tree["model"])
    saved = check_restorable(
        checkpoint, model=model, optimizer=optimizer, preconditioner=preconditioner
    )

    _unwrap(model).load_state_dict(saved_model, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(tree["optimizer"])
    if preconditioner is not None and saved is not None:
        preconditioner.load_checkpoint_state(saved)

    pos = tree["data_position"]
    data_position = DataPosition(pos["epoch"], pos["batch_index"], pos["sampler_seed"])
    rank_tree = tree.get("ranks", {}).get(str(rank))
    same_layout = checkpoint.world_size == world_size and rank_tree is not None
    if restore_rng and same_layout:
        _set_rng(rank_tree["rng"])
    elif restore_rng:
        warnings.warn(
            f"checkpoint saved at world size {checkpoint.world_size}, loading at {world_size}: "
            "RNG streams re-seeded per rank",
            stacklevel=2,
        )
        _reseed(data_position.sampler_seed, checkpoint.step, rank)
    return RestoredState(
        step=checkpoint.step,
        data_position=data_position,
        config=json.loads(tree["config_json"]),
        config_hash=tree.get("config_hash"),
        saved_world_size=checkpoint.world_size,
        saved_strategy=tree.get("strategy"),
        rng_restored=restore_rng and same_layout,
        extra=dict(tree.get("extra", {})),
    )
