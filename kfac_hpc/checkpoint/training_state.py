"""Capture and restore the whole training state as plain nested values (no pickle).

A :class:`TrainingState` has two parts:

- ``shared``: identical on every rank (model, optimizer, K-FAC factors and counters, data
  position, config, versions); rank 0 writes it;
- ``per_rank``: what only this rank holds (its RNG states; under MEM-OPT/HYBRID-OPT the
  second-order data of the layers it owns); gathered to rank 0 and written under ``ranks/<r>``.

Restoring is layer-keyed, so a state saved at world size P with strategy S loads at P' with S':
the K-FAC second-order data of every rank is merged back into one layer-keyed dict.
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
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from kfac_hpc import __version__

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointError",
    "CheckpointMismatchError",
    "DataPosition",
    "LoadedCheckpoint",
    "Preconditioner",
    "RestoredState",
    "TrainingState",
    "capture_training_state",
    "check_kfac",
    "merged_kfac_state",
    "restore_training_state",
]

SCHEMA_VERSION = 1
SECOND_ORDER = "kfac_second_order"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or of an unknown schema."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit the model/preconditioner it is loaded into."""


class Preconditioner(Protocol):
    """What this module needs of ``kfac_hpc.optim.KFACPreconditioner``."""

    def state_dict(self, include_second_order: bool = ...) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: ``batch_index`` batches of ``epoch`` are consumed."""

    epoch: int
    batch_index: int
    sampler_seed: int


@dataclass
class TrainingState:
    """A captured state, ready for :meth:`CheckpointManager.save`."""

    step: int
    shared: dict[str, Any]
    per_rank: dict[str, Any]
    rank: int = 0
    world_size: int = 1


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


def _is_primary_holder(preconditioner: Preconditioner, name: str, rank: int) -> bool:
    """Whether this rank writes ``name``'s second-order data: the first of its grad workers.

    Under COMM-OPT every rank holds every layer's data; writing it once (from the first grad
    worker) keeps the gathered volume equal to one copy whatever the strategy.
    """
    plan = getattr(getattr(preconditioner, "assignment", None), "layers", {}).get(name)
    workers = getattr(plan, "grad_workers", None)
    return not workers or workers[0] == rank


def _split_kfac(
    preconditioner: Preconditioner, include_second_order: bool, rank: int
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(state without second-order data, {layer: second-order entries this rank writes})."""
    base = preconditioner.state_dict(include_second_order=False)
    if not include_second_order:
        return base, {}
    full = preconditioner.state_dict(include_second_order=True)
    base_layers = base.get("layers", {})
    extra: dict[str, dict[str, Any]] = {}
    for name, entries in full.get("layers", {}).items():
        own = {k: v for k, v in entries.items() if k not in base_layers.get(name, {})}
        if own and _is_primary_holder(preconditioner, name, rank):
            extra[name] = own
    return base, extra


def _assignment_tree(preconditioner: Preconditioner) -> tuple[str | None, dict[str, Any]]:
    """(distribution strategy, {layer: plan}) of a KAISA-style ``preconditioner.assignment``."""
    assignment = getattr(preconditioner, "assignment", None)
    if assignment is None:
        return None, {}
    distribution = getattr(getattr(assignment, "distribution", None), "value", None)
    plans = {
        name: {
            "a_worker": int(plan.a_worker),
            "g_worker": int(plan.g_worker),
            "grad_workers": [int(r) for r in plan.grad_workers],
        }
        for name, plan in getattr(assignment, "layers", {}).items()
    }
    return distribution, plans


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
    preconditioner: Preconditioner | None = None,
    data_position: DataPosition,
    config: Mapping[str, Any] | None = None,
    config_hash: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    strategy: str | None = None,
    assignment: Mapping[str, Any] | None = None,
    include_second_order: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> TrainingState:
    """Copy everything needed to resume after ``step`` optimizer steps (tensors go to CPU).

    ``include_second_order`` stores K-FAC eigendecompositions/inverses, so a resume needs no
    O(n³) recompute and is bit-for-bit identical between inverse updates.
    """
    shared: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "step": int(step),
        "world_size": int(world_size),
        "strategy": strategy,
        "config_hash": config_hash,
        "kfac": preconditioner is not None,
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
    if preconditioner is not None:
        base, second = _split_kfac(preconditioner, include_second_order, rank)
        shared["kfac_state"] = base
        if second:
            per_rank[SECOND_ORDER] = second
        distribution, plans = _assignment_tree(preconditioner)
        shared["strategy"] = strategy or distribution
        if assignment is None and plans:
            assignment = plans
    if assignment is not None:
        shared["assignment"] = dict(assignment)
    return TrainingState(int(step), shared, per_rank, rank, world_size)


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


