"""``kfac-hpc checkpoint inspect|verify PATH``: what a checkpoint holds and whether it is intact.

PATH is a checkpoint file, a run directory or its ``checkpoints/`` folder (then the file that
``latest`` names). Exit codes: 0 valid, 1 corrupt/incomplete, 2 bad input (no such file).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import h5py

from kfac_hpc.checkpoint.files import open_h5, read_latest
from kfac_hpc.checkpoint.hdf5_tree import KIND, unescape_key, walk_datasets
from kfac_hpc.checkpoint.manager import read_checkpoint
from kfac_hpc.checkpoint.training_state import CheckpointError
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
    problems: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.complete and not self.problems


def resolve_path(path: Path | str) -> Path:
    """The checkpoint file PATH means; InputError (field ``PATH``) if there is none."""
    if not str(path).strip():
        raise InputError("PATH", "empty; give a checkpoint file, run dir or checkpoints/")
    path = Path(path)
    try:
        if path.is_dir():
            directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
            latest = read_latest(directory)
            if latest is None or not latest.is_file():
                raise InputError("PATH", f"{path} holds no `latest` checkpoint; give a .h5 file")
            return latest
        if not path.is_file():
            raise InputError("PATH", f"{path} does not exist or is not a file")
    except OSError as exc:  # e.g. a name too long
        raise InputError("PATH", f"{str(path)[:60]!r}: {exc.strerror}") from None
    return path


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
        report.problems.append(f"metadata unreadable: {exc}")
    try:
        read_checkpoint(path)  # reads every dataset: HDF5 verifies each Fletcher-32 checksum
    except CheckpointError as exc:
        report.problems.append(str(exc))
    return report


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
    sys.exit(0 if report.valid else 1)


@checkpoint.command("verify")
@click.argument("path", type=str)
@guard("checkpoint verify")
def verify_cmd(path: str) -> None:
    """Check every checksum of checkpoint PATH: exit 0 valid, 1 corrupt, 2 bad input."""
    report = describe(resolve_path(path))
    if report.valid:
        click.echo(f"ok: {report.path} (step {report.step}, {report.datasets} datasets verified)")
        sys.exit(0)
    click.echo(f"corrupt: {report.path}: {'; '.join(report.problems)}", err=True)
    sys.exit(1)
