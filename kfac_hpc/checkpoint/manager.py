"""The job's entry point for checkpoints: collective save, verified load with fallback, warm start.

Distributed writing (no parallel HDF5): factors are identical on all ranks after their
allreduce, so rank 0 writes every shared part. What only some ranks hold (their RNG states,
MEM-OPT second-order data) is *gathered*: each rank serialises its part into an in-memory HDF5
image (the same typed mapping, no pickle), rank 0 receives the images one rank at a time and
writes each under ``ranks/<r>`` of the one file. One file per step keeps publication atomic
(a single rename) with no cross-file commit protocol. On load every rank opens the file read-only
and reads it (checksums verified), so no broadcast of state is needed.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import h5py
import torch
import torch.distributed as dist

from kfac_hpc.checkpoint.files import (
    checkpoint_name,
    list_checkpoints,
    open_h5,
    prune,
    read_latest,
    remove_stale_temporaries,
    write_atomic_h5,
    write_latest,
)
from kfac_hpc.checkpoint.hdf5_tree import read_tree, write_tree
from kfac_hpc.checkpoint.training_state import (
    SCHEMA_VERSION,
    CheckpointError,
    CheckpointMismatchError,
    LoadedCheckpoint,
    TrainingState,
    check_schema,
    check_shapes,
    saved_method_state,
)
from kfac_hpc.method_state import Checkpointable

__all__ = ["CheckpointManager", "init_factors_from", "load_checkpoint", "read_checkpoint"]


def read_checkpoint(path: Path, locking: bool | str | None = None) -> LoadedCheckpoint:
    """Read and verify one checkpoint file; :class:`CheckpointError` says what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with open_h5(path, "r", locking) as h5:
            if not bool(h5.attrs.get("complete", False)):
                raise CheckpointError(f"{path}: incomplete (the writer did not finish)")
            version = int(h5.attrs.get("schema_version", -1))
            if version != SCHEMA_VERSION:
                raise CheckpointError(
                    f"{path}: schema version {version}, this kfac-hpc reads {SCHEMA_VERSION}"
                )
            tree = read_tree(h5)
        check_schema(path, tree)
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged file can make h5py fail in many ways; all mean corrupt
        raise CheckpointError(f"{path}: corrupt or unreadable ({exc})") from exc
    return LoadedCheckpoint(path, tree)


def _candidates(directory: Path) -> list[Path]:
    """Checkpoints to try, best first: the one ``latest`` names, then the others newest first."""
    files = list_checkpoints(directory)
    latest = read_latest(directory)
    if latest is not None and latest in files:
        files.remove(latest)
        files.insert(0, latest)
    return files


def load_checkpoint(path: Path | str, locking: bool | str | None = None) -> LoadedCheckpoint:
    """Load a checkpoint file, or the latest good one of a run dir / checkpoints dir."""
    path = Path(path)
    if path.is_dir():
        directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = _first_good(_candidates(directory), locking)
        if found is None:
            raise CheckpointError(f"{path}: no complete, valid checkpoint found")
        return found
    return read_checkpoint(path, locking)


def _first_good(
    candidates: list[Path],
    locking: bool | str | None,
    accept: Callable[[LoadedCheckpoint], object] | None = None,
) -> LoadedCheckpoint | None:
    """The first candidate that reads, verifies and (``accept`` raising CheckpointError when
    not) fits; the others are skipped with a warning."""
    for candidate in candidates:
        try:
            found = read_checkpoint(candidate, locking)
            if accept is not None:
                accept(found)
            return found
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", stacklevel=3)
    return None


def init_factors_from(
    path: Path | str, preconditioner: Checkpointable, locking: bool | str | None = None
) -> int:
    """Warm start from another run's checkpoint: what ``preconditioner.warm_start`` takes of
    its saved state (K-FAC: the factors A and G per layer; counters, schedules and
    second-order data stay). Works from any saved world size/strategy; returns the units set.
    """
    ckpt = load_checkpoint(path, locking)
    saved = saved_method_state(ckpt.tree, preconditioner, with_shards=False)
    if saved is None:
        raise CheckpointMismatchError(
            f"{ckpt.path}: the checkpoint has no {preconditioner.label} state"
        )
    check_shapes(preconditioner.expected_shapes(), saved, preconditioner.label, ckpt.path)
    return preconditioner.warm_start(saved)


