"""The intra-op threads of one rank: as many as the cores the rank was given, unless the user
said how many.

torch's default is every core of the machine in every rank, so N ranks on one node run N
times as many threads as cores and spend their time switching (docs/train.md, "Threads").
The count, in order of precedence: ``--threads``; ``OMP_NUM_THREADS``; Slurm's
``SLURM_CPUS_PER_TASK``; the cores this process may run on when the launcher bound it to
fewer than the machine has; else the machine's cores divided by the ranks on this node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["rank_threads", "set_rank_threads"]


def _positive(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def rank_threads(
    option: int | None,
    local_ranks: int,
    env: Mapping[str, str] | None = None,
    usable: int | None = None,
    machine: int | None = None,
) -> tuple[int, str]:
    """(threads, where the count came from) for a rank of ``local_ranks`` on its node;
    ``usable`` (the cores this process may run on) and ``machine`` (the node's cores) default
    to what the OS says."""
    env = os.environ if env is None else env
    if option is not None:
        return option, "--threads"
    for name in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        value = _positive(env.get(name))
        if value is not None:
            return value, name
    machine = machine or os.cpu_count() or 1
    if usable is None:
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    if usable < machine:
        return usable, "the cores the launcher bound the rank to"
    ranks = max(1, local_ranks)
    return max(1, machine // ranks), f"{machine} cores / {ranks} ranks on the node"


def set_rank_threads(option: int | None, local_ranks: int) -> dict[str, int | str]:
    """Set torch's intra-op threads for this rank; what run.json records of it."""
    threads, source = rank_threads(option, local_ranks)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return {"threads": threads, "threads_from": source}
