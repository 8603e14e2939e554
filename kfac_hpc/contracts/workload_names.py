"""What ``--model`` and ``--dataset`` accept: the three ways to name a workload's factory.

- a registered name: the built-ins (:data:`BUILTIN_MODELS`, :data:`BUILTIN_DATASETS`) and the
  entry points of installed packages in the group ``kfac_hpc.workloads``, named
  ``model.NAME`` or ``dataset.NAME`` (``model.mycnn = mypkg.models:build``);
- ``package.module:callable``, an importable module and a callable in it;
- ``path/to/file.py:callable`` (a name ending ``.py``), a Python file and a callable in it.

Every name comes down to a :class:`Reference` (a module or a file, and an attribute): the
built-ins are references into the package, resolved like any other. Torch-free and import-free:
nothing named is imported here (the job's ``kfac_hpc.train.workloads`` does that).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.options import DATASETS, MODELS

__all__ = [
    "BUILTIN_DATASETS",
    "BUILTIN_MODELS",
    "ENTRY_POINT_GROUP",
    "KINDS",
    "Reference",
    "absolute_name",
    "installed",
    "parse_reference",
    "registered",
    "short_name",
]

ENTRY_POINT_GROUP = "kfac_hpc.workloads"
KINDS = ("model", "dataset")  # the option each kind of factory is named by

# The built-ins, registered like an installed package's entry points.
BUILTIN_MODELS: dict[str, str] = {name: f"kfac_hpc.train.models:{name}" for name in MODELS}
BUILTIN_DATASETS: dict[str, str] = {name: f"kfac_hpc.train.data:{name}" for name in DATASETS}
_BUILTINS = {"model": BUILTIN_MODELS, "dataset": BUILTIN_DATASETS}

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class Reference:
    """A factory's address: ``module`` (dotted) or ``file`` (a .py path), and ``attr`` in it;
    ``name`` is what the user wrote (recorded as the workload's name)."""

    name: str
    attr: str
    module: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.module or self.file}:{self.attr}"


@functools.cache
def installed() -> dict[str, dict[str, str]]:
    """kind -> {name: ``module:attr``} of the installed packages' entry points (read once)."""
    found: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        kind, _, name = entry.name.partition(".")
        if kind in found and name:
            found[kind][name] = entry.value
    return found


def registered(kind: str) -> dict[str, str]:
    """Every name ``--model`` (``kind`` "model") or ``--dataset`` accepts as a word: the
    built-ins first, then the installed packages' (a built-in's name cannot be taken)."""
    return {**installed()[kind], **_BUILTINS[kind]}


def parse_reference(kind: str, name: str) -> Reference:
    """The factory ``name`` names (``kind``: model or dataset); InputError naming the option
    when it is no registered name and no ``module:callable`` or ``file.py:callable``."""
    target = registered(kind).get(name)
    if target is None and ":" not in name:
        known = ", ".join(registered(kind))
        raise InputError(
            kind,
            f"{name!r} is not a registered {kind} ({known}); or give module:callable or "
            "file.py:callable",
        )
    where, _, attr = (target or name).rpartition(":")
    if not _DOTTED.fullmatch(attr):
        raise InputError(kind, f"{name!r}: {attr!r} after ':' is not a Python name")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise InputError(kind, f"{name!r}: {where!r} is not a file")
        return Reference(name, attr, file=where)
    if not _DOTTED.fullmatch(where):
        raise InputError(kind, f"{name!r}: {where!r} is not a module name nor a .py file")
    return Reference(name, attr, module=where)


def absolute_name(name: str) -> str:
    """``name`` with a relative ``file.py`` made absolute (a job may start in another folder);
    every other name as it is."""
    where, sep, attr = name.rpartition(":")
    if sep and where.endswith(".py") and not Path(where).is_absolute():
        return f"{Path(where).resolve()}:{attr}"
    return name


def short_name(name: str) -> str:
    """``name`` as a label: a file reference by the file's name (``my_model.py:build``)."""
    where, sep, attr = name.rpartition(":")
    return f"{Path(where).name}:{attr}" if sep and where.endswith(".py") else name
