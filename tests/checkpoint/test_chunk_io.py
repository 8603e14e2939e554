"""The fast Fletcher-32 chunk path against HDF5's own filter (the independent oracle)."""

from __future__ import annotations

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
