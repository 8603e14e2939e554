"""Replace a small text file atomically: a reader sees the old file or the whole new one.

Standard library only: shared by the job's records, the sweep manifest and the collector's
tables, which must not import each other.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path`` (unique per process), fsync it, rename it
    over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
