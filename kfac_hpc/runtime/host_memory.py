"""Keep freed host memory in the process for reuse (glibc malloc).

By default glibc gives a large freed block back to the kernel (its own mapping, or a trim of
the heap's top), so the next large allocation faults fresh zeroed pages in, one by one. A
training step allocates and frees the same large tensors every step; on ResNet-32 (2 CPU
threads) that was 16,000–23,000 page faults a step. Raising glibc's mapping threshold to its
largest value and never trimming makes freed blocks stay in the heap for the next step (the
peak resident set, which a step reaches anyway, is unchanged).
Other allocators (jemalloc, tcmalloc, mimalloc through ``LD_PRELOAD``) and a user's own
``MALLOC_*``/``GLIBC_TUNABLES`` settings are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

from kfac_hpc.contracts.records import HostMemory

__all__ = ["allocator_owner", "huge_pages_enabled", "keep_freed_host_memory"]

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mapping threshold on 64-bit systems: bigger blocks still get their own mapping.
_MMAP_THRESHOLD_BYTES = 32 << 20
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: the largest
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
# torch's CPU allocator asks for transparent huge pages for allocations of 2 MiB or more when
# this is "1" in the environment it started with (read once, at its first allocation)
_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def allocator_owner(environ: Mapping[str, str] = os.environ) -> HostMemory | None:
    """Why this process's allocator is not for :func:`keep_freed_host_memory` to set up
    (``ENVIRONMENT`` or ``UNSUPPORTED``), or None when it is glibc's, unconfigured. Changes
    nothing."""
    preload = environ.get("LD_PRELOAD", "")
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(name in environ for name in _ENVIRONMENT) or "glibc.malloc." in tunables:
        return HostMemory.ENVIRONMENT
    if any(allocator in preload for allocator in _ALLOCATORS):
        return HostMemory.ENVIRONMENT
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return HostMemory.UNSUPPORTED
    return None


def keep_freed_host_memory(environ: Mapping[str, str] = os.environ) -> HostMemory:
    """Make glibc keep freed memory for reuse (see the module docstring) unless ``environ``
    (this process's environment) configures the allocator; returns the state this process is
    in (``KEPT``, ``ENVIRONMENT`` or ``UNSUPPORTED``; a job that does not call it is in
    ``DEFAULT``). Process-wide and for the rest of the process: call it once, early."""
    owner = allocator_owner(environ)
    if owner is not None:
        return owner
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return HostMemory.UNSUPPORTED
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mapped = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    trimmed = mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    kept = mapped == 1 and trimmed == 1
    return HostMemory.KEPT if kept else HostMemory.UNSUPPORTED


def huge_pages_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torch's large CPU allocations use transparent huge pages in a process started
    with ``environ`` (``THP_MEM_ALLOC_ENABLE=1``; off by default, docs/train.md "Host
    memory"): what run.json records as ``huge_pages``."""
    return environ.get(_HUGE_PAGES, "").strip() == "1"
