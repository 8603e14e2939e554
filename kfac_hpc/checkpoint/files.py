"""Checkpoint files on disk: opening HDF5, atomic publication, the `latest` pointer, retention.

Atomicity protocol (POSIX; also what Lustre/GPFS guarantee for a rename within one folder):

1. write everything to ``.ckpt-<step>.h5.tmp-<pid>`` in the checkpoint folder (same file system);
2. set the root attribute ``complete = True`` last, close the file (HDF5 flushes), ``fsync`` it;
3. ``rename`` it to ``ckpt-<step>.h5`` and ``fsync`` the folder, so the name survives a crash;
4. write ``latest`` the same way (temporary file, fsync, rename, fsync folder).

A crash before 3 leaves only a temporary file, which no reader looks at and the next writer
removes; a crash between 3 and 4 leaves a complete file the loader still finds by scanning.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import h5py

__all__ = [
    "CHECKPOINT_RE",
    "LATEST",
    "checkpoint_name",
    "checkpoint_step",
    "fsync_path",
    "list_checkpoints",
    "locking_mode",
    "open_h5",
    "prune",
    "read_latest",
    "remove_stale_temporaries",
    "write_atomic_h5",
    "write_latest",
]

LATEST = "latest"
CHECKPOINT_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")
_TMP_RE = re.compile(r"^\.(ckpt-\d{8,}\.h5|latest)\.tmp-\d+$")
# The oldest format whose object headers carry checksums, and the newest Debian's tools read.
LIBVER = ("v110", "v110")


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after ``step`` optimizer steps."""
    return f"ckpt-{step:08d}.h5"


def checkpoint_step(path: Path) -> int | None:
    """The step in a checkpoint file name, or None if it is not one."""
    match = CHECKPOINT_RE.match(path.name)
    return int(match.group(1)) if match else None


def locking_mode(locking: bool | str | None = None) -> bool | str:
    """HDF5 file locking to use: explicit value, else ``HDF5_USE_FILE_LOCKING``, else best effort.

    Best effort locks where the file system supports it and carries on where it does not
    (parallel file systems); checkpoints never need a lock for safety since each file is
    written once under a private name and published by rename.
    """
    if locking is not None:
        return locking
    env = os.environ.get("HDF5_USE_FILE_LOCKING", "").strip().upper()
    if env in ("FALSE", "0", "NO"):
        return False
    if env in ("TRUE", "1", "YES"):
        return True
    return "best-effort"


def open_h5(path: Path, mode: str, locking: bool | str | None = None) -> h5py.File:
    """Open an HDF5 file with the project's format bounds and locking policy."""
    return h5py.File(path, mode, libver=LIBVER, locking=locking_mode(locking), track_order=True)


def fsync_path(path: Path) -> None:
    """Flush a file's data, or (for a directory) make a rename in it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic_h5(
    path: Path, fill: Callable[[h5py.File], None], locking: bool | str | None = None
) -> Path:
    """Create ``path`` atomically: ``fill`` writes the content into a temporary file first.

    The root attribute ``complete`` is False while filling and set True as the last write.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open_h5(tmp, "w", locking) as h5:
            h5.attrs["complete"] = False
            fill(h5)
            h5.attrs["complete"] = True
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_path(path.parent)
    return path


def write_latest(directory: Path, name: str) -> None:
    """Point ``directory/latest`` at the checkpoint file ``name`` (atomically)."""
    tmp = directory / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.replace(tmp, directory / LATEST)
    except OSError as exc:  # e.g. a directory named `latest`: readers fall back to the newest
        tmp.unlink(missing_ok=True)
        warnings.warn(f"cannot update {directory / LATEST}: {exc}", stacklevel=2)
        return
    fsync_path(directory)


def read_latest(directory: Path) -> Path | None:
    """The file ``latest`` names, if it names a checkpoint in ``directory``."""
    try:
        name = (directory / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):  # absent, a directory, unreadable: no pointer
        return None
    if not CHECKPOINT_RE.match(name):
        return None
    return directory / name


def list_checkpoints(directory: Path) -> list[Path]:
    """Published checkpoint files in ``directory``, newest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if CHECKPOINT_RE.match(p.name) and p.is_file()]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0, reverse=True)


def prune(directory: Path, keep: int, protect: Path) -> list[Path]:
    """Keep ``protect`` (the checkpoint just written and verified) and the ``keep - 1`` newest
    older ones; delete the older rest. Files of later steps (left by an earlier attempt that
    a resume could not use) are not counted and not deleted. Returns what went."""
    step = checkpoint_step(protect) or 0
    older = [p for p in list_checkpoints(directory) if (checkpoint_step(p) or 0) < step]
    removed = []
    for old in older[max(0, keep - 1) :]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()
        removed.append(old)
    return removed


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Delete temporary files left by writers that died (call before writing, on the writer)."""
    if not directory.is_dir():
        return []
    stale = [entry for entry in directory.iterdir() if _TMP_RE.match(entry.name)]
    for entry in stale:
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
    return stale
