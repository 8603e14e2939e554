"""Asynchronous checkpoints: the step pays for a snapshot into host memory, a thread writes.

:meth:`AsyncCheckpointWriter.save` copies every tensor of the captured state that training may
go on changing, and only references those of the state's ``frozen`` groups (the model copy, the
RNG states, and a method's state that it never modifies in place, e.g. K-FAC's factors and
decompositions: each update makes new tensors), recording each referenced tensor's
``_version``; the write fails, publishing nothing, if one of them changed before the file was
complete. It gathers the per-rank parts to rank 0 (a collective, so it stays on the
training thread: collectives from a second thread would race the step's own), and hands the
HDF5 write, its checksums, the atomic rename and the ``latest`` update to a background thread
on rank 0. The file protocol is the synchronous one (``CheckpointManager.write``), so a kill
at any moment leaves ``latest`` naming a complete, verified file: the one before the write in
flight. A second ``save`` first waits for the write in flight; :meth:`wait` (collective) joins
it and raises on every rank if it failed; the job calls it before it exits or requeues.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kfac_hpc.checkpoint.manager import CheckpointManager
from kfac_hpc.checkpoint.training_state import TrainingState

__all__ = ["AsyncCheckpointWriter", "ModifiedDuringWriteError", "snapshot"]


def snapshot(tree: Any) -> Any:
    """A deep copy of a state tree whose tensors are host copies (owned, not views)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {key: snapshot(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(snapshot(value) for value in tree)
    return tree


def _referenced(tree: Any, versions: list[tuple[torch.Tensor, int]]) -> Any:
    """``tree`` with host tensors kept by reference (their ``_version`` appended to
    ``versions``); device tensors are copied to the host, containers rebuilt."""
    if isinstance(tree, torch.Tensor):
        if tree.device.type != "cpu":
            return tree.detach().to("cpu", copy=True)
        versions.append((tree, tree._version))
        return tree.detach()
    if isinstance(tree, dict):
        return {key: _referenced(value, versions) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_referenced(value, versions) for value in tree)
    return snapshot(tree)


def _split_snapshot(
    tree: dict[str, Any], frozen: frozenset[str], versions: list[tuple[torch.Tensor, int]]
) -> dict[str, Any]:
    return {
        key: _referenced(value, versions) if key in frozen else snapshot(value)
        for key, value in tree.items()
    }


class ModifiedDuringWriteError(RuntimeError):
    """A tensor the snapshot referenced was modified in place before its file was complete."""


def _check_unchanged(versions: list[tuple[torch.Tensor, int]]) -> None:
    changed = sum(1 for tensor, version in versions if tensor._version != version)
    if changed:
        raise ModifiedDuringWriteError(
            f"{changed} tensor(s) of a frozen state group were modified in place during the "
            "asynchronous checkpoint write; nothing was published (copy them in the capture)"
        )


class AsyncCheckpointWriter:
    """Background HDF5 writes through ``manager``'s synchronous file protocol."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None

    def save(self, state: TrainingState) -> Path:
        """Snapshot ``state`` and start its write; collective like ``CheckpointManager.save``.

        Returns the path the file will have once the write (checked by the next :meth:`wait`)
        is done."""
        self.wait()
        versions: list[tuple[torch.Tensor, int]] = []
        copied = TrainingState(
            state.step,
            _split_snapshot(state.shared, state.frozen, versions),
            _split_snapshot(state.per_rank, state.frozen, versions),
            state.rank,
            state.world_size,
        )
        path = self.manager.path_for(state.step)
        per_rank = self.manager.gather(copied)
        self._path = path
        if per_rank is not None:
            # Not a daemon: an interpreter that exits normally still finishes the file.
            self._thread = threading.Thread(
                target=self._write,
                args=(path, copied, per_rank, versions),
                name="checkpoint-writer",
            )
            self._thread.start()
        return path

    def _write(
        self,
        path: Path,
        state: TrainingState,
        per_rank: dict[int, Any],
        versions: list[tuple[torch.Tensor, int]],
    ) -> None:
        try:
            self.manager.write(path, state, per_rank, check=partial(_check_unchanged, versions))
        except BaseException as exc:  # handed to every rank by wait()
            self._error = exc

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Collective: wait for the write in flight (if any); raise on every rank if it
        failed. A no-op when nothing was saved since the last wait."""
        if self._path is None:
            return
        if self._thread is not None:
            self._thread.join()
        path, error = self._path, self._error
        self._thread, self._path, self._error = None, None, None
        self.manager.agree(path, error)
