"""Independent CPU work items run side by side, one intra-op thread each.

LAPACK's ``eigh`` scales poorly over threads at K-FAC's factor sizes (much of the tridiagonal
reduction is memory-bound level-2 BLAS), and ``inv`` below n ≈ 1000 (1.69× on 2 threads at
n = 576, 1.98× at 1024). Two single-threaded decompositions side by
side on two cores finish well before the same work run one after the other on two threads
each: ResNet-32's 68 factors take 87 ms against 123 ms on a 2-core machine (docs/kfac.md).

The pool has as many threads as the caller's intra-op thread count; each runs its items with
one intra-op thread, and the caller's own count is set to one while it waits (MKL may read a
process-wide count) and restored after. Results keep the order of the items, so callers that
sort items largest first get a balanced schedule and the same results in the same places.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["map_side_by_side"]

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_side_by_side(
    fn: Callable[[Item], Result], items: Sequence[Item], device: torch.device
) -> list[Result]:
    """``[fn(item) for item in items]``, run side by side on host threads when ``device`` is
    the CPU and more than one intra-op thread is available; in order otherwise (a GPU queues
    its kernels anyway). Exceptions propagate as from the plain loop."""
    workers = min(torch.get_num_threads(), len(items))
    if device.type != "cpu" or workers <= 1:
        return [fn(item) for item in items]
    pool = _pool(workers, os.getpid())  # a forked child gets its own threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return list(pool.map(fn, items))
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=4)
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads that each run torch with one intra-op thread."""
    del pid  # part of the cache key only
    return ThreadPoolExecutor(
        workers, thread_name_prefix="kfac-host", initializer=torch.set_num_threads, initargs=(1,)
    )
