"""Crash safety: SIGKILLed writers never leave a `latest` that fails to load; corruption is
detected and the previous checkpoint is used."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import warnings
from pathlib import Path

import h5py
import pytest
import torch

from kfac_hpc.checkpoint import (
    CheckpointError,
    CheckpointManager,
    TrainingState,
    read_checkpoint,
)
from kfac_hpc.checkpoint.files import checkpoint_step, list_checkpoints, read_latest
from kfac_hpc.checkpoint.hdf5_tree import walk_datasets
from tests.helpers.kill_moments import KillMoment, Progress, hold_inside_a_write, wait_for_moment

TRIALS = 24


def _state(step: int) -> TrainingState:
    g = torch.Generator().manual_seed(step)
    shared = {
        "schema_version": 1,
        "step": step,
        "world_size": 1,
        "config_json": "{}",
        "data_position": {"epoch": 0, "batch_index": step, "sampler_seed": 0},
        "model": {"fc": {"weight": torch.randn(4, 4, generator=g)}},
        "kfac_state": {
            "layers": {
                f"layer{i}": {"A": torch.randn(256, 256, generator=g), "G": torch.eye(4)}
                for i in range(8)
            }
        },
    }
    return TrainingState(step, shared, {"rng": {"torch_cpu": torch.get_rng_state()}})


def _writer(directory: str, first_step: int, moment: KillMoment, progress: Progress) -> None:
    """Save checkpoints forever (until killed), held inside a write at ``moment``."""
    hold_inside_a_write(moment, progress)
    manager = CheckpointManager(directory, keep=2)
    step = first_step
    while True:
        step += 1
        manager.save(_state(step))
        progress.saved.set()


def _check_directory(directory: Path) -> int:
    """Assert `latest` (if any) loads and holds the right data; return its step (0 if none)."""
    latest = read_latest(directory)
    if latest is None:
        return 0
    ckpt = read_checkpoint(latest)
    expected = _state(ckpt.step).shared["kfac_state"]["layers"]["layer7"]["A"]
    assert torch.equal(ckpt.tree["kfac_state"]["layers"]["layer7"]["A"], expected)
    return ckpt.step


def _kill_and_check(
    proc: multiprocessing.process.BaseProcess, directory: Path, last_step: int
) -> tuple[int, bool]:
    """SIGKILL the writer ``proc``; the directory's checked latest step (never below
    ``last_step``) and whether the kill left a half-written file behind."""
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    step = _check_directory(directory)
    assert step >= last_step, "latest went backwards"
    return step, any(".tmp-" in p.name for p in directory.iterdir())


def test_sigkill_at_random_moments_never_breaks_latest(tmp_path):
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(7)
    last_step, killed_mid_write = 0, 0
    for trial in range(TRIALS):
        moment, progress = KillMoment.draw(trial, rng), Progress.create(ctx)
        proc = ctx.Process(target=_writer, args=(str(tmp_path), last_step, moment, progress))
        proc.start()
        wait_for_moment(moment, progress)
        step, mid_write = _kill_and_check(proc, tmp_path, last_step)
        last_step, killed_mid_write = step, killed_mid_write + mid_write
        # The loader tries the file `latest` names first; with no `latest` yet (a kill between
        # the first rename and the first `latest` write) it finds the published file by scanning.
        published = max((checkpoint_step(p) or 0 for p in list_checkpoints(tmp_path)), default=0)
        expected = step if read_latest(tmp_path) is not None else published
        manager = CheckpointManager(tmp_path, keep=2)  # cleans up after the dead writer
        found = manager.load_latest()
        assert (found.step if found else 0) == expected
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        assert (
            len(list_checkpoints(tmp_path)) <= 3
        )  # the newest 2 (keep) and the one `latest` names
    assert last_step > 0, "no write ever finished"
    assert killed_mid_write >= TRIALS // 2, "a kill held inside a write left no temporary file"
    print(f"{TRIALS} kills, {killed_mid_write} inside a write, last step {last_step}")


def _two_checkpoints(directory: Path) -> tuple[Path, Path]:
    manager = CheckpointManager(directory, keep=3)
    older = manager.save(_state(1))
    newer = manager.save(_state(2))
    assert read_latest(directory) == newer
    return older, newer


def _flip_byte_in_dataset(path: Path) -> None:
    with h5py.File(path, "r") as h5:
        ds = h5["kfac_state/layers/layer3/A"]
        offset = ds.id.get_chunk_info(0).byte_offset + 1000
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_corrupt_latest_is_detected_and_previous_used(tmp_path, damage):
    older, newer = _two_checkpoints(tmp_path)
    if damage == "flipped_byte":
        _flip_byte_in_dataset(newer)
    else:
        os.truncate(newer, newer.stat().st_size // 2)
    with pytest.warns(UserWarning, match=newer.name):
        found = CheckpointManager(tmp_path).load_latest()
    assert found is not None and found.path == older and found.step == 1


def test_incomplete_file_is_ignored(tmp_path):
    older, newer = _two_checkpoints(tmp_path)
    with h5py.File(newer, "r+") as h5:
        h5.attrs["complete"] = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = CheckpointManager(tmp_path).load_latest()
    assert found is not None and found.path == older
    assert any("incomplete" in str(w.message) for w in caught)


def _flat(tree: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_a_flipped_bit_anywhere_is_detected_or_harmless(tmp_path):
    """300 single-bit flips: 150 anywhere in the file, 150 in the metadata (object headers,
    B-trees, heaps: everything but chunk data). Each must make the load fail, or leave what it
    reads identical to the original: never a silently different state."""
    _, newer = _two_checkpoints(tmp_path)
    pristine = newer.read_bytes()
    reference = _flat(read_checkpoint(newer).tree)
    with h5py.File(newer, "r") as h5:
        chunks = [
            (info.byte_offset, info.byte_offset + info.size)
            for ds in walk_datasets(h5)
            for info in (ds.id.get_chunk_info(c) for c in range(ds.id.get_num_chunks()))
        ]
    metadata = [o for o in range(len(pristine)) if not any(a <= o < b for a, b in chunks)]
    rng = random.Random(3)
    offsets = [rng.randrange(len(pristine)) for _ in range(150)]
    offsets += [rng.choice(metadata) for _ in range(150)]
    detected = 0
    for offset in offsets:
        raw = bytearray(pristine)
        raw[offset] ^= 1 << rng.randrange(8)
        newer.write_bytes(bytes(raw))
        try:
            loaded = _flat(read_checkpoint(newer).tree)
        except CheckpointError:
            detected += 1
            continue
        assert _same(loaded, reference), f"bit flip at byte {offset} changed the state silently"
    assert detected >= 0.9 * len(offsets)
