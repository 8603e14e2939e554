"""The typed nested-dict <-> HDF5 mapping: exact round trips, checksums, readable by h5dump."""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from kfac_hpc.checkpoint.files import open_h5
from kfac_hpc.checkpoint.hdf5_tree import (
    TreeError,
    escape_key,
    read_tree,
    unescape_key,
    walk_datasets,
    write_tree,
)


def _roundtrip(tmp_path: Path, tree: dict) -> dict:
    path = tmp_path / "t.h5"
    with open_h5(path, "w") as h5:
        write_tree(h5, tree)
    with open_h5(path, "r") as h5:
        return read_tree(h5)


def _assert_same(a: object, b: object) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        # compare bits, so NaN payloads and -0.0 count too
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if a.dtype.is_complex or a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            view = width[a.element_size()]
            assert torch.equal(a.contiguous().view(view), b.view(view))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a) == list(b) or set(a) == set(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple))
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b)
    else:
        assert a == b


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtype_and_shape_survive_bit_for_bit(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, 2, generator=g) * 100
    if dtype == torch.bool:
        t = base > 0
    elif dtype.is_complex:
        t = torch.complex(base, -base).to(dtype)
    else:
        t = base.to(dtype)
    if dtype.is_floating_point:
        t.view(-1)[0] = float("nan")
        t.view(-1)[1] = -0.0
    tree = {
        "t": t,
        "scalar": t.reshape(-1)[3].clone(),
        "empty": t[:0],
        "strided": t.transpose(0, 2),
    }
    back = _roundtrip(tmp_path, tree)
    assert back["scalar"].shape == ()
    assert back["empty"].shape == (0, 5, 2)
    _assert_same(tree["t"], back["t"])
    _assert_same(tree["scalar"], back["scalar"])
    _assert_same(tree["empty"], back["empty"])
    _assert_same(tree["strided"].contiguous(), back["strided"])


def test_nested_plain_values_and_optimizer_state_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    tree = {
        "none": None,
        "flag": True,
        "count": -7,
        "big": 2**63 + 5,
        "lr": 0.1,
        "nan": float("nan"),
        "name": "résumé/with/slashes",
        "": "empty key",
        "@reserved": 1,
        ".": 2,
        "%25": 3,
        "long": "x" * 20000,
        "ints": [1, 2, 3],
        "floats": (0.5, 1.5),
        "mixed": [1, 2.0, "a", None, {"k": [True, False]}],
        "empty_list": [],
        "empty_tuple": (),
        "empty_dict": {},
        "np": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "optimizer": opt.state_dict(),
        "layers": {"features.0.conv": {"A": torch.eye(3), "G": torch.eye(2)}},
    }
    back = _roundtrip(tmp_path, tree)
    _assert_same(tree, back)
    assert list(back["optimizer"]["state"]) == [0, 1]  # int keys stay int
    fresh = torch.optim.Adam(model.parameters())
    fresh.load_state_dict(back["optimizer"])
    assert fresh.state_dict()["param_groups"][0]["betas"] == (0.9, 0.99)


def test_escaping_is_reversible():
    for key in ["", ".", "..", "a/b", "%", "%2F", "@x", "x@", "a.b.c", "é"]:
        assert unescape_key(escape_key(key)) == key
        assert "/" not in escape_key(key)


@pytest.mark.parametrize(
    "value",
    [object(), {1: "a", "b": 2}, np.array([object()]), "nul\x00byte", 2**70],
    ids=["object", "mixed_keys", "object_array", "nul", "huge_int"],
)
def test_unsupported_values_fail_loudly_instead_of_pickling(tmp_path, value):
    with open_h5(tmp_path / "t.h5", "w") as h5, pytest.raises(TreeError):
        write_tree(h5, {"v": value})


def test_every_dataset_with_data_is_chunked_and_fletcher32(tmp_path):
    path = tmp_path / "t.h5"
    with open_h5(path, "w") as h5:
        write_tree(h5, {"a": torch.randn(4, 4), "s": torch.tensor(1.0), "l": [1, 2]})
    with h5py.File(path, "r") as h5:
        datasets = list(walk_datasets(h5))
        assert len(datasets) == 3
        assert all(ds.fletcher32 and ds.chunks for ds in datasets)


def test_corrupted_tensor_bytes_are_detected_on_read(tmp_path):
    path = tmp_path / "t.h5"
    data = torch.arange(4096, dtype=torch.float32)
    with open_h5(path, "w") as h5:
        write_tree(h5, {"a": data})
    with h5py.File(path, "r") as h5:
        offset = h5["a"].id.get_chunk_info(0).byte_offset
    raw = bytearray(path.read_bytes())
    raw[offset + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with open_h5(path, "r") as h5, pytest.raises(OSError):
        read_tree(h5)


@pytest.mark.usefixtures("hdf5_tools")
def test_plain_hdf5_tools_read_the_file(tmp_path):
    path = tmp_path / "t.h5"
    with open_h5(path, "w") as h5:
        write_tree(h5, {"layers": {"fc1": {"A": torch.eye(3), "G": torch.eye(2)}}, "step": 3})
    ls = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    assert "/layers/fc1/A" in ls.stdout and "Dataset {3, 3}" in ls.stdout
    dump = subprocess.run(
        ["h5dump", "-p", "-H", str(path)], capture_output=True, text=True, timeout=60
    )
    assert dump.returncode == 0, dump.stderr
    assert 'ATTRIBUTE "step"' in dump.stdout and "CHECKSUM FLETCHER32" in dump.stdout
