"""Every point checked as its job will check it, before anything is written or submitted.

:func:`check_train_values` runs the job's own parser and validation (the ``kfac-hpc train``
command's flags, :func:`kfac_hpc.train.config.load_config` and the world-size checks of
:class:`~kfac_hpc.train.config.TrainConfig`) on each point's train command line, the
``--train-arg`` pass-through arguments included, so a value ``kfac-hpc train`` rejects is
rejected by the sweep, with the same message. :func:`check_loadable` loads each distinct
dataset and builds each distinct model (torch is imported): a point whose data or model cannot
load fails here, not in the queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.sweep.command import train_argv
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.spec import Point
from kfac_hpc.train.config import TrainConfig, load_config

__all__ = ["check_loadable", "check_train_values"]


# Stands for the run directory the sweep gives each point (``SWEEP_DIR/runs/POINT``).
_RUN_DIR = "SWEEP_DIR/runs/POINT"


def _config(point: Point) -> TrainConfig:
    """The point's TrainConfig as ``kfac-hpc train`` makes it from the point's command line:
    its flags parsed by the train command itself, then :func:`load_config`."""
    from kfac_hpc.train.cli import train

    argv = ["--run-dir", _RUN_DIR, *train_argv(point.params)]
    try:
        # help_option_names=[]: a --help among the arguments is refused, never printed.
        ctx = train.make_context("kfac-hpc train", argv, help_option_names=[])
    except click.ClickException as exc:  # an unknown flag, a value of the wrong type...
        message = " ".join(exc.format_message().split())
        raise SweepInputError(
            "extra_args", f"kfac-hpc train refuses the --train-arg arguments: {message}"
        ) from None
    params = dict(ctx.params)
    if params.pop("run_dir") != _RUN_DIR:
        raise SweepInputError(
            "extra_args",
            "--run-dir is the sweep's (SWEEP_DIR/runs/POINT); remove it from --train-arg",
        )
    return load_config(params.pop("config_file"), params)


def _where(point: Point) -> str:
    ranks = int(point.params["nodes"]) * int(point.params["ranks_per_node"])
    return f"point {point.point_id} ({point.params['nodes']} node(s), {ranks} rank(s))"


def check_train_values(points: Sequence[Point]) -> None:
    """SweepInputError naming the field when a point's train values are not valid for
    ``kfac-hpc train`` at the point's world size."""
    seen: set[str] = set()
    for point in points:
        key = repr(sorted((k, repr(v)) for k, v in point.params.items() if k != "repeat"))
        if key in seen:
            continue
        seen.add(key)
        world_size = int(point.params["nodes"]) * int(point.params["ranks_per_node"])
        try:
            config = _config(point)
            config.batch_sizes(world_size)
            config.grad_worker_share(world_size)
        except InputError as exc:
            raise SweepInputError(exc.field, f"{exc.reason} ({_where(point)})") from None


def check_loadable(points: Sequence[Point]) -> None:
    """SweepInputError naming the point's flag when its dataset cannot be loaded or its model
    cannot be built here."""
    from kfac_hpc.train.data import load_data
    from kfac_hpc.train.models import build_model

    datasets: dict[tuple[Any, ...], tuple[tuple[int, ...], int]] = {}
    models: set[tuple[Any, ...]] = set()
    for point in points:
        config = _config(point)
        data_key = (config.dataset, config.data_path, config.num_samples)
        if data_key not in datasets:
            try:
                data = load_data(config)
            except Exception as exc:  # any failure of the user's data is bad input here
                flag = "data_path" if config.data_path else "dataset"
                raise SweepInputError(
                    flag,
                    f"--dataset {config.dataset} cannot be loaded here ({_where(point)}): "
                    f"{type(exc).__name__}: {_one_line(exc)}",
                ) from None
            datasets[data_key] = (data.shape, data.num_classes)
        shape, classes = datasets[data_key]
        model_key = (config.model, shape, classes, config.cnn1d_channels)
        if model_key not in models:
            try:
                build_model(config.model, shape, classes, config.cnn1d_channels)
            except Exception as exc:  # a model that does not fit the data's shape
                raise SweepInputError(
                    "model",
                    f"--model {config.model} cannot be built for --dataset {config.dataset} "
                    f"({_where(point)}): {type(exc).__name__}: {exc}",
                ) from None
            models.add(model_key)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]
