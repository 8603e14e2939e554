"""The files ``kfac-hpc plan`` writes, checked before any work is done (its profile is read by
the one capped reader of user files, contracts/textfile.py).

Outputs are checked up front (the folder exists and takes a new file, the name fits,
the target is a regular file or absent) and written atomically: each to a temp file in its
folder, all of them, then renamed over their targets; a failure leaves no temp file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from kfac_hpc.plan.errors import PlanInputError, shown

__all__ = ["check_output", "write_atomic"]


def check_output(field: str, text: str) -> Path:
    """The path ``text`` names (symbolic links followed), checked for a new or replaced
    regular file: PlanInputError naming ``field`` when it is empty, its folder is missing or
    not a folder or takes no new file, its name is too long, or it is something other than a
    regular file. Run before the work, so a bad path fails fast with nothing written."""
    if not text.strip():
        raise PlanInputError(field, "empty path; give a file name")
    if "\0" in text:
        raise PlanInputError(field, f"{shown(text)} contains a NUL byte; give a file name")
    path = Path(os.path.realpath(text))
    parent, name = path.parent, shown(str(path))
    try:
        folder = os.stat(parent)
    except FileNotFoundError:
        raise PlanInputError(
            field, f"folder {shown(str(parent))} does not exist; create it first"
        ) from None
    except OSError as exc:
        raise PlanInputError(field, f"cannot use {name}: {exc.strerror}") from None
    if not stat.S_ISDIR(folder.st_mode):
        raise PlanInputError(field, f"{shown(str(parent))} is not a folder; give a file path")
    try:
        longest = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    if len(os.fsencode(path.name)) > longest:
        raise PlanInputError(
            field, f"the file name is longer than {longest} bytes; give a shorter one"
        )
    try:
        target = os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise PlanInputError(field, f"cannot use {name}: {exc.strerror}") from None
    else:
        if stat.S_ISDIR(target.st_mode):
            raise PlanInputError(field, f"{name} is a folder; give a file name inside it")
        if not stat.S_ISREG(target.st_mode):
            raise PlanInputError(
                field, f"{name} is not a regular file (a device or pipe); give a file path"
            )
    try:  # can a new file be made there (a read-only or virtual file system: no)?
        os.unlink(_new_temp(parent)[1])
    except OSError as exc:
        raise PlanInputError(
            field,
            f"cannot make a file in {shown(str(parent))} ({exc.strerror}); give a path on a "
            "writable file system",
        ) from None
    return path


def _new_temp(folder: Path) -> tuple[int, str]:
    """A new empty temp file in ``folder`` (short name, mode 0666 less the umask)."""
    tmp = os.path.join(folder, f".kfac-hpc-plan.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    return fd, tmp


def write_atomic(files: Sequence[tuple[str, Path, bytes]]) -> None:
    """Write every ``(field, path, data)``: all to temp files first (synced), then each renamed
    over its path. PlanInputError naming the field on a failure; no temp file is left."""
    staged: list[tuple[str, Path, str]] = []
    current = ("", Path())
    try:
        for field, path, data in files:
            current = (field, path)
            fd, tmp = _new_temp(path.parent)
            staged.append((field, path, tmp))
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        while staged:
            field, path, tmp = staged[0]
            current = (field, path)
            os.replace(tmp, path)
            staged.pop(0)
    except OSError as exc:
        field, path = current
        raise PlanInputError(
            field, f"cannot write {shown(str(path))}: {exc.strerror or exc}"
        ) from None
    finally:
        for _, _, tmp in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
