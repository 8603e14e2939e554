"""A checkpoint changed consistently after it was written (an attribute rewritten, a dataset
deleted: every HDF5 checksum still passes) is refused by the resume and by `verify` alike,
which run one check; `verify RUN_DIR` takes the file a resume would take, `latest` or not."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kfac_hpc.checkpoint import (
    CheckpointError,
    CheckpointManager,
    DataPosition,
    capture_training_state,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint,
)
from kfac_hpc.checkpoint.files import LATEST, checkpoint_name, open_h5
from kfac_hpc.checkpoint.hdf5_tree import read_tree, write_tree
from kfac_hpc.checkpoint.integrity import INTEGRITY, integrity_digest
from kfac_hpc.cli import main

STEPS = (10, 20)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoints folder holding steps 10 and 20 (latest: 20), written by the manager."""
    directory = tmp_path_factory.mktemp("saved") / "checkpoints"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = CheckpointManager(directory, keep=5)
    for step in STEPS:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        manager.save(
            capture_training_state(
                step=step,
                model=model,
                optimizer=opt,
                data_position=DataPosition(0, step, 7),
                config={"lr": 0.1},
                config_hash="feedc0de",
            )
        )
    return directory


@pytest.fixture
def ckpts(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved, copy)
    return copy


def _set_attr(path: Path, where: str, name: str, value: object) -> None:
    with h5py.File(path, "r+") as h5:
        h5[where].attrs[name] = value


def _del_dataset(path: Path, name: str) -> None:
    with h5py.File(path, "r+") as h5:
        del h5[name]


# Each edit leaves every Fletcher-32 and HDF5 metadata checksum valid.
EDITS = {
    "step_20_to_35": lambda p: _set_attr(p, "/", "step", np.int64(35)),
    "world_size": lambda p: _set_attr(p, "/", "world_size", np.int64(2)),
    "config_hash": lambda p: _set_attr(p, "/", "config_hash", np.bytes_(b"0123abcd")),
    "config_json": lambda p: _set_attr(p, "/", "config_json", np.bytes_(b'{"lr": 9.0}')),
    "schema_version": lambda p: _set_attr(p, "/", "schema_version", np.int64(1)),
    "batch_index": lambda p: _set_attr(p, "data_position", "batch_index", np.int64(3)),
    "sampler_seed": lambda p: _set_attr(p, "data_position", "sampler_seed", np.int64(8)),
    "model_dataset_deleted": lambda p: _del_dataset(p, "model/0/bias"),
    "optimizer_dataset_deleted": lambda p: _del_dataset(p, "optimizer/param_groups/0/params"),
    "rng_dataset_deleted": lambda p: _del_dataset(p, "ranks/0/rng/numpy/keys"),
    "integrity_deleted": lambda p: _del_attr(p, INTEGRITY),
    "integrity_rewritten": lambda p: _set_attr(p, "/", INTEGRITY, np.bytes_(b"sha256:0")),
    "dataset_added": lambda p: _add_dataset(p),
}


def _del_attr(path: Path, name: str) -> None:
    with h5py.File(path, "r+") as h5:
        del h5.attrs[name]


def _add_dataset(path: Path) -> None:
    with h5py.File(path, "r+") as h5:
        h5["model/0"].create_dataset("extra", data=np.zeros(3, dtype=np.float32))


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_consistent_edit_is_refused_by_resume_and_verify_alike(ckpts, edit):
    newest = ckpts / checkpoint_name(20)
    EDITS[edit](newest)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(newest)
    assert str(newest) in str(caught.value)
    found, skipped = find_checkpoint(ckpts)
    assert found is not None and found.step == 10  # the resume falls back to the older one
    assert [s.path for s in skipped] == [newest]
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(newest)])
    assert result.exit_code == 1, result.output
    assert "corrupt" in result.output and skipped[0].reason in result.output
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(ckpts.parent)])
    assert result.exit_code == 1, result.output
    assert f"ok: {ckpts / checkpoint_name(10)}" in result.output
    assert "a resume takes this file" in result.output


def test_the_step_edit_names_the_integrity_record(ckpts):
    newest = ckpts / checkpoint_name(20)
    EDITS["step_20_to_35"](newest)
    with pytest.raises(CheckpointError, match="integrity checksum mismatch"):
        read_checkpoint(newest)


def test_a_file_renamed_to_another_step_is_refused(ckpts):
    renamed = ckpts / checkpoint_name(35)
    (ckpts / checkpoint_name(20)).rename(renamed)
    with pytest.raises(CheckpointError, match="its step attribute says 20, its name says 35"):
        read_checkpoint(renamed)
    copy = ckpts.parent / "any-name.h5"  # a user's copy under another name still loads
    shutil.copy(ckpts / checkpoint_name(10), copy)
    assert read_checkpoint(copy).step == 10


def test_an_unaltered_file_verifies_and_loads(ckpts):
    assert read_checkpoint(ckpts / checkpoint_name(20)).step == 20
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(ckpts.parent)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"ok: {ckpts / checkpoint_name(20)} (step 20, ")


