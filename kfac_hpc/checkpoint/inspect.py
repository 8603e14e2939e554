"""``kfac-hpc checkpoint inspect|verify PATH``: what a checkpoint holds and whether it is intact.

PATH is a checkpoint file, a run directory or its ``checkpoints/`` folder. For a folder, the
files are the ones a resume tries, in its order (the file ``latest`` names, else the newest):
``verify`` runs the resume's own check (:func:`~kfac_hpc.checkpoint.manager.find_checkpoint`,
:func:`~kfac_hpc.checkpoint.manager.read_checkpoint`) and says which file a resume would take.
Exit codes: 0 valid, 1 corrupt/incomplete, 2 bad input (no such file, no checkpoint at all).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import h5py

from kfac_hpc.checkpoint.files import LATEST, open_h5, read_latest
from kfac_hpc.checkpoint.hdf5_tree import KIND, unescape_key, walk_datasets
from kfac_hpc.checkpoint.integrity import INTEGRITY
from kfac_hpc.checkpoint.manager import (
    checkpoint_directory,
    find_checkpoint,
    read_checkpoint,
    resume_candidates,
)
from kfac_hpc.checkpoint.training_state import CheckpointError, LoadedCheckpoint
from kfac_hpc.cli_errors import guard
from kfac_hpc.contracts.errors import InputError

__all__ = ["CheckpointReport", "checkpoint", "describe", "resolve_path"]


@dataclass
class CheckpointReport:
    """A summary of one file; ``problems`` is empty when every check passed."""

    path: Path
    step: int | None = None
    world_size: int | None = None
    strategy: str | None = None
    config_hash: str | None = None
    complete: bool = False
    versions: dict[str, str] = field(default_factory=dict)
    layers: dict[str, int] = field(default_factory=dict)  # K-FAC layer -> bytes of A and G
    groups_bytes: dict[str, int] = field(default_factory=dict)  # top-level group -> bytes
    datasets: int = 0
    problems: list[str] = field(default_factory=list)  # what the resume's check refused
    notes: list[str] = field(default_factory=list)  # what the summary could not read

    @property
    def valid(self) -> bool:
        """Whether a resume would accept the file (its check, :func:`read_checkpoint`)."""
        return not self.problems


def _checked_path(path: Path | str) -> Path:
    """PATH as given, existing; InputError (field ``PATH``) when it does not."""
    if not str(path).strip():
        raise InputError("PATH", "empty; give a checkpoint file, run dir or checkpoints/")
    path = Path(path)
    try:
        if not path.is_dir() and not path.is_file():
            raise InputError("PATH", f"{path} does not exist or is not a file")
    except OSError as exc:  # e.g. a name too long
        raise InputError("PATH", f"{str(path)[:60]!r}: {exc.strerror}") from None
    return path


def _no_checkpoint(path: Path) -> InputError:
    return InputError(
        "PATH", f"{path} holds no checkpoint file (ckpt-*.h5); give a .h5 file or a run dir"
    )


def resolve_path(path: Path | str) -> Path:
    """The checkpoint file PATH means: a file itself; for a folder the first file a resume
    tries (the one ``latest`` names, else the newest). InputError (field ``PATH``) if none."""
    path = _checked_path(path)
    if path.is_dir():
        candidates = resume_candidates(checkpoint_directory(path))
        if not candidates:
            raise _no_checkpoint(path)
        return candidates[0]
    return path


def pointer_problem(directory: Path) -> str | None:
    """Why ``directory/latest`` does not name a checkpoint file there, or None when it does."""
    latest = read_latest(directory)
    if latest is None:
        return f"{directory / LATEST} is missing or names no checkpoint"
    if not latest.is_file():
        return f"{directory / LATEST} names {latest.name}, which is not a file here"
    return None


def _attr(h5: h5py.File, name: str) -> object:
    value = h5.attrs.get(name)
    return value.decode() if isinstance(value, bytes) else value


def _scan(h5: h5py.File, report: CheckpointReport) -> None:
    report.complete = bool(h5.attrs.get("complete", False))
    step, world = _attr(h5, "step"), _attr(h5, "world_size")
    report.step = int(step) if step is not None else None  # type: ignore[call-overload]
    report.world_size = int(world) if world is not None else None  # type: ignore[call-overload]
    strategy, chash = _attr(h5, "strategy"), _attr(h5, "config_hash")
    report.strategy = strategy if isinstance(strategy, str) else None
    report.config_hash = chash if isinstance(chash, str) else None
    if "versions" in h5:
        report.versions = {k: str(_attr_of(h5["versions"], k)) for k in h5["versions"].attrs}
        report.versions.pop(KIND, None)
    layers = h5.get("kfac_state/layers")
    if isinstance(layers, h5py.Group):
        for name, group in layers.items():
            report.layers[unescape_key(name)] = sum(
                group[f].nbytes for f in ("A", "G") if isinstance(group.get(f), h5py.Dataset)
            )
    for name, obj in h5.items():
        if isinstance(obj, h5py.Group):
            report.groups_bytes[name] = sum(ds.nbytes for ds in walk_datasets(obj))
    report.datasets = sum(1 for _ in walk_datasets(h5))


def _attr_of(group: h5py.Group, name: str) -> object:
    value = group.attrs[name]
    return value.decode() if isinstance(value, bytes) else value


def describe(path: Path) -> CheckpointReport:
    """Open ``path`` read-only, read every dataset (verifying checksums) and summarise it."""
    report = CheckpointReport(path)
    try:
        with open_h5(path, "r") as h5:
            _scan(h5, report)
    except Exception as exc:  # a damaged file can fail anywhere; the full read below says how
        report.notes.append(f"metadata unreadable: {exc}")
    try:
        read_checkpoint(path)  # the resume's own check: every checksum, entry and attribute
    except CheckpointError as exc:
        report.problems.append(str(exc))
    return report


def _datasets(path: Path) -> int | None:
    """How many datasets ``path`` holds (metadata only), None when it cannot tell."""
    try:
        with open_h5(path, "r") as h5:
            return sum(1 for _ in walk_datasets(h5))
    except Exception:  # the file was verified a moment ago; a count is only a detail
        return None


def _ok_line(found: LoadedCheckpoint) -> str:
    count = _datasets(found.path)
    what = f"step {found.step}" + ("" if count is None else f", {count} datasets verified")
    if INTEGRITY not in found.tree:
        what += "; schema 1: written before integrity records, attributes not checksummed"
    return f"ok: {found.path} ({what})"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


@click.group("checkpoint")
def checkpoint() -> None:
    """Inspect and verify HDF5 checkpoints (see docs/checkpoint.md)."""


@checkpoint.command("inspect")
@click.argument("path", type=str)
@guard("checkpoint inspect")
def inspect_cmd(path: str) -> None:
    """Print what checkpoint PATH holds: step, world size, layers, sizes, validity."""
    report = describe(resolve_path(path))
    click.echo(f"file:        {report.path}")
    click.echo(f"step:        {report.step}")
    click.echo(f"world size:  {report.world_size}   strategy: {report.strategy}")
    click.echo(f"config hash: {report.config_hash}")
    click.echo("versions:    " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
    for group, nbytes in report.groups_bytes.items():
        click.echo(f"group {unescape_key(group):<20} {_mib(nbytes)}")
    if report.layers:
        click.echo(f"K-FAC layers ({len(report.layers)}), bytes of A+G:")
        for name, nbytes in report.layers.items():
            click.echo(f"  {name:<40} {_mib(nbytes)}")
    click.echo(f"datasets:    {report.datasets}")
    click.echo("valid:       " + ("yes" if report.valid else "NO"))
    for problem in report.problems:
        click.echo(f"  problem: {problem}")
    for note in report.notes:
        click.echo(f"  note: {note}")
    sys.exit(0 if report.valid else 1)


@checkpoint.command("verify")
@click.argument("path", type=str)
@guard("checkpoint verify")
def verify_cmd(path: str) -> None:
    """Run a resume's checks on PATH: exit 0 valid, 1 corrupt, 2 bad input.

    A file: every checksum, entry and attribute. A run dir or checkpoints/ folder: the files in
    the order a resume tries them, up to the one it would take (said when it is not the one
    `latest` names)."""
    target = _checked_path(path)
    if target.is_file():
        try:
            checked = read_checkpoint(target)
        except CheckpointError as exc:
            click.echo(f"corrupt: {exc}", err=True)
            sys.exit(1)
        click.echo(_ok_line(checked))
        sys.exit(0)
    directory = checkpoint_directory(target)
    found, skipped = find_checkpoint(directory)
    if found is None and not skipped:
        raise _no_checkpoint(target)
    pointer = pointer_problem(directory)
    if pointer is not None:
        click.echo(f"note: {pointer}; a resume tries the newest files first", err=True)
    for item in skipped:
        click.echo(f"corrupt: {item.path}: {item.reason}", err=True)
    if found is None:
        click.echo(f"corrupt: {directory}: no checkpoint a resume could use", err=True)
        sys.exit(1)
    fallback = "; a resume takes this file" if skipped or pointer is not None else ""
    click.echo(_ok_line(found) + fallback)
    sys.exit(1 if skipped else 0)
