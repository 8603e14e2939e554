"""A typed, pickle-free mapping between nested Python state and an HDF5 group.

The mapping (every node carries its kind in the reserved attribute ``@kind``):

==============================  ==============================================================
Python value                    HDF5 object
==============================  ==============================================================
dict with str keys              group, ``@kind = "dict"``
dict with int keys              group, ``@kind = "intdict"`` (torch optimizer ``state``)
list / tuple of one number type dataset (bool, int64 or float64), ``@kind = "list" | "tuple"``
other list / tuple              group, ``@kind = "list" | "tuple"``, children named ``0, 1, ...``
torch.Tensor                    dataset, ``@kind = "tensor"``, ``@dtype = "float32" | ...``
numpy.ndarray                   dataset, ``@kind = "ndarray"``
None, bool, int, float, str     attribute of the parent (None is an HDF5 NULL attribute)
str longer than 16 KiB          uint8 dataset, ``@kind = "str"``
==============================  ==============================================================

Datasets with data are chunked and carry a Fletcher-32 checksum, verified by HDF5 on every read.
Files are written with format bounds v1.10, so object headers (and the attributes in them) carry
metadata checksums too and Debian's HDF5 1.10 tools (``h5ls``, ``h5dump``) read them. Tensors keep
their dtype and shape exactly: bfloat16 and float8 are stored bit for bit as int16/uint8 with
``@dtype`` naming the real type; 0-d tensors are stored with shape (1,) and ``@scalar = True``.
Keys are escaped so that any str is a valid HDF5 name: ``%`` → ``%25``, ``/`` → ``%2F``, a leading
``@`` → ``%40``, ``.`` → ``%2E`` and the empty key → ``%``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import h5py
import numpy as np
import torch

from kfac_hpc.checkpoint.chunk_io import ScratchBuffer, chunk_rows, read_array, write_array

__all__ = [
    "KIND",
    "TreeError",
    "escape_key",
    "read_tree",
    "unescape_key",
    "walk_datasets",
    "write_tree",
]

KIND = "@kind"
_DTYPE = "@dtype"
_SCALAR = "@scalar"
_LONG_STR_BYTES = 16 * 1024
_INT64 = np.iinfo(np.int64)
_UINT64 = np.iinfo(np.uint64)

# dtypes numpy cannot hold, stored bit for bit through an integer view of the same width
_BIT_VIEWS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BIT_VIEWS[getattr(torch, _name)] = torch.uint8
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


class TreeError(ValueError):
    """A value cannot be stored, or a stored node is not one this module wrote."""


def escape_key(key: str) -> str:
    """A valid, reversible HDF5 link/attribute name for ``key``."""
    if key == "":
        return "%"
    name = key.replace("%", "%25").replace("/", "%2F")
    if name.startswith("@"):
        name = "%40" + name[1:]
    return "%2E" if name == "." else name


def unescape_key(name: str) -> str:
    """Inverse of :func:`escape_key`."""
    return "" if name == "%" else unquote(name)


def _is_scalar(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, np.generic))


def _number_list_dtype(values: Sequence[Any]) -> type | None:
    """The numpy dtype a list of one plain number type is stored as, or None."""
    if not values:
        return None
    kinds = {type(v) for v in values}
    if kinds == {bool}:
        return np.bool_
    if kinds == {float}:
        return np.float64
    if kinds == {int} and all(_INT64.min <= v <= _INT64.max for v in values):
        return np.int64
    return None


@dataclass
class _Writer:
    """Settings and the staging buffer shared by one :func:`write_tree` call."""

    compression: str | None = None
    scratch: ScratchBuffer = field(default_factory=ScratchBuffer)


def _write_attr(group: h5py.Group, name: str, value: Any, path: str, w: _Writer) -> None:
    if isinstance(value, np.generic):
        value = value.item()
    if value is None:
        group.attrs[name] = h5py.Empty("i1")
    elif isinstance(value, bool):
        group.attrs[name] = np.bool_(value)
    elif isinstance(value, int):
        if _INT64.min <= value <= _INT64.max:
            group.attrs[name] = np.int64(value)
        elif 0 <= value <= _UINT64.max:
            group.attrs[name] = np.uint64(value)
        else:
            raise TreeError(f"{path}: int {value} does not fit in 64 bits")
    elif isinstance(value, float):
        group.attrs[name] = np.float64(value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        if b"\x00" in raw:
            raise TreeError(f"{path}: strings with NUL characters cannot be stored")
        if len(raw) > _LONG_STR_BYTES:
            ds = _create_dataset(group, name, np.frombuffer(raw, dtype=np.uint8), w)
            ds.attrs[KIND] = _fixed_str("str")
            return
        group.attrs.create(name, np.array(raw, dtype=h5py.string_dtype("utf-8", max(1, len(raw)))))
    else:
        raise TreeError(f"{path}: unsupported type {type(value).__name__}")


def _fixed_str(text: str) -> np.ndarray:
    raw = text.encode("utf-8")
    return np.array(raw, dtype=h5py.string_dtype("utf-8", max(1, len(raw))))


def _create_dataset(group: h5py.Group, name: str, array: np.ndarray, w: _Writer) -> h5py.Dataset:
    if array.size == 0:  # nothing to checksum; HDF5 cannot chunk a zero-length dimension
        return group.create_dataset(name, data=array)
    compression = w.compression
    if compression is None:
        return write_array(group, name, array, w.scratch)
    return group.create_dataset(
        name,
        data=array,
        chunks=(chunk_rows(array.shape, array.dtype.itemsize), *array.shape[1:]),
        fletcher32=True,
        compression=compression,
    )


def _tensor_array(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    view = _BIT_VIEWS.get(t.dtype)
    return (t.view(view) if view is not None else t).numpy()


def _write_dataset(
    group: h5py.Group, name: str, value: torch.Tensor | np.ndarray, w: _Writer
) -> None:
    if isinstance(value, torch.Tensor):
        array = _tensor_array(value)
        scalar = array.ndim == 0
        ds = _create_dataset(group, name, array.reshape(1) if scalar else array, w)
        ds.attrs[KIND] = _fixed_str("tensor")
        ds.attrs[_DTYPE] = _fixed_str(str(value.dtype).removeprefix("torch."))
        if scalar:
            ds.attrs[_SCALAR] = np.bool_(True)
        return
    if value.dtype.hasobject:
        raise TreeError(f"{group.name}/{name}: object arrays cannot be stored without pickle")
    scalar = value.ndim == 0
    ds = _create_dataset(group, name, value.reshape(1) if scalar else value, w)
    ds.attrs[KIND] = _fixed_str("ndarray")
    if scalar:
        ds.attrs[_SCALAR] = np.bool_(True)


def _write_child(group: h5py.Group, name: str, value: Any, w: _Writer) -> None:
    path = f"{group.name.rstrip('/')}/{name}"
    if isinstance(value, Mapping):
        sub = group.create_group(name, track_order=True)
        _write_group(sub, value, w)
    elif isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        dtype = _number_list_dtype(value)
        if dtype is not None:
            ds = _create_dataset(group, name, np.asarray(value, dtype=dtype), w)
            ds.attrs[KIND] = _fixed_str(kind)
            return
        sub = group.create_group(name, track_order=True)
        sub.attrs[KIND] = _fixed_str(kind)
        for index, item in enumerate(value):
            _write_child(sub, str(index), item, w)
    elif isinstance(value, (torch.Tensor, np.ndarray)):
        _write_dataset(group, name, value, w)
    elif _is_scalar(value):
        _write_attr(group, name, value, path, w)
    else:
        raise TreeError(f"{path}: unsupported type {type(value).__name__} (no pickle fallback)")


def write_tree(
    group: h5py.Group, tree: Mapping[Any, Any], *, compression: str | None = None
) -> None:
    """Write ``tree`` into the (empty) ``group``; keys must be all str or all int.

    ``compression`` ("gzip", "lzf") goes through HDF5's filter pipeline (slower); without it
    chunks are checksummed here and written directly (see chunk_io).
    """
    _write_group(group, tree, _Writer(compression))


def _write_group(group: h5py.Group, tree: Mapping[Any, Any], w: _Writer) -> None:
    keys = list(tree)
    if keys and all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        group.attrs[KIND] = _fixed_str("intdict")
        names = [str(k) for k in keys]
    elif all(isinstance(k, str) for k in keys):
        group.attrs[KIND] = _fixed_str("dict")
        names = [escape_key(k) for k in keys]
    else:
        raise TreeError(f"{group.name}: keys must be all str or all int, got {keys[:5]}")
    for name, value in zip(names, tree.values(), strict=True):
        _write_child(group, name, value, w)


def _decode_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _read_attr(value: Any) -> Any:
    if isinstance(value, h5py.Empty):
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    raise TreeError(f"unexpected attribute value {value!r}")


def _read_dataset(ds: h5py.Dataset) -> Any:
    kind = _decode_str(ds.attrs.get(KIND, b""))
    array = read_array(ds)  # verifies the Fletcher-32 checksum of every chunk
    if ds.attrs.get(_SCALAR, False):
        array = array.reshape(())
    if kind == "tensor":
        dtype = _TORCH_DTYPES.get(_decode_str(ds.attrs[_DTYPE]))
        if dtype is None:
            raise TreeError(f"{ds.name}: unknown tensor dtype {ds.attrs[_DTYPE]!r}")
        tensor = torch.from_numpy(np.require(array, requirements=["C", "W"]))
        return tensor.view(dtype) if dtype in _BIT_VIEWS else tensor
    if kind == "ndarray":
        return array
    if kind in ("list", "tuple"):
        items = array.tolist()
        return tuple(items) if kind == "tuple" else items
    if kind == "str":
        return array.tobytes().decode("utf-8")
    raise TreeError(f"{ds.name}: dataset without a known {KIND} attribute")


def read_tree(group: h5py.Group) -> Any:
    """Read a group written by :func:`write_tree` back into Python values."""
    kind = _decode_str(group.attrs.get(KIND, b"dict"))
    items: dict[str, Any] = {}
    for name, value in group.attrs.items():
        if not name.startswith("@"):
            items[name] = _read_attr(value)
    for name, obj in group.items():
        items[name] = read_tree(obj) if isinstance(obj, h5py.Group) else _read_dataset(obj)
    if kind == "dict":
        return {unescape_key(k): v for k, v in items.items()}
    if kind == "intdict":
        return {int(k): items[k] for k in sorted(items, key=int)}
    if kind in ("list", "tuple"):
        ordered = [items[str(i)] for i in range(len(items))]
        return tuple(ordered) if kind == "tuple" else ordered
    raise TreeError(f"{group.name}: unknown {KIND} {kind!r}")


def walk_datasets(group: h5py.Group) -> Iterator[h5py.Dataset]:
    """Every dataset under ``group``, depth first in stored order."""
    for obj in group.values():
        if isinstance(obj, h5py.Group):
            yield from walk_datasets(obj)
        elif isinstance(obj, h5py.Dataset):
            yield obj
