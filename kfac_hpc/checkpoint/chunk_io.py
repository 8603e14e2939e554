"""Fast checksummed dataset I/O: HDF5's Fletcher-32 filter format, computed with numpy.

HDF5's own Fletcher-32 filter runs at ~0.1 GB/s (a byte loop, plus a copy per chunk), which
made checkpoint writes 5-10x slower than the disk. Here the checksum is computed vectorised
(about 4 GB/s on one core of the development machine, from memory; 10 GB/s on two from cache)
and chunks go to/from the file with ``H5Dwrite_chunk``/``H5Dread_chunk``: the
bytes on disk are exactly what the filter would have produced (data + 4-byte little-endian
checksum), so h5py, ``h5dump`` and every HDF5 reader verify them the usual way.

Layout: C-contiguous arrays are split along the first axis into ≤ 64 MiB chunks of equal rows
(a partial last chunk is zero-padded, as HDF5 stores edge chunks).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np

__all__ = [
    "CHUNK_BYTES",
    "ChecksumError",
    "ScratchBuffer",
    "checksummed_copy",
    "chunk_rows",
    "fletcher32",
    "read_array",
    "write_array",
]

CHUNK_BYTES = 64 * 1024 * 1024
_MOD = 65535
# (n - r) mod 65535 only depends on r mod 65535: fold the words into 65535 column sums first.
_COLUMNS = np.arange(_MOD, dtype=np.int64)
_ROW = 2 * _MOD  # bytes of one row of 65535 words
# Rows whose byte sums a uint16 holds (256 · 255 < 2**16): numpy sums bytes into uint16 twice
# as fast as it sums big-endian words into int64.
GROUP_ROWS = 256
# From this size on, the main thread splits a checksum with one helper thread. A background
# thread (an asynchronous checkpoint) never does, so it takes at most one core from training.
SPLIT_BYTES = 8 * 1024 * 1024
_BLOCK_ROWS = 8  # rows copied and summed at a time (1 MiB: stays in L2)
_helper: ThreadPoolExecutor | None = None


class ChecksumError(OSError):
    """A chunk's stored Fletcher-32 checksum does not match its data."""


def _fold(sum_: int, nonzero: bool) -> int:
    """HDF5's end-around-carry reduction to 16 bits: 0 only for an all-zero input."""
    return (sum_ - 1) % _MOD + 1 if nonzero else 0


def _byte_columns(rows: np.ndarray, into: np.ndarray | None) -> np.ndarray:
    """Σ over the rows of ``rows`` (r, _ROW) uint8, per byte position, as int64. With ``into``
    (the same shape) the rows are copied there first, a block at a time, and each block is
    summed while it is still in cache."""
    sums = np.zeros(_ROW, dtype=np.int64)
    group = np.zeros(_ROW, dtype=np.uint16)
    in_group = 0
    for start in range(0, len(rows), _BLOCK_ROWS):
        block = rows[start : start + _BLOCK_ROWS]
        if into is not None:
            into[start : start + len(block)] = block
            block = into[start : start + len(block)]
        if in_group + len(block) > GROUP_ROWS:
            sums += group
            group[:] = 0
            in_group = 0
        group += np.add.reduce(block, axis=0, dtype=np.uint16)
        in_group += len(block)
    return sums + group


def _row_columns(rows: np.ndarray, into: np.ndarray | None) -> np.ndarray:
    """:func:`_byte_columns`, the two halves side by side when the caller is the main thread
    and ``rows`` holds at least :data:`SPLIT_BYTES` (numpy releases the GIL)."""
    if rows.nbytes < SPLIT_BYTES or threading.current_thread() is not threading.main_thread():
        return _byte_columns(rows, into)
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(1, thread_name_prefix="kfac-hpc-checksum")
    half = len(rows) // 2
    first = _helper.submit(_byte_columns, rows[:half], None if into is None else into[:half])
    second = _byte_columns(rows[half:], None if into is None else into[half:])
    return first.result() + second


def _checksum(raw: np.ndarray, words: int, into: np.ndarray | None) -> int:
    """Fletcher-32 of ``words`` 16-bit words: the bytes ``raw`` then zeros (copied into
    ``into``, which must hold ``raw``, when given)."""
    full = raw.size // _ROW * _ROW
    tail = raw[full:]
    if into is not None:
        into[full : raw.size] = tail
    if tail.size % 2:
        tail = np.concatenate([tail, np.zeros(1, dtype=np.uint8)])
    tail_words = tail.view(">u2")
    if full:
        rows = raw[:full].reshape(-1, _ROW)
        byte_sums = _row_columns(rows, None if into is None else into[:full].reshape(rows.shape))
        columns = 256 * byte_sums[0::2] + byte_sums[1::2]
        columns[: tail_words.size] += tail_words
    else:  # fewer than 65535 words: one per column, and no 65535-wide pass for a small tensor
        columns = tail_words.astype(np.int64)
    sum1 = int(columns.sum())
    # each term < 65535 * (n / 65535 + 1) * 65535: int64 holds it for chunks up to ~100 GB
    sum2 = int((columns % _MOD * ((words - _COLUMNS[: columns.size]) % _MOD)).sum() % _MOD)
    nonzero = sum1 != 0
    return (_fold(sum2, nonzero) << 16) | _fold(sum1, nonzero)


