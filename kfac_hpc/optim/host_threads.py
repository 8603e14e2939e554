"""Independent CPU work items run side by side, one intra-op thread each.

Some CPU work scales poorly over intra-op threads, LAPACK's ``eigh`` at K-FAC's factor sizes
above all (docs/kfac.md, "Performance notes"): several single-threaded items side by side on
the same cores finish sooner than the same items one after the other on every thread.

The pool has as many threads as the caller's intra-op thread count. Each pool thread sets its
own count to one when it starts; as that also sets the process-wide default that new threads
copy, the caller sets one for the whole call (and restores its count after), and a new pool
starts all its threads inside that window, so no thread starts after the restore.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

__all__ = ["map_side_by_side"]

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_side_by_side(
    fn: Callable[[Item], Result], items: Sequence[Item], device: torch.device
) -> list[Result]:
    """``[fn(item) for item in items]`` in the items' order, run side by side on host threads
    when ``device`` is the CPU and more than one intra-op thread and item are there; in the
    caller's thread otherwise (a GPU queues its kernels anyway). Every item has finished when
    it returns or raises; an error raises the first failing item's exception."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    torch.set_num_threads(1)
    try:
        pool = _pool(threads, os.getpid())  # a forked child gets its own threads
        futures = [pool.submit(fn, item) for item in items]
        wait(futures)
    finally:
        torch.set_num_threads(threads)
    return [future.result() for future in futures]


@functools.lru_cache(maxsize=4)
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads that each run torch with one intra-op thread, all of them
    started before it is returned."""
    del pid  # part of the cache key only
    pool = ThreadPoolExecutor(
        workers, thread_name_prefix="kfac-host", initializer=torch.set_num_threads, initargs=(1,)
    )
    started = threading.Barrier(workers, timeout=60)
    wait([pool.submit(started.wait) for _ in range(workers)])
    return pool