def test_a_schema_1_file_without_the_record_still_loads(ckpts):
    """Files written before the integrity record keep loading (and say so in verify)."""
    old = ckpts / checkpoint_name(20)
    with h5py.File(old, "r+") as h5:
        h5.attrs["schema_version"] = np.int64(1)
        del h5.attrs[INTEGRITY]
    assert load_checkpoint(ckpts.parent).step == 20
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(old)])
    assert result.exit_code == 0, result.output
    assert "schema 1" in result.output


def test_a_schema_2_file_without_the_record_is_refused(ckpts):
    newest = ckpts / checkpoint_name(20)
    _del_attr(newest, INTEGRITY)
    with pytest.raises(CheckpointError, match="no integrity record"):
        read_checkpoint(newest)


def _latest_missing(ckpts: Path) -> None:
    (ckpts / LATEST).unlink()


def _latest_garbage(ckpts: Path) -> None:
    (ckpts / LATEST).write_bytes(b"\xff\xfe garbage \x00\n")


def _latest_a_directory(ckpts: Path) -> None:
    (ckpts / LATEST).unlink()
    (ckpts / LATEST).mkdir()


def _latest_names_a_missing_file(ckpts: Path) -> None:
    (ckpts / LATEST).write_text(checkpoint_name(99) + "\n")


POINTERS = {
    "missing": _latest_missing,
    "garbage": _latest_garbage,
    "a_directory": _latest_a_directory,
    "names_a_missing_file": _latest_names_a_missing_file,
}


@pytest.mark.parametrize("pointer", sorted(POINTERS))
@pytest.mark.parametrize("given", ["run_dir", "checkpoints_dir"])
def test_verify_without_a_usable_latest_takes_the_newest_valid_file(ckpts, pointer, given):
    POINTERS[pointer](ckpts)
    target = ckpts.parent if given == "run_dir" else ckpts
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(target)])
    assert result.exit_code == 0, result.output
    assert "note:" in result.output and "a resume tries the newest files first" in result.output
    assert f"ok: {ckpts / checkpoint_name(20)} (step 20" in result.output
    assert load_checkpoint(target).step == 20  # the file the resume takes


def test_verify_without_latest_and_a_corrupt_newest_names_both(ckpts):
    _latest_missing(ckpts)
    EDITS["model_dataset_deleted"](ckpts / checkpoint_name(20))
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(ckpts.parent)])
    assert result.exit_code == 1, result.output
    assert f"corrupt: {ckpts / checkpoint_name(20)}" in result.output
    assert f"ok: {ckpts / checkpoint_name(10)}" in result.output


def test_verify_of_a_folder_without_checkpoints_is_bad_input(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    result = CliRunner().invoke(main, ["checkpoint", "verify", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "holds no checkpoint file" in result.output


def test_inspect_of_a_run_dir_without_latest_shows_the_newest(ckpts):
    _latest_missing(ckpts)
    result = CliRunner().invoke(main, ["checkpoint", "inspect", str(ckpts.parent)])
    assert result.exit_code == 0, result.output
    assert "step:        20" in result.output and "valid:       yes" in result.output


def test_a_manager_skip_is_handed_over_not_warned(ckpts, recwarn):
    EDITS["step_20_to_35"](ckpts / checkpoint_name(20))
    skipped = []
    found = CheckpointManager(ckpts).load_latest(on_skip=skipped.append)
    assert found is not None and found.step == 10
    assert [(s.path.name, "integrity" in s.reason) for s in skipped] == [
        (checkpoint_name(20), True)
    ]
    assert skipped[0].record() == {"file": checkpoint_name(20), "reason": skipped[0].reason}
    assert not recwarn.list


def test_the_written_tree_and_the_tree_read_back_have_one_digest(tmp_path):
    """The writer digests the tree it writes, the reader the tree it reads: every kind of value
    the mapping stores must encode alike on both sides."""
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    tree = {
        "none": None,
        "flag": True,
        "np_flag": np.bool_(False),
        "count": -7,
        "np_count": np.int32(5),
        "big": 2**63 + 5,
        "lr": 0.1,
        "np_float": np.float32(0.25),
        "nan": float("nan"),
        "name": "résumé/with/slashes",
        "": "empty key",
        "@reserved": 1,
        ".": 2,
        "%25": 3,
        "long": "x" * 20000,
        "ints": [1, 2, 3],
        "bools": [True, False],
        "floats": (0.5, 1.5),
        "mixed": [1, 2.0, "a", None, {"k": [True, False]}, np.int64(3)],
        "empty_list": [],
        "empty_tuple": (),
        "empty_dict": {},
        "int_keys": {3: "c", 1: "a"},
        "np": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "np_scalar": np.array(2.5),
        "bf16": torch.randn(3, 2).to(torch.bfloat16),
        "scalar": torch.tensor(1.5),
        "strided": torch.randn(3, 4).t(),
        "empty_tensor": torch.zeros(0, 4),
        "optimizer": opt.state_dict(),
    }
    path = tmp_path / "t.h5"
    with open_h5(path, "w") as h5:
        write_tree(h5, tree)
    with open_h5(path, "r") as h5:
        back = read_tree(h5)
    assert integrity_digest(back) == integrity_digest(tree)
    changed = dict(back, count=-8)
    assert integrity_digest(changed) != integrity_digest(tree)
    missing = {k: v for k, v in back.items() if k != "bf16"}
    assert integrity_digest(missing) != integrity_digest(tree)
