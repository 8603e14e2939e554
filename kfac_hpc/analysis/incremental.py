"""What ``kfac-hpc collect`` runs: a sweep's tables, built again only for the runs that changed.

The per-run cache (:mod:`kfac_hpc.analysis.cache`) already spares re-reading unchanged run
directories; this module also keeps each run's table rows and their CSV / JSON Lines text in it,
so that an unchanged run costs a signature check and one small parse: no decoding of its
windows, no row building, no formatting. A run's rows depend on more than the run: on the
manifest parameters that vary across the sweep (its group label), the target asked
for, and the path the run is reached by. Those are the rows' context; rows cached in another
context are built again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_hpc.analysis.cache import RunCache, encode, signature
from kfac_hpc.analysis.collect import Item, collection_items, in_pool
from kfac_hpc.analysis.metrics import scaling_rows
from kfac_hpc.analysis.output import Tables, csv_body, jsonl_bytes
from kfac_hpc.analysis.rundir import RunData, read_run_dir
from kfac_hpc.analysis.tables import (
    PHASE_COLUMNS,
    RUN_COLUMNS,
    SEGMENT_COLUMNS,
    phase_rows,
    run_row,
    segment_rows,
    varying_of,
)
from kfac_hpc.contracts.targets import Target

JSON = dict[str, Any]
# The tables built run by run, with their columns (scaling is built from the runs table).
PER_RUN = {"runs": RUN_COLUMNS, "phases": PHASE_COLUMNS, "segments": SEGMENT_COLUMNS}


@dataclass(frozen=True)
class Collected:
    """The tables of one sweep (or folder) and the state of each of its runs."""

    source: Path
    tables: Tables
    states: list[str]


def _rows_of(run: RunData, varying: frozenset[str], target: Target | None, context: str) -> JSON:
    """The run's rows of each per-run table and their CSV and JSON Lines text."""
    row = run_row(run, varying, target)
    tables = {"runs": [row], "phases": phase_rows(run, row), "segments": segment_rows(run)}
    return {
        "context": context,
        **{
            stem: [rows, csv_body(rows, PER_RUN[stem]), jsonl_bytes(rows).decode("utf-8")]
            for stem, rows in tables.items()
        },
    }


@dataclass(frozen=True)
class _Task:
    """One run whose rows must be built: what a pool worker needs to build and cache them."""

    source: Path
    item: Item
    sig: str
    varying: frozenset[str]
    target: Target | None
    context: str


def _build_rows(task: _Task) -> JSON:
    """The rows of ``task``'s run, from its cached read or read now; both cached."""
    store = RunCache(task.source)
    path, point = task.item
    run = store.run(path, point, task.sig)
    if run is None:
        run = read_run_dir(path, point)
        store.add(run, task.sig, encode(run))
    rows = _rows_of(run, task.varying, task.target, task.context)
    store.set_rows(path, task.sig, rows)
    return rows


def collect_tables(source: Path, target: Target | None = None) -> Collected:
    """Every table of ``source``, as :func:`~kfac_hpc.analysis.output.build_tables` builds
    them from :func:`~kfac_hpc.analysis.collect.collect`, reusing each unchanged run's rows.

    Raises :class:`~kfac_hpc.analysis.collect.CollectError` as ``collect`` does.
    """
    items, _ = collection_items(source)
    varying = varying_of(
        params for _, point in items if isinstance(params := (point or {}).get("params"), dict)
    )
    store = RunCache(source)
    per_run: list[JSON | None] = []
    tasks: list[tuple[int, _Task]] = []
    shown = sorted(varying)
    for index, (path, point) in enumerate(items):
        sig = signature(path, point)
        context = json.dumps(
            [str(path), shown, None if target is None else [target.metric, target.value]]
        )
        rows = store.rows(path, sig, context)
        per_run.append(rows)
        if rows is None:
            task = _Task(source, (path, point), sig, varying, target, context)
            tasks.append((index, task))
    for (index, _), rows in zip(tasks, in_pool(_build_rows, [t for _, t in tasks]), strict=True):
        per_run[index] = rows
    if tasks:
        store.prune([path for path, _ in items])
    done = [rows for rows in per_run if rows is not None]
    tables = {stem: [r for rows in done for r in rows[stem][0]] for stem in PER_RUN}
    bodies = {
        stem: (
            "".join(rows[stem][1] for rows in done),
            "".join(rows[stem][2] for rows in done).encode("utf-8"),
        )
        for stem in PER_RUN
    }
    return Collected(
        source,
        Tables(**tables, scaling=scaling_rows(tables["runs"]), bodies=bodies),
        [row["state"] for row in tables["runs"]],
    )
