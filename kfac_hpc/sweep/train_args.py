"""The ``kfac-hpc train`` arguments of a point: how the sweep starts its job (the job checks
them through its one seam, :mod:`kfac_hpc.sweep.job_checks`), and the point's group hash."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from kfac_hpc.contracts.options import OPTIONS

__all__ = ["NOT_TRAIN", "group_hash", "train_argv"]

# Point parameters that describe the allocation or the repetition, not the training config.
NOT_TRAIN = {"nodes", "ranks_per_node", "gpus_per_node", "cpus_per_task", "repeat", "extra_args"}


def train_argv(params: Mapping[str, Any]) -> list[str]:
    """Flags for ``kfac-hpc train`` (without ``--run-dir``), in a stable order.

    A boolean option becomes ``--name``/``--no-name``; lists are comma-joined; other values
    ``--name value`` with ``_`` → ``-``; ``extra_args`` are appended verbatim (they are quoted
    when rendered into a script).
    """
    argv: list[str] = []
    for name in sorted(params):
        if name in NOT_TRAIN:
            continue
        value, flag = params[name], f"--{name.replace('_', '-')}"
        option = OPTIONS.get(name)
        if option is not None and option.kind == "bool":
            argv.append(flag if value else f"--no-{flag[2:]}")
        else:
            argv += [flag, _format(value)]
    argv += [str(a) for a in params.get("extra_args", ())]
    return argv


def _format(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list | tuple):
        return ",".join(_format(v) for v in value)
    return str(value)


def group_hash(params: Mapping[str, Any]) -> str:
    """Hash of the point's parameters without the repeat index: repeats of one configuration
    share it, so the collector can group them. (Not the job's ``config_hash``, which hashes
    the whole resolved config.)"""
    train = {k: v for k, v in params.items() if k not in ("repeat",)}
    return hashlib.sha256(json.dumps(train, sort_keys=True).encode()).hexdigest()[:12]
