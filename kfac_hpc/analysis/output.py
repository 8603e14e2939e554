"""The tables of a collection, written as CSV / JSON Lines / Parquet and printed for terminals."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from kfac_hpc.analysis.collect import Collection
from kfac_hpc.analysis.humanize import Column, render_columns
from kfac_hpc.analysis.metrics import SCALING_COLUMNS, scaling_rows
from kfac_hpc.analysis.parquet import ParquetWriter
from kfac_hpc.analysis.tables import (
    PHASE_COLUMNS,
    RUN_COLUMNS,
    SEGMENT_COLUMNS,
    phase_rows,
    run_row,
    segment_rows,
    varying_params,
)
from kfac_hpc.contracts.atomic import write_bytes_atomic, write_text_atomic
from kfac_hpc.contracts.targets import Target

Row = dict[str, Any]
FORMATS = ("table", "csv", "json")
# The runs-table columns a terminal shows (the files hold them all).
RUN_TABLE_VIEW = (
    Column("run_id", "run"),
    Column("state", "state"),
    Column("optimizer_label", "method"),
    Column("nodes", "nodes", "count"),
    Column("world_size", "ranks", "count"),
    Column("segments", "attempts", "count"),
    Column("samples_per_s", "throughput", "rate"),
    Column("step_mean_s", "step", "time"),
    Column("time_to_target_s", "time to target", "time"),
    Column("comm_fraction", "communication", "percent"),
    Column("reason", "reason"),
)


@dataclass(frozen=True)
class Tables:
    """Every table of one collection; each row is a flat dict keyed by the table's columns.

    ``bodies`` holds, for the tables whose text is already known (kept in the collector's
    cache), their CSV lines without the header and their JSON Lines.
    """

    runs: list[Row]
    phases: list[Row]
    segments: list[Row]
    scaling: list[Row]
    bodies: dict[str, tuple[str, bytes]] = field(default_factory=dict)

    def named(self) -> dict[str, tuple[list[Row], Sequence[str]]]:
        """File stem -> (rows, columns)."""
        return {
            "runs": (self.runs, RUN_COLUMNS),
            "phases": (self.phases, PHASE_COLUMNS),
            "segments": (self.segments, SEGMENT_COLUMNS),
            "scaling": (self.scaling, SCALING_COLUMNS),
        }


def build_tables(collection: Collection, target: Target | None = None) -> Tables:
    """All tables of ``collection``; ``target`` overrides the runs' own targets."""
    runs, phases, segments = [], [], []
    varying = varying_params(collection.runs)
    for run in collection.runs:
        row = run_row(run, varying, target)
        runs.append(row)
        phases.extend(phase_rows(run, row))
        segments.extend(segment_rows(run))
    return Tables(runs, phases, segments, scaling_rows(runs))


def csv_body(rows: list[Row], columns: Sequence[str]) -> str:
    """``rows`` as CSV lines, without the header."""
    buffer = io.StringIO()
    csv.writer(buffer).writerows([[row.get(c) for c in columns] for row in rows])
    return buffer.getvalue()


def _csv_text(rows: list[Row], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer).writerow(columns)
    return buffer.getvalue() + csv_body(rows, columns)


def _jsonl_line(row: Row) -> bytes:
    """``row`` as one JSON line: orjson (NaN and infinities become null, as JSON requires),
    the standard library for what orjson refuses (an integer beyond 64 bits)."""
    try:
        return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        return (json.dumps(row) + "\n").encode("utf-8")


def jsonl_bytes(rows: list[Row]) -> bytes:
    return b"".join([_jsonl_line(row) for row in rows])


def write_tables(tables: Tables, out_dir: Path, parquet: ParquetWriter | None = None) -> list[Path]:
    """Write ``<table>.csv`` and ``<table>.jsonl`` (and ``.parquet``) into ``out_dir``; the
    Parquet files by ``parquet`` when given (one started before collecting), else by a new one."""
    if parquet is None:
        with ParquetWriter() as writer:
            return write_tables(tables, out_dir, writer)
    out_dir.mkdir(parents=True, exist_ok=True)
    named = tables.named()
    parquet.start({stem: (rows, list(columns)) for stem, (rows, columns) in named.items()}, out_dir)
    written = []
    for stem, (rows, columns) in named.items():
        body, lines = tables.bodies.get(stem) or (csv_body(rows, columns), jsonl_bytes(rows))
        # Not fsync'd: the tables are made again from the run directories by collecting.
        write_text_atomic(out_dir / f"{stem}.csv", _csv_text([], columns) + body, durable=False)
        write_bytes_atomic(out_dir / f"{stem}.jsonl", lines, durable=False)
        written += [out_dir / f"{stem}.csv", out_dir / f"{stem}.jsonl"]
    return written + parquet.wait()


def text_table(rows: list[Row], view: Sequence[Column], max_width: int = 64) -> str:
    """An aligned text table for people: titles with units, 3 significant digits, numbers
    right-aligned (cells longer than ``max_width`` are shortened)."""
    titles, cells = render_columns(rows, view)
    cells = [[cell[:max_width] for cell in row] for row in cells]
    widths = [max([len(t)] + [len(row[i]) for row in cells]) for i, t in enumerate(titles)]
    right = [column.kind != "text" for column in view]

    def line(texts: Sequence[str]) -> str:
        parts = zip(texts, widths, right, strict=True)
        return "  ".join(t.rjust(w) if r else t.ljust(w) for t, w, r in parts).rstrip()

    return "\n".join([line(titles), *(line(row) for row in cells)])


def render(rows: list[Row], columns: Sequence[str], fmt: str, view: Sequence[Column]) -> str:
    """``rows`` for a terminal: ``table`` shows the ``view`` columns for people, csv/json
    show every column as the files hold it."""
    if fmt == "csv":
        return _csv_text(rows, columns).rstrip("\n")
    if fmt == "json":
        return json.dumps([{c: r.get(c) for c in columns} for r in rows], indent=1)
    return text_table(rows, view)
