"""The fast Fletcher-32 chunk path against HDF5's own filter (the independent oracle)."""

from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest

from kfac_hpc.checkpoint import chunk_io
from kfac_hpc.checkpoint.chunk_io import ChecksumError, fletcher32, read_array, write_array


def _hdf5_checksum(tmp_path, array: np.ndarray) -> int:
    """The checksum HDF5's filter stores for ``array`` written as one chunk."""
    with h5py.File(tmp_path / "oracle.h5", "w") as h5:
        ds = h5.create_dataset("a", data=array, chunks=array.shape, fletcher32=True)
        _, raw = ds.id.read_direct_chunk((0,) * array.ndim)
    return int.from_bytes(raw[-4:], "little")


@pytest.mark.parametrize("seed", range(12))
def test_checksum_equals_hdf5_filter(tmp_path, seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 200_000))
    kind = seed % 4
    if kind == 0:
        array = rng.integers(0, 256, size, dtype=np.uint8)  # odd sizes included
    elif kind == 1:
        array = np.zeros(size, dtype=np.uint8)
    elif kind == 2:
        array = np.full(size, 255, dtype=np.uint8)  # sums that are multiples of 65535
    else:
        array = rng.standard_normal(size).astype(np.float32)
    assert fletcher32(array.view(np.uint8)) == _hdf5_checksum(tmp_path, array)


@pytest.mark.parametrize("shape", [(1,), (7, 3), (1000, 33), (10, 4, 5)])
def test_multi_chunk_files_are_read_and_verified_by_plain_hdf5(tmp_path, monkeypatch, shape):
    monkeypatch.setattr(chunk_io, "CHUNK_BYTES", 1000)  # several chunks, a partial last one
    array = np.random.default_rng(0).standard_normal(shape)
    with h5py.File(tmp_path / "t.h5", "w") as h5:
        write_array(h5, "a", array)
    with h5py.File(tmp_path / "t.h5", "r") as h5:
        assert np.array_equal(h5["a"][()], array)  # HDF5's filter verifies every chunk
        assert np.array_equal(read_array(h5["a"]), array)


def test_corruption_is_reported_by_both_readers(tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_io, "CHUNK_BYTES", 4096)
    array = np.arange(5000, dtype=np.float64)
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as h5:
        write_array(h5, "a", array)
        offset = h5["a"].id.get_chunk_info(3).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset + 17] ^= 0x40
    path.write_bytes(bytes(raw))
    with h5py.File(path, "r") as h5:
        with pytest.raises(ChecksumError, match="chunk 3"):
            read_array(h5["a"])
        with pytest.raises(OSError):
            h5["a"][()]


@pytest.mark.parametrize("size", [3 * 131070 * 5 + 7, 131070 * 8, 131070 * 8 + 1])
def test_checksum_over_many_row_groups_and_split_equals_hdf5_filter(tmp_path, monkeypatch, size):
    # Blocks of 2 rows, groups of 3 and a split at 64 KiB: every path of the byte-column sums
    # on small data.
    monkeypatch.setattr(chunk_io, "_BLOCK_ROWS", 2)
    monkeypatch.setattr(chunk_io, "GROUP_ROWS", 3)
    monkeypatch.setattr(chunk_io, "SPLIT_BYTES", 65536)
    array = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert fletcher32(array) == _hdf5_checksum(tmp_path, array)


@pytest.mark.parametrize("size", [7, 131070 * 3 + 5, 131070 * 8])
@pytest.mark.parametrize("padding", [0, 1, 131071])
def test_checksummed_copy_copies_pads_with_zeros_and_sums_like_hdf5(
    tmp_path, monkeypatch, size, padding
):
    monkeypatch.setattr(chunk_io, "_BLOCK_ROWS", 2)
    monkeypatch.setattr(chunk_io, "GROUP_ROWS", 3)
    monkeypatch.setattr(chunk_io, "SPLIT_BYTES", 65536)
    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    target = np.full(size + padding, 0xAB, dtype=np.uint8)  # stale bytes to overwrite
    checksum = chunk_io.checksummed_copy(source, target)
    assert np.array_equal(target[:size], source) and not target[size:].any()
    assert checksum == _hdf5_checksum(tmp_path, target)


def test_byte_column_sums_of_0xff_rows_do_not_wrap():
    # The largest sums a uint16 group can make (256 rows of 0xFF: 65280 per byte position),
    # two full groups and a partial one, against int64 sums.
    rows = np.full((600, 131070), 255, dtype=np.uint8)
    expected = np.full(131070, 600 * 255, dtype=np.int64)
    assert np.array_equal(chunk_io._byte_columns(rows, None), expected)


def test_only_the_main_thread_splits_a_checksum(monkeypatch):
    monkeypatch.setattr(chunk_io, "SPLIT_BYTES", 65536)
    seen: list[str] = []
    sums = chunk_io._byte_columns

    def recording(rows: np.ndarray, into: np.ndarray | None) -> np.ndarray:
        seen.append(threading.current_thread().name)
        return sums(rows, into)

    monkeypatch.setattr(chunk_io, "_byte_columns", recording)
    data = np.random.default_rng(0).integers(0, 256, 131070 * 4, dtype=np.uint8)
    on_main = fletcher32(data)
    assert len(seen) == 2 and len(set(seen)) == 2  # the main thread and its helper
    seen.clear()
    background: list[int] = []
    worker = threading.Thread(target=lambda: background.append(fletcher32(data)), name="writer")
    worker.start()
    worker.join()
    assert seen == ["writer"] and background == [on_main]


def test_checksummed_copy_refuses_a_strided_or_short_target():
    source = np.arange(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="contiguous"):
        chunk_io.checksummed_copy(source, np.zeros(40, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="hold the source"):
        chunk_io.checksummed_copy(source, np.zeros(9, dtype=np.uint8))
