"""The resident-set probe of the memory benchmarks: this process's ``/proc/self/status``
figures and a reset of its high-water mark (``VmHWM``), Linux only."""

from __future__ import annotations

import gc
from pathlib import Path


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``, ...) in KiB, as the kernel gives it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {field}")


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes."""
    return status_kib(field) * 1024


def reset_peak() -> None:
    """Collect garbage, then reset ``VmHWM`` to the current resident set (``clear_refs`` 5)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
