"""A user's own training script as input (``kfac-hpc sweep --script``, ``kfac-hpc script``):
one check for the sweep, before anything is submitted, and for the command that runs it.

The script must be a readable UTF-8 file named ``*.py`` that compiles; a failure is one
:class:`~kfac_hpc.contracts.errors.InputError` naming the option and the file. Standard library
only (the sweep checks without importing torch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.textfile import read_user_text

__all__ = ["MAX_SCRIPT_BYTES", "check_script"]

MAX_SCRIPT_BYTES = 16 << 20  # a training script is a few KiB; anything near this is not one


def check_script(
    path: str | Path,
    option: str = "--script",
    *,
    error: Callable[[str, str], InputError] = InputError,
) -> Path:
    """The script's absolute path; ``error(option, reason)`` unless ``path`` is a readable
    Python file (``.py``, UTF-8, compiles)."""
    script = Path(path)
    if script.suffix != ".py":
        raise error(option, f"{path} is not a Python file; give a script named *.py")
    source = read_user_text(script, option, max_bytes=MAX_SCRIPT_BYTES, error=error)
    try:
        compile(source, str(script), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise error(option, f"{path} line {exc.lineno}: {exc.msg}; fix the script") from None
    except ValueError as exc:  # NUL bytes in the source
        raise error(option, f"{path} is not Python source ({exc})") from None
    return script.resolve()
