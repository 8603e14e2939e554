"""Finding the runs of a sweep: from ``manifest.json`` when there is one, else by scanning.

A sweep directory's manifest lists every point, so points that never started still become rows.
Without a manifest, any folder holding run directories (at most :data:`SCAN_DEPTH` levels down)
is collected; a run directory itself is a collection of one.

Run directories are read by a pool of processes, one per CPU, and their reads kept in a per-run
cache (:mod:`kfac_hpc.analysis.cache`): collecting again re-reads only the changed runs.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.cache import RunCache, encode
from kfac_hpc.analysis.rundir import RunData, read_run_dir
from kfac_hpc.contracts.rundir import CONFIG, METRICS, RUN, Marker

# Files whose presence makes a folder a run directory.
RUN_DIR_FILES = frozenset({CONFIG, METRICS, RUN, Marker.DONE.value, Marker.ERROR.value})
SCAN_DEPTH = 4
# Below this many runs to read per worker, starting processes costs more than it saves.
RUNS_PER_WORKER = 16
T = TypeVar("T")
R = TypeVar("R")


class CollectError(Exception):
    """The input cannot be collected at all (exit code 2); the message says how to fix it."""


@dataclass
class Collection:
    """All runs of one sweep (or folder), in manifest order or sorted by path."""

    source: Path
    runs: list[RunData]
    manifest: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        """The sweep's name from its manifest, else the folder's name."""
        name = (self.manifest or {}).get("name")
        return name if isinstance(name, str) and name else self.source.resolve().name

    @property
    def all_done(self) -> bool:
        """True when every run finished successfully."""
        return all(run.state == schema.DONE for run in self.runs)


def _manifest_points(manifest: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    points = manifest.get("points")
    if isinstance(points, dict):  # keyed by point_id
        points = [{"point_id": key, **value} for key, value in points.items()]
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise CollectError(f"{path}: field 'points' must be a list of objects")
    return points


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CollectError(
            f"{path}: unreadable ({exc}); repair it, or collect the run folder directly: "
            f"kfac-hpc collect {path.parent / 'runs'}"
        ) from exc
    if not isinstance(manifest, dict):
        raise CollectError(f"{path}: expected a JSON object with a 'points' list")
    return manifest


def _is_run_dir(names: set[str]) -> bool:
    return not RUN_DIR_FILES.isdisjoint(names)


def find_run_dirs(root: Path, depth: int = SCAN_DEPTH) -> list[Path]:
    """Run directories under ``root`` (``root`` itself if it is one), sorted by path."""
    found: list[Path] = []
    stack = [(root, 0)]
    while stack:
        folder, level = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        if _is_run_dir({e.name for e in entries}):
            found.append(folder)
            continue  # checkpoints/ and friends are not runs
        if level < depth:
            stack.extend(
                (Path(e.path), level + 1)
                for e in entries
                if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
            )
    return sorted(found)


Item = tuple[Path, dict[str, Any] | None]  # a run directory and its manifest point


def _read_encoded(item: Item) -> tuple[RunData, str]:
    run = read_run_dir(*item)
    return run, encode(run)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def in_pool(work: Callable[[T], R], tasks: list[T]) -> list[R]:
    """``[work(t) for t in tasks]``, in a pool of one process per CPU when the tasks are many
    (``work`` must be a module-level function)."""
    workers = min(_cpus(), len(tasks) // RUNS_PER_WORKER)
    if workers < 2:
        return [work(task) for task in tasks]
    # fork: the workers inherit the imported package instead of importing it again
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    chunk = max(1, len(tasks) // (workers * 8))
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(work, tasks, chunksize=chunk))


def read_runs(source: Path, items: list[Item], *, cache: bool = True) -> list[RunData]:
    """The runs of ``items`` in order: unchanged ones from ``source``'s cache, the others
    read from disk (and cached). ``cache=False`` reads everything."""
    if not cache:
        return [read_run_dir(*item) for item in items]
    store = RunCache(source)
    runs: list[RunData | None] = []
    todo: list[tuple[int, str]] = []
    for index, (path, point) in enumerate(items):
        run, sig = store.lookup(path, point)
        runs.append(run)
        if run is None:
            todo.append((index, sig))
    fresh = in_pool(_read_encoded, [items[i] for i, _ in todo])
    for (index, sig), (run, encoded) in zip(todo, fresh, strict=True):
        runs[index] = run
        store.add(run, sig, encoded)
    if fresh:
        store.prune([path for path, _ in items])
    return [run for run in runs if run is not None]


def collection_items(source: Path) -> tuple[list[Item], dict[str, Any] | None]:
    """The run directories of ``source`` with their manifest points, and its manifest.

    Raises :class:`CollectError` when ``source`` is not a directory, its manifest is
    unreadable, or it holds no run at all.
    """
    if not source.is_dir():
        raise CollectError(f"{source}: not a directory; pass a sweep directory or run folder")
    manifest_path = source / "manifest.json"
    if manifest_path.exists():
        manifest = _read_manifest(manifest_path)
        points = _manifest_points(manifest, manifest_path)
        if not points:
            raise CollectError(f"{manifest_path}: lists no points; was the sweep expanded?")
        return [(_point_dir(source, p), p) for p in points], manifest
    dirs = find_run_dirs(source)
    if not dirs:
        raise CollectError(
            f"{source}: no manifest.json and no run directory (a folder with config.json, "
            "metrics.jsonl or run.json) found; pass a sweep directory or run folder"
        )
    return [(d, None) for d in dirs], None


def collect(source: Path, *, cache: bool = True) -> Collection:
    """Read every run of ``source`` (a sweep directory or a folder of run directories).

    Raises :class:`CollectError` as :func:`collection_items` does. ``cache=False`` ignores
    the per-run cache.
    """
    items, manifest = collection_items(source)
    return Collection(source, read_runs(source, items, cache=cache), manifest)


def _point_dir(sweep_dir: Path, point: dict[str, Any]) -> Path:
    run_dir = point.get("run_dir")
    if isinstance(run_dir, str) and run_dir:
        return sweep_dir / run_dir  # an absolute run_dir stays absolute
    return sweep_dir / "runs" / str(point.get("point_id", "unknown"))
