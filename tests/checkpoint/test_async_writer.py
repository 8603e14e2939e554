"""Asynchronous checkpoints: the file is the synchronous one, written from a snapshot; saves
are serialised; failures surface at wait(); SIGKILL at random moments never breaks `latest`."""

from __future__ import annotations

import multiprocessing
import random
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kfac_hpc.checkpoint import (
    AsyncCheckpointWriter,
    CheckpointManager,
    read_checkpoint,
)
from kfac_hpc.checkpoint.async_writer import ModifiedDuringWriteError
from kfac_hpc.checkpoint.files import list_checkpoints, read_latest
from tests.checkpoint.test_crash_safety import TRIALS, _flat, _kill_and_check, _same, _state
from tests.helpers.kill_moments import KillMoment, Progress, hold_inside_a_write, wait_for_moment


def test_async_file_equals_the_synchronous_one_and_holds_the_snapshot(tmp_path: Path) -> None:
    state = _state(3)
    live = state.shared["kfac_state"]["layers"]["layer0"]["A"]
    expected = live.clone()
    writer = AsyncCheckpointWriter(CheckpointManager(tmp_path / "async", keep=2))
    path = writer.save(state)
    live.add_(1.0)  # training goes on changing the live tensors while the thread writes
    writer.wait()
    assert read_latest(tmp_path / "async") == path
    got = read_checkpoint(path).tree
    assert torch.equal(got["kfac_state"]["layers"]["layer0"]["A"], expected)
    sync = CheckpointManager(tmp_path / "sync", keep=2).save(_state(3))
    assert _same(_flat(got), _flat(read_checkpoint(sync).tree))


def test_a_second_save_waits_for_the_first(tmp_path: Path) -> None:
    writer = AsyncCheckpointWriter(CheckpointManager(tmp_path, keep=5))
    first = writer.save(_state(1))
    second = writer.save(_state(2))  # joins the first write before snapshotting
    assert first.is_file() and read_checkpoint(first).step == 1
    writer.wait()
    assert not writer.in_flight
    assert read_latest(tmp_path) == second
    assert list_checkpoints(tmp_path) == [second, first]


def test_a_failed_write_is_raised_at_wait_and_latest_stays(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    writer = AsyncCheckpointWriter(manager)
    good = writer.save(_state(1))
    writer.wait()
    bad = _state(2)
    bad.shared["kfac_state"]["layers"]["layer0"]["A"] = object()  # no HDF5 type for it
    writer.save(bad)
    with pytest.raises(Exception):  # noqa: B017 - whatever the tree writer raises
        writer.wait()
    assert read_latest(tmp_path) == good
    writer.wait()  # nothing in flight any more: a no-op


def _async_writer(directory: str, first_step: int, moment: KillMoment, progress: Progress) -> None:
    """Save checkpoints asynchronously forever (until killed), held inside a write at
    ``moment``; a save returns once the previous write has finished."""
    hold_inside_a_write(moment, progress)
    writer = AsyncCheckpointWriter(CheckpointManager(directory, keep=2))
    step = first_step
    while True:
        step += 1
        writer.save(_state(step))
        if step > first_step + 1:
            progress.saved.set()


def test_sigkill_at_random_moments_never_breaks_latest_async(tmp_path: Path) -> None:
    # Spawned, not forked: a child forked from this process (whose torch already ran) hangs
    # when its writer thread calls into torch; a real job never forks.
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random(11)
    last_step, killed_mid_write = 0, 0
    for trial in range(TRIALS // 2):  # half the synchronous test's trials: each spawn costs s
        moment, progress = KillMoment.draw(trial, rng), Progress.create(ctx)
        args = (str(tmp_path), last_step, moment, progress)
        proc = ctx.Process(target=_async_writer, args=args)
        proc.start()
        wait_for_moment(moment, progress)
        step, mid_write = _kill_and_check(proc, tmp_path, last_step)
        last_step, killed_mid_write = step, killed_mid_write + mid_write
        manager = CheckpointManager(tmp_path, keep=2)  # cleans up after the dead writer
        found = manager.load_latest()
        assert (found.step if found else 0) == step
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        assert len(list_checkpoints(tmp_path)) <= 3
    assert last_step > 0, "no write ever finished"
    assert killed_mid_write >= TRIALS // 4, "a kill held inside a write left no temporary file"


def test_snapshot_copies_every_tensor() -> None:
    from kfac_hpc.checkpoint.async_writer import snapshot

    t = torch.ones(3)
    tree = {"a": [t, (t, 1)], "b": "x"}
    copied = snapshot(tree)
    t.zero_()
    assert torch.equal(copied["a"][0], torch.ones(3)) and torch.equal(
        copied["a"][1][0], torch.ones(3)
    )
    assert copied["b"] == "x" and copied["a"][1][1] == 1


class _GatedManager(CheckpointManager):
    """The real manager whose background write starts only once ``gate`` is set."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, keep=3)
        self.gate = threading.Event()

    def write(self, *args: Any, **kwargs: Any) -> None:
        assert self.gate.wait(timeout=60)
        super().write(*args, **kwargs)


def test_frozen_groups_are_referenced_and_an_in_place_change_publishes_nothing(
    tmp_path: Path,
) -> None:
    manager = _GatedManager(tmp_path)
    writer = AsyncCheckpointWriter(manager)
    manager.gate.set()
    good = writer.save(replace(_state(1), frozen=frozenset({"kfac_state"})))
    writer.wait()
    manager.gate.clear()
    state = replace(_state(2), frozen=frozenset({"kfac_state"}))
    writer.save(state)
    # referenced, not copied: a change before the write is detected by its _version
    state.shared["kfac_state"]["layers"]["layer0"]["A"].add_(1.0)
    manager.gate.set()
    with pytest.raises(ModifiedDuringWriteError, match="modified in place"):
        writer.wait()
    assert read_latest(tmp_path) == good
    assert list_checkpoints(tmp_path) == [good]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_frozen_groups_unchanged_are_written_as_they_are(tmp_path: Path) -> None:
    state = replace(_state(3), frozen=frozenset({"kfac_state"}))
    expected = state.shared["kfac_state"]["layers"]["layer0"]["A"].clone()
    writer = AsyncCheckpointWriter(CheckpointManager(tmp_path, keep=2))
    path = writer.save(state)
    writer.wait()
    got = read_checkpoint(path).tree["kfac_state"]["layers"]["layer0"]["A"]
    assert torch.equal(got, expected)