def fletcher32(data: memoryview | bytes | np.ndarray) -> int:
    """HDF5's ``H5_checksum_fletcher32`` of ``data`` (big-endian 16-bit words, odd byte padded).

    With words w_0..w_{n-1}: sum1 = Σ w_i, sum2 = Σ (n - i)·w_i, both mod 65535 with HDF5's
    representation (in 1..65535 unless all words are zero); result ``sum2 << 16 | sum1``.
    Word i adds to column i mod 65535; a column's sum is 256 · Σ high bytes + Σ low bytes.
    """
    raw = np.frombuffer(data, dtype=np.uint8)
    return _checksum(raw, -(-raw.size // 2), None)


def checksummed_copy(source: np.ndarray, target: np.ndarray) -> int:
    """Copy the bytes ``source`` into ``target`` (uint8, at least as long), zero the rest of
    ``target``, and return :func:`fletcher32` of ``target``: one pass over the data."""
    if not target.flags.c_contiguous or target.size < source.size:
        raise ValueError("checksummed_copy: target must be contiguous and hold the source")
    target[source.size :] = 0
    return _checksum(source, -(-target.size // 2), target)


def chunk_rows(shape: tuple[int, ...], itemsize: int) -> int:
    """Rows (first-axis entries) per chunk: equal chunks of at most :data:`CHUNK_BYTES`."""
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    nchunks = -(-shape[0] * row_bytes // CHUNK_BYTES)
    return max(1, -(-shape[0] // max(1, nchunks)))


class ScratchBuffer:
    """One reusable staging buffer for chunk + checksum; fresh large allocations would cost a
    page fault per 4 KiB on every dataset, which showed up as half the write time."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if self._buffer.size < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes]


def write_array(
    group: h5py.Group, name: str, array: np.ndarray, scratch: ScratchBuffer | None = None
) -> h5py.Dataset:
    """Create ``group[name]`` (chunked, Fletcher-32) holding ``array`` (non-empty, ndim ≥ 1)."""
    array = np.ascontiguousarray(array)
    rows = chunk_rows(array.shape, array.dtype.itemsize)
    chunk_shape = (rows, *array.shape[1:])
    ds = group.create_dataset(
        name, shape=array.shape, dtype=array.dtype, chunks=chunk_shape, fletcher32=True
    )
    flat = array.reshape(-1).view(np.uint8)
    chunk_bytes = rows * (flat.size // array.shape[0])
    buffer = (scratch or ScratchBuffer()).get(chunk_bytes + 4)
    zeros = (0,) * (array.ndim - 1)
    for start in range(0, array.shape[0], rows):
        part = flat[start * (flat.size // array.shape[0]) :][:chunk_bytes]
        checksum = checksummed_copy(part, buffer[:chunk_bytes])  # a partial edge chunk: zeros
        buffer[chunk_bytes:] = np.frombuffer(checksum.to_bytes(4, "little"), dtype=np.uint8)
        ds.id.write_direct_chunk((start, *zeros), buffer)
    return ds


def _fast_readable(ds: h5py.Dataset) -> bool:
    """Chunked along the first axis only, with Fletcher-32 as the only filter (what we write)."""
    chunks = ds.chunks
    return (
        chunks is not None
        and ds.fletcher32
        and ds.id.get_create_plist().get_nfilters() == 1
        and tuple(chunks[1:]) == tuple(ds.shape[1:])
        and ds.size > 0
    )


def read_array(ds: h5py.Dataset) -> np.ndarray:
    """The whole dataset, each chunk's checksum verified; :class:`ChecksumError` if one fails.

    Datasets this module did not write fall back to h5py (HDF5 verifies their filters).
    """
    if not _fast_readable(ds):
        return np.asarray(ds[()])
    assert ds.chunks is not None
    rows = ds.chunks[0]
    row_bytes = ds.size // ds.shape[0] * ds.dtype.itemsize
    chunk_bytes = rows * row_bytes
    nchunks = -(-ds.shape[0] // rows)
    # Chunks land back to back in one buffer: each chunk's 4 checksum bytes spill into the
    # next chunk's place and are overwritten by it after verification (no copies).
    buffer = np.empty(nchunks * chunk_bytes + 4, dtype=np.uint8)
    zeros = (0,) * (ds.ndim - 1)
    if ds.id.get_num_chunks() != nchunks:
        raise ChecksumError(f"{ds.name}: {ds.id.get_num_chunks()} of {nchunks} chunks stored")
    for index in range(nchunks):
        target = buffer[index * chunk_bytes : (index + 1) * chunk_bytes + 4]
        mask, _ = ds.id.read_direct_chunk((index * rows, *zeros), out=target)
        stored = int.from_bytes(target[chunk_bytes:].tobytes(), "little")
        if mask != 0 or stored != fletcher32(target[:chunk_bytes]):
            raise ChecksumError(f"{ds.name}: Fletcher-32 checksum mismatch in chunk {index}")
    nbytes = ds.shape[0] * row_bytes
    return buffer[:nbytes].view(ds.dtype).reshape(ds.shape)
