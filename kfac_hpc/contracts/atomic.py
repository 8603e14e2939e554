"""Replace a small file atomically: a reader sees the old file or the whole new one.

Standard library only: shared by the job's records, the sweep manifest and the collector's
tables, which must not import each other.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_bytes_atomic", "write_text_atomic"]


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to a temp file beside ``path`` (unique per process), fsync it, rename it
    over ``path``. ``durable=False`` skips the fsync, for files that can be made again (a
    reader still sees the old or the whole new file; a power cut may lose the new one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"), durable=durable)
