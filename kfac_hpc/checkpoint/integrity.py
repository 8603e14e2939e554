"""The integrity record of a checkpoint file: one checksum over everything a resume trusts.

Fletcher-32 covers each dataset's chunks, and HDF5's metadata checksums catch a damaged object
header; neither notices a file that a tool changed *consistently*: an attribute rewritten
(``step`` 20 → 35, so a resume would pair step 35 with step 20's weights), a dataset deleted or
added. So the writer stores, as the root attribute ``integrity``, a SHA-256 over the canonical
encoding of the state tree it wrote: every key, the type and value of every attribute (``step``,
``world_size``, ``config_hash``, ``config_json``, ``schema_version``, the data position, ...;
the lists of numbers stored as datasets too) and the dtype and shape of every tensor and array
(their data is Fletcher-32's). The reader computes the same over the tree it read and refuses
the file when they differ. The tree is the file as :func:`~kfac_hpc.checkpoint.hdf5_tree.
read_tree` gives it back, minus the root's ``complete`` and ``integrity``; the writer encodes
the tree it hands to ``write_tree``, which reads back equal (the mapping is exact), so no second
pass over the file is needed on either side.

Files of schema version 1 predate the record and are read without it; from version 2 a file
without the record is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["INTEGRITY", "INTEGRITY_SCHEME", "UNCOVERED", "integrity_digest"]

INTEGRITY = "integrity"
INTEGRITY_SCHEME = "sha256-tree-v1"
# Root attributes outside the digest: set after it (``complete`` last of all).
UNCOVERED = frozenset({"complete", INTEGRITY})


def _key(key: Any) -> bytes:
    text = str(key).encode("utf-8")
    return (b"i" if isinstance(key, int) else b"s") + b"%d:" % len(text) + text


def _feed(update: Any, value: Any) -> None:
    """Feed the canonical encoding of ``value`` (type-tagged, length-prefixed) to ``update``."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, Mapping):
        keys = sorted(value, key=lambda k: (isinstance(k, int), str(k)))
        update(b"{%d" % len(keys))
        for key in keys:
            update(_key(key))
            _feed(update, value[key])
        update(b"}")
    elif isinstance(value, (list, tuple)):
        update(b"(%d" % len(value) if isinstance(value, tuple) else b"[%d" % len(value))
        for item in value:
            _feed(update, item)
        update(b"]")
    elif isinstance(value, torch.Tensor):
        update(f"T{value.dtype}{tuple(value.shape)}".encode())
    elif isinstance(value, np.ndarray):
        update(f"A{value.dtype.name}{value.shape}".encode())
    elif value is None:
        update(b"N")
    elif isinstance(value, bool):
        update(b"B1" if value else b"B0")
    elif isinstance(value, int):
        update(b"I%d;" % value)
    elif isinstance(value, float):
        update(b"F" + value.hex().encode() + b";")
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        update(b"S%d:" % len(raw) + raw)
    else:  # write_tree refuses anything else; a reader never produces it
        raise TypeError(f"no canonical encoding for {type(value).__name__}")


def integrity_digest(tree: Mapping[str, Any]) -> str:
    """``INTEGRITY_SCHEME:hex`` of a checkpoint's state tree (its root mapping, ``ranks``
    included), leaving out the root entries of :data:`UNCOVERED`."""
    sha = hashlib.sha256()
    _feed(sha.update, {k: v for k, v in tree.items() if k not in UNCOVERED})
    return f"{INTEGRITY_SCHEME}:{sha.hexdigest()}"
