"""Independent CPU work items run side by side, one intra-op thread each.

Some CPU work scales poorly over intra-op threads, LAPACK's ``eigh`` at K-FAC's factor sizes
above all (docs/kfac.md, "Performance notes"): several single-threaded items side by side on
the same cores finish sooner than the same items one after the other on every thread.

The pool has as many threads as the caller's intra-op thread count; each sets its own count
to one once, when it starts. ``torch.set_num_threads`` also sets process-wide state (the
default a new thread copies, and it clears oneDNN's computation cache), so the caller calls it
only when a pool is created: it holds one thread while all the pool's threads start, then
restores its count. Calls after that leave every thread setting alone.
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
    pool = _pool(threads, os.getpid())  # a forked child gets its own threads
    futures = [pool.submit(fn, item) for item in items]
    wait(futures)
    return [future.result() for future in futures]


@functools.lru_cache(maxsize=4)
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads that each run torch with one intra-op thread, all of them
    started (with the process-wide default held at one thread) before it is returned."""
    del pid  # part of the cache key only
    pool = ThreadPoolExecutor(workers, thread_name_prefix="kfac-host", initializer=_one_thread)
    started = threading.Barrier(workers, timeout=60)
    torch.set_num_threads(1)
    try:
        wait([pool.submit(started.wait) for _ in range(workers)])
    finally:
        torch.set_num_threads(workers)
    return pool


def _one_thread() -> None:
    """Give the calling thread one intra-op thread for good: torch sets a thread's count from
    the process-wide default on its first parallel work, so that happens first."""
    torch.get_num_threads()
    torch.set_num_threads(1)
