"""The one reader of a text file a user names on the command line (``train --config``,
``sweep --profile``, ``sweep --template``, ``plan --profile``).

It reads at most a size cap (``/dev/zero`` or a huge file is refused, not read until memory runs
out), decodes UTF-8 (a leading byte-order mark is dropped) and turns every failure into one
:class:`~kfac_hpc.contracts.errors.InputError` naming the option and the file: no traceback.
Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kfac_hpc.contracts.errors import InputError

__all__ = ["MAX_TEXT_BYTES", "read_user_text"]

# Config files, profiles and templates are a few KiB; a mebibyte is far beyond any of them.
MAX_TEXT_BYTES = 1 << 20


def _shown(path: str | Path) -> str:
    """The path as a message shows it: as is when printable, else its ``repr`` (one line)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def read_user_text(
    path: str | Path,
    option: str,
    *,
    max_bytes: int = MAX_TEXT_BYTES,
    error: Callable[[str, str], InputError] = InputError,
) -> str:
    """The UTF-8 text of the file ``path`` given as ``option``.

    Raises ``error(option, reason)`` (an :class:`InputError` or a subclass: a command family
    passes its own) when the file cannot be opened or read, holds more than ``max_bytes``
    bytes, or is not UTF-8; the reason names the file and the fix.
    """
    name = _shown(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except IsADirectoryError:
        raise error(option, f"{name} is a directory; give a file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or str(exc)
        raise error(option, f"cannot read {name}: {reason}") from None
    except MemoryError:
        raise error(option, f"cannot read {name}: out of memory") from None
    if len(data) > max_bytes:
        size = f"{max_bytes} bytes"
        for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if max_bytes >= scale:
                size = f"{max_bytes / scale:g} {unit}"
                break
        raise error(option, f"{name} is larger than {size}; give a text file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(
            option, f"{name} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from None
