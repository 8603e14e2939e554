"""The workload of a run: its data and model, made by the factories ``--dataset`` and
``--model`` name (:mod:`kfac_hpc.contracts.workload_names`: a registered name, a
``module:callable`` or a ``file.py:callable``; the built-ins are such references too).

A factory is called with one :class:`FactoryContext`: the resolved config, its own
``--model-arg``/``--dataset-arg`` pairs, the rank, the world size and the data path (a model
factory also gets the data's sample shape and class count). A dataset factory returns a
:class:`~kfac_hpc.train.data.DataSource` (which may set its loss and quality metric), a pair
``((x_train, y_train), (x_test, y_test))`` of tensors, or a pair ``(train, test)`` of
map-style ``torch.utils.data.Dataset`` (with ``num_classes`` or ``classes``); a model factory
returns an ``nn.Module`` with trainable parameters. Anything else, an import that fails or a
factory that raises is bad input naming the flag (``ConfigError``, exit 2).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.workload_names import Reference, parse_reference
from kfac_hpc.train.config import ConfigError, TrainConfig
from kfac_hpc.train.data import DataSource, dataset_source, tensor_source

__all__ = ["FactoryContext", "build_model", "load_data", "load_factory"]


@dataclass(frozen=True)
class FactoryContext:
    """What a factory is called with."""

    config: TrainConfig
    args: Mapping[str, str]  # its --model-arg / --dataset-arg pairs
    rank: int
    world_size: int
    data_path: Path | None
    input_shape: tuple[int, ...] | None = None  # model factories: one sample's shape
    num_classes: int | None = None  # model factories: the data's classes (outputs)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _import(ref: Reference) -> Any:
    if ref.module is not None:
        return importlib.import_module(ref.module)
    path = Path(str(ref.file)).resolve()
    key = "kfac_hpc_workload_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def load_factory(kind: str, name: str) -> Callable[[FactoryContext], Any]:
    """The callable ``name`` names (``kind``: model or dataset); ConfigError naming the flag
    when it cannot be imported or is not callable."""
    try:
        ref = parse_reference(kind, name)
    except InputError as exc:
        raise ConfigError(exc.field, exc.reason) from None
    try:
        factory: Any = _import(ref)
        for part in ref.attr.split("."):
            factory = getattr(factory, part)
    except Exception as exc:  # any failure of the user's import is bad input here
        raise ConfigError(kind, f"{name!r} cannot be imported: {_one_line(exc)}") from None
    if not callable(factory):
        raise ConfigError(kind, f"{name!r} is a {type(factory).__name__}, not a callable")
    return factory


def _as_source(made: Any, name: str) -> DataSource:
    """A dataset factory's result as a DataSource; ConfigError for anything else."""
    if isinstance(made, DataSource):
        return made
    if isinstance(made, tuple | list) and len(made) == 2:
        train, test = made
        if all(
            isinstance(part, tuple | list)
            and len(part) == 2
            and all(isinstance(t, torch.Tensor) for t in part)
            for part in made
        ):
            return tensor_source(name, tuple(train), tuple(test))
        if isinstance(train, Dataset) and isinstance(test, Dataset):
            return dataset_source(name, train, test)
    raise ConfigError(
        "dataset",
        f"{name!r} returned a {type(made).__name__}; return a DataSource, "
        "((x_train, y_train), (x_test, y_test)) tensors or (train, test) Datasets",
    )


def load_data(config: TrainConfig, rank: int = 0, world_size: int = 1) -> DataSource:
    """The data of ``config`` from its ``--dataset`` factory; ConfigError naming the flag."""
    factory = load_factory("dataset", config.dataset)
    path = Path(config.data_path) if config.data_path else None
    ctx = FactoryContext(config, config.factory_args("dataset"), rank, world_size, path)
    try:
        made = factory(ctx)
    except InputError:
        raise
    except Exception as exc:  # any failure of the user's factory is bad input here
        # files missing or unreadable are the data path's fault when one is given
        field = "data_path" if path is not None and isinstance(exc, OSError) else "dataset"
        why = f"--dataset {config.dataset} cannot be loaded here: {_one_line(exc)}"
        raise ConfigError(field, why) from None
    source = _as_source(made, config.dataset)
    if source.train_len < 1 or source.test_len < 1:
        raise ConfigError("dataset", f"{config.dataset!r} has no training or no test samples")
    return source


def build_model(
    config: TrainConfig,
    input_shape: tuple[int, ...],
    num_classes: int,
    rank: int = 0,
    world_size: int = 1,
) -> nn.Module:
    """The network of ``config`` from its ``--model`` factory, for samples of ``input_shape``
    and ``num_classes`` classes; ConfigError naming ``--model`` when it fails or returns no
    trainable module."""
    factory = load_factory("model", config.model)
    path = Path(config.data_path) if config.data_path else None
    args = config.factory_args("model")
    ctx = FactoryContext(config, args, rank, world_size, path, input_shape, num_classes)
    try:
        model = factory(ctx)
    except InputError:
        raise
    except Exception as exc:  # a model that does not fit the data, or a broken factory
        why = f"{config.model!r} cannot be built for --dataset {config.dataset}: {_one_line(exc)}"
        raise ConfigError("model", why) from None
    if not isinstance(model, nn.Module):
        why = f"{config.model!r} returned a {type(model).__name__}, not a torch.nn.Module"
        raise ConfigError("model", why)
    if not any(p.requires_grad for p in model.parameters()):
        why = f"{config.model!r} returned a module with no trainable parameters"
        raise ConfigError("model", why)
    return model