def _tree_image(tree: Mapping[str, Any]) -> torch.Tensor:
    """``tree`` as the bytes of an in-memory HDF5 file (uint8 tensor)."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w", libver=("v110", "v110"), track_order=True) as h5:
        write_tree(h5, tree)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _image_tree(image: torch.Tensor) -> Any:
    with h5py.File(io.BytesIO(image.numpy().tobytes()), "r") as h5:
        return read_tree(h5)


class CheckpointManager:
    """Saves and finds the checkpoints of one run directory's ``checkpoints/`` folder.

    ``keep`` is the number of newest checkpoints retained (≥ 1); ``compression`` is an h5py
    filter name (``"gzip"``, ``"lzf"``) or None; ``locking`` overrides ``HDF5_USE_FILE_LOCKING``.
    """

    def __init__(
        self,
        directory: Path | str,
        *,
        keep: int = 3,
        rank: int = 0,
        world_size: int = 1,
        compression: str | None = None,
        locking: bool | str | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self._gloo_group: Any = None
        self.compression = compression
        self.locking = locking
        if rank == 0:  # temporaries of a writer that died (nothing published is touched)
            remove_stale_temporaries(self.directory)

    @property
    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _side_group(self) -> Any:
        """The group of the gather: the default one on gloo; under NCCL a gloo group over the
        same ranks (created once, collectively, at the first save or load), so rank 0 receives over
        CPU sockets instead of NCCL creating a communicator for every (rank, 0) pair."""
        if dist.get_backend() != "nccl":
            return None
        if self._gloo_group is None:
            self._gloo_group = dist.new_group(backend="gloo")
        return self._gloo_group

    def save(self, state: TrainingState) -> Path:
        """Write ``state`` as ``ckpt-<step>.h5``; collective when the world size is > 1.

        Every rank must call it at the same step. Returns the published path on every rank;
        raises on every rank if rank 0 could not write.
        """
        path = self.path_for(state.step)
        per_rank = self.gather(state)
        error = None
        if per_rank is not None:
            try:
                self.write(path, state, per_rank)
            except Exception as exc:  # reported to all ranks by agree()
                error = exc
        self.agree(path, error)
        return path

    def path_for(self, step: int) -> Path:
        return self.directory / checkpoint_name(step)

    def gather(self, state: TrainingState) -> dict[int, Any] | None:
        """Collective: every rank's ``per_rank`` tree, by rank, on rank 0 (None elsewhere)."""
        if not self._distributed:
            return {0: state.per_rank}
        group = self._side_group()
        if self.rank != 0:
            image = _tree_image(state.per_rank)
            size = torch.tensor([image.numel()], dtype=torch.int64)
            dist.send(size, dst=0, group=group)
            dist.send(image, dst=0, group=group)
            return None
        per_rank: dict[int, Any] = {0: state.per_rank}
        for src in range(1, self.world_size):
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src=src, group=group)
            image = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(image, src=src, group=group)
            per_rank[src] = _image_tree(image)
        return per_rank

    def agree(self, path: Path, error: BaseException | None) -> None:
        """Collective: raise on every rank if rank 0's write of ``path`` failed (``error``)."""
        if not self._distributed:
            if error is not None:
                raise error
            return
        ok = torch.tensor([0 if error else 1], dtype=torch.int64)
        dist.broadcast(ok, src=0, group=self._side_group())
        if error is not None:
            raise error
        if not bool(ok.item()):
            raise CheckpointError(f"rank 0 failed to write {path}")

    def write(
        self,
        path: Path,
        state: TrainingState,
        per_rank: Mapping[int, Any],
        check: Callable[[], None] | None = None,
    ) -> None:
        """Rank 0: publish ``path``, point ``latest`` at it, prune older ones. ``check`` runs
        once the content is written, before the file is marked complete; if it raises, nothing
        is published. Nothing is created or deleted before the first save (a resume must load
        first); a directory in the way of ``path`` skips this checkpoint with a warning."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file():
            warnings.warn(f"checkpoint skipped: {path} exists and is not a file", stacklevel=3)
            return

        def fill(h5: h5py.File) -> None:
            write_tree(h5, state.shared, compression=self.compression)
            ranks = h5.create_group("ranks", track_order=True)
            write_tree(ranks, {str(r): tree for r, tree in sorted(per_rank.items())})
            if check is not None:
                check()

        write_atomic_h5(path, fill, self.locking)
        write_latest(self.directory, path.name)
        prune(self.directory, self.keep, protect=path)

    def checkpoints(self) -> list[Path]:
        """Published checkpoint files, newest first."""
        return list_checkpoints(self.directory)

    def load_latest(
        self, accept: Callable[[LoadedCheckpoint], object] | None = None
    ) -> LoadedCheckpoint | None:
        """The newest complete, valid checkpoint (None if there is none); collective if P > 1.

        Incomplete, corrupt or (``accept`` raising CheckpointError) unfitting files are
        skipped with a warning. With several ranks, all agree on the smallest step any rank
        could read, so they resume together.
        """
        found = _first_good(_candidates(self.directory), self.locking, accept)
        if not self._distributed:
            return found
        step = torch.tensor([found.step if found else -1], dtype=torch.int64)
        dist.all_reduce(step, op=dist.ReduceOp.MIN, group=self._side_group())
        agreed = int(step.item())
        if agreed < 0:
            return None
        if found is None or found.step != agreed:
            return read_checkpoint(self.directory / checkpoint_name(agreed), self.locking)
        return found