def merged_kfac_state(tree: Mapping[str, Any], with_second_order: bool = True) -> dict[str, Any]:
    """The saved K-FAC state with every rank's second-order data merged back, layer-keyed."""
    state = dict(tree["kfac_state"])
    layers = {name: dict(entries) for name, entries in state.get("layers", {}).items()}
    if with_second_order:
        for rank_tree in tree.get("ranks", {}).values():
            for name, entries in rank_tree.get(SECOND_ORDER, {}).items():
                layers.setdefault(name, {}).update(entries)
    state["layers"] = layers
    return state


def _expected_factor_shapes(preconditioner: Preconditioner) -> dict[str, dict[str, Any]]:
    """{layer: {"A": shape, "G": shape}} the preconditioner needs, from its registered layers
    (``layers[name].factor_shapes``) or, failing that, from its current factors."""
    layers = getattr(preconditioner, "layers", None)
    if isinstance(layers, Mapping) and all(hasattr(v, "factor_shapes") for v in layers.values()):
        return {
            name: dict(zip(("A", "G"), layer.factor_shapes, strict=True))
            for name, layer in layers.items()
        }
    current = preconditioner.state_dict(include_second_order=False).get("layers", {})
    return {
        name: {f: tuple(t.shape) for f, t in entry.items() if f in ("A", "G")}
        for name, entry in current.items()
    }


def check_kfac(preconditioner: Preconditioner, saved: Mapping[str, Any], where: Path) -> None:
    """Raise naming the first K-FAC layer that the checkpoint and the model disagree on."""
    expected = _expected_factor_shapes(preconditioner)
    saved_layers = saved.get("layers", {})
    if not saved_layers:  # saved before the first factor update: nothing to compare
        return
    for name in list(dict.fromkeys([*expected, *saved_layers])):
        if name not in saved_layers or name not in expected:
            side = "checkpoint" if name not in saved_layers else "model"
            raise CheckpointMismatchError(f"K-FAC layer {name!r} is missing from the {side}")
        for factor, shape in expected[name].items():
            tensor = saved_layers[name].get(factor)
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else None
            if got != tuple(shape):
                raise CheckpointMismatchError(
                    f"K-FAC layer {name!r} factor {factor}: shape {got} in {where} != model "
                    f"shape {tuple(shape)}"
                )


def restore_training_state(
    checkpoint: LoadedCheckpoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    preconditioner: Preconditioner | None = None,
    rank: int = 0,
    world_size: int = 1,
    restore_rng: bool = True,
) -> RestoredState:
    """Put a loaded checkpoint back into live objects; checks everything before changing any.

    Raises :class:`CheckpointMismatchError` naming the first mismatched layer and shapes.
    RNG streams are restored when the world size is unchanged; otherwise every rank is
    re-seeded from (sampler seed, step, rank) and ``rng_restored`` is False.
    """
    tree = checkpoint.tree
    saved_model = _flat_model_state(tree["model"])
    _check_model(model, saved_model)
    if preconditioner is not None:
        if "kfac_state" not in tree:
            raise CheckpointMismatchError(
                f"{checkpoint.path}: the checkpoint has no K-FAC state (saved without K-FAC)"
            )
        check_kfac(preconditioner, tree["kfac_state"], checkpoint.path)
    if optimizer is not None and "optimizer" not in tree:
        raise CheckpointMismatchError(f"{checkpoint.path}: the checkpoint has no optimizer state")

    _unwrap(model).load_state_dict(saved_model, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(tree["optimizer"])
    if preconditioner is not None:
        preconditioner.load_state_dict(merged_kfac_state(tree))

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
