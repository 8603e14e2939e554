"""What ``kfac-hpc train`` would refuse, asked before it is started: the one seam between the
job and the code that starts it as a command (the sweep, ``kfac_hpc/sweep/job_checks.py``).

A caller hands over train arguments (a command line without ``--run-dir``, which the caller
chooses) and gets back the job's own :class:`~kfac_hpc.contracts.errors.InputError`, with the
job's field and message: the arguments are parsed by the ``kfac-hpc train`` command's own
flags, then validated by :func:`~kfac_hpc.train.config.load_config` and the checks the job
makes at its world size. The caller needs to know nothing of the job's config, data or models;
it reaches this module by name, so it imports no module of ``kfac_hpc.train``.

Two fields are the seam's own: :data:`ARGUMENTS` (the train command's parser refuses the
arguments: an unknown flag, a value of the wrong type, a stray word) and :data:`RUN_DIR` (the
arguments name a ``--run-dir``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.train.config import TrainConfig, load_config

__all__ = ["ARGUMENTS", "RUN_DIR", "check_loadable", "check_train_args"]

ARGUMENTS = "arguments"
RUN_DIR = "run_dir"

# Stands for the run directory the caller gives the run.
_RUN_DIR = "CALLER/RUN_DIR"


def _config(argv: Sequence[str]) -> TrainConfig:
    """The TrainConfig ``kfac-hpc train --run-dir DIR ARGV`` makes: its flags parsed by the
    train command itself, then :func:`load_config`."""
    from kfac_hpc.train.cli import train

    try:
        # help_option_names=[]: a --help among the arguments is refused, never printed.
        ctx = train.make_context(
            "kfac-hpc train", ["--run-dir", _RUN_DIR, *argv], help_option_names=[]
        )
    except click.ClickException as exc:  # an unknown flag, a value of the wrong type...
        raise InputError(ARGUMENTS, " ".join(exc.format_message().split())) from None
    params: dict[str, Any] = dict(ctx.params)
    if params.pop("run_dir") != _RUN_DIR:
        raise InputError(RUN_DIR, "the caller gives the run directory; remove --run-dir")
    return load_config(params.pop("config_file"), params)


def check_train_args(argv: Sequence[str], world_size: int) -> None:
    """InputError, the job's own, when ``kfac-hpc train --run-dir DIR ARGV`` would refuse to
    start at ``world_size`` ranks (before it loads any data)."""
    config = _config(argv)
    config.batch_sizes(world_size)
    config.check_world_size(world_size)
    config.grad_worker_share(world_size)


def check_loadable(argvs: Sequence[Sequence[str]]) -> tuple[int, InputError] | None:
    """Load the dataset and build the model of every command line (each distinct workload
    once, its factories imported and called as the job calls them at rank 0 of 1; torch is
    imported): the position of the first that cannot, and why (the flag to fix); None when
    all can. The arguments are valid (:func:`check_train_args`)."""
    from kfac_hpc.train.workloads import build_model, load_data

    datasets: dict[str, tuple[tuple[int, ...], int]] = {}
    models: set[str] = set()
    for index, argv in enumerate(argvs):
        config = _config(argv)
        record = _workload_key(config)
        try:
            if record["dataset"] not in datasets:
                data = load_data(config)
                datasets[record["dataset"]] = (data.shape, data.num_classes)
            shape, classes = datasets[record["dataset"]]
            if record["model"] + record["dataset"] not in models:
                build_model(config, shape, classes)
                models.add(record["model"] + record["dataset"])
        except InputError as exc:
            return index, exc
    return None


def _workload_key(config: TrainConfig) -> dict[str, str]:
    """What decides a run's data and model, as text: the same text, the same workload."""
    fields = {
        "dataset": ("dataset", "dataset_arg", "data_path", "num_samples", "context_length"),
        "model": (
            *("model", "model_arg", "cnn1d_channels", "context_length"),
            *("gpt_layers", "gpt_d_model", "gpt_heads", "gpt_tied"),
        ),
    }
    return {kind: repr([getattr(config, f) for f in names]) for kind, names in fields.items()}
