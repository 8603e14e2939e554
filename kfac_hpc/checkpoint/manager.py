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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.distributed as dist

from kfac_hpc.checkpoint.files import (
    checkpoint_name,
    checkpoint_step,
    list_checkpoints,
    open_h5,
    prune,
    read_latest,
    remove_stale_temporaries,
    write_atomic_h5,
    write_latest,
)
from kfac_hpc.checkpoint.hdf5_tree import read_tree, write_tree
from kfac_hpc.checkpoint.integrity import INTEGRITY, integrity_digest
from kfac_hpc.checkpoint.training_state import (
    READABLE_SCHEMAS,
    CheckpointError,
    CheckpointMismatchError,
    LoadedCheckpoint,
    TrainingState,
    check_schema,
    check_shapes,
    saved_method_state,
)
from kfac_hpc.contracts.method_state import Checkpointable

__all__ = [
    "CheckpointManager",
    "SkippedCheckpoint",
    "find_checkpoint",
    "init_factors_from",
    "load_checkpoint",
    "read_checkpoint",
    "resume_candidates",
]


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint file a resume passed over, and why (``reason`` does not repeat the path)."""

    path: Path
    reason: str

    @classmethod
    def of(cls, path: Path, error: CheckpointError) -> SkippedCheckpoint:
        text, prefix = str(error), f"{path}: "
        return cls(path, text[len(prefix) :] if text.startswith(prefix) else text)

    def record(self) -> dict[str, str]:
        """The entry of ``run.json``'s ``skipped_checkpoints``."""
        return {"file": self.path.name, "reason": self.reason}


def _warn(skipped: SkippedCheckpoint) -> None:
    warnings.warn(f"skipping checkpoint: {skipped.path}: {skipped.reason}", stacklevel=3)


def _check_integrity(path: Path, tree: Mapping[str, Any], version: int) -> None:
    """CheckpointError unless the file's integrity record matches the tree read from it (a
    file of schema 1 predates the record and is read without it)."""
    stored = tree.get(INTEGRITY)
    if stored is None:
        if version >= 2:
            raise CheckpointError(
                f"{path}: no integrity record (a schema {version} file carries one): "
                "altered after it was written"
            )
        return
    if stored != integrity_digest(tree):
        raise CheckpointError(
            f"{path}: integrity checksum mismatch: an attribute (step, world size, data "
            "position, config hash, schema, ...) or a dataset was changed, added or deleted "
            "after the file was written"
        )


def read_checkpoint(path: Path, locking: bool | str | None = None) -> LoadedCheckpoint:
    """Read and verify one checkpoint file; :class:`CheckpointError` says what is wrong.

    The one check of a file: a resume runs it on every candidate and ``kfac-hpc checkpoint
    verify`` runs it on the file it is given. The file must be complete, of a known schema,
    every dataset's Fletcher-32 checksum must verify (the whole file is read), it must hold
    every entry a resume reads, its integrity record must match its attributes and structure,
    and a ``ckpt-<step>.h5`` name must agree with its ``step`` attribute.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with open_h5(path, "r", locking) as h5:
            if not bool(h5.attrs.get("complete", False)):
                raise CheckpointError(f"{path}: incomplete (the writer did not finish)")
            version = int(h5.attrs.get("schema_version", -1))
            if version not in READABLE_SCHEMAS:
                known = ", ".join(map(str, READABLE_SCHEMAS))
                raise CheckpointError(
                    f"{path}: schema version {version}, this kfac-hpc reads {known}"
                )
            tree = read_tree(h5)
        check_schema(path, tree)
        _check_integrity(path, tree, version)
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged file can make h5py fail in many ways; all mean corrupt
        raise CheckpointError(f"{path}: corrupt or unreadable ({exc})") from exc
    named = checkpoint_step(path)
    if named is not None and named != tree["step"]:
        raise CheckpointError(
            f"{path}: its step attribute says {tree['step']}, its name says {named}"
        )
    return LoadedCheckpoint(path, tree)


def resume_candidates(directory: Path) -> list[Path]:
    """Checkpoints to try, best first: the one ``latest`` names, then the others newest first."""
    files = list_checkpoints(directory)
    latest = read_latest(directory)
    if latest is not None and latest in files:
        files.remove(latest)
        files.insert(0, latest)
    return files


def checkpoint_directory(path: Path) -> Path:
    """The folder of checkpoints ``path`` means: a run dir's ``checkpoints/``, else itself."""
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def load_checkpoint(
    path: Path | str,
    locking: bool | str | None = None,
    on_skip: Callable[[SkippedCheckpoint], None] | None = None,
) -> LoadedCheckpoint:
    """Load a checkpoint file, or the latest good one of a run dir / checkpoints dir (the files
    passed over go to ``on_skip``; default: a warning)."""
    path = Path(path)
    if path.is_dir():
        found, skipped = find_checkpoint(checkpoint_directory(path), locking)
        for item in skipped:
            (on_skip or _warn)(item)
        if found is None:
            raise CheckpointError(f"{path}: no complete, valid checkpoint found")
        return found
    return read_checkpoint(path, locking)


def find_checkpoint(
    directory: Path,
    locking: bool | str | None = None,
    accept: Callable[[LoadedCheckpoint], object] | None = None,
) -> tuple[LoadedCheckpoint | None, list[SkippedCheckpoint]]:
    """The checkpoint a resume of ``directory`` takes, and the files it passed over on the way.

    Candidates are the file ``latest`` names, then every other ``ckpt-*.h5`` newest first; the
    first one that :func:`read_checkpoint` verifies and ``accept`` (raising CheckpointError
    when not) takes is used. ``kfac-hpc checkpoint verify RUN_DIR`` asks the same.
    """
    skipped: list[SkippedCheckpoint] = []
    for candidate in resume_candidates(directory):
        try:
            found = read_checkpoint(candidate, locking)
            if accept is not None:
                accept(found)
            return found, skipped
        except CheckpointError as exc:
            skipped.append(SkippedCheckpoint.of(candidate, exc))
    return None, skipped


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
            ranks_tree = {str(r): tree for r, tree in sorted(per_rank.items())}
            write_tree(h5, state.shared, compression=self.compression)
            write_tree(h5.create_group("ranks", track_order=True), ranks_tree)
            if check is not None:
                check()
            # what read_tree gives back of this file: the record a reader recomputes
            digest = integrity_digest({**state.shared, "ranks": ranks_tree}).encode("utf-8")
            h5.attrs[INTEGRITY] = np.array(digest, dtype=h5py.string_dtype("utf-8", len(digest)))

        write_atomic_h5(path, fill, self.locking)
        write_latest(self.directory, path.name)
        prune(self.directory, self.keep, protect=path)

    def checkpoints(self) -> list[Path]:
        """Published checkpoint files, newest first."""
        return list_checkpoints(self.directory)

    def load_latest(
        self,
        accept: Callable[[LoadedCheckpoint], object] | None = None,
        on_skip: Callable[[SkippedCheckpoint], None] | None = None,
    ) -> LoadedCheckpoint | None:
        """The newest complete, valid checkpoint (None if there is none); collective if P > 1.

        Incomplete, corrupt or (``accept`` raising CheckpointError) unfitting files are
        skipped (:func:`find_checkpoint`), each handed to ``on_skip`` (default: a warning).
        With several ranks, all agree on the smallest step any rank could read, so they resume
        together.
        """
        found, skipped = find_checkpoint(self.directory, self.locking, accept)
        for item in skipped:
            (on_skip or _warn)(item)
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
