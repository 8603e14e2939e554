"""The tables of a collection, written as CSV / JSON Lines / Parquet and printed for terminals."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kfac_hpc.analysis.collect import Collection
from kfac_hpc.analysis.metrics import SCALING_COLUMNS, scaling_rows
from kfac_hpc.analysis.tables import (
    PHASE_COLUMNS,
    RUN_COLUMNS,
    SEGMENT_COLUMNS,
    phase_rows,
    run_row,
    segment_rows,
    varying_params,
)
from kfac_hpc.contracts.atomic import write_text_atomic

Row = dict[str, Any]
_INT64_MAX = 2**63 - 1
_FLOAT_MAX = sys.float_info.max
FORMATS = ("table", "csv", "json")
# The runs-table columns a terminal shows (the files hold them all).
RUN_TABLE_VIEW = (
    "run_id",
    "state",
    "optimizer_label",
    "nodes",
    "world_size",
    "segments",
    "samples_per_s",
    "step_mean_s",
    "time_to_target_s",
    "comm_fraction",
    "reason",
)


@dataclass(frozen=True)
class Tables:
    """Every table of one collection; each row is a flat dict keyed by the table's columns."""

    runs: list[Row]
    phases: list[Row]
    segments: list[Row]
    scaling: list[Row]

    def named(self) -> dict[str, tuple[list[Row], Sequence[str]]]:
        """File stem -> (rows, columns)."""
        return {
            "runs": (self.runs, RUN_COLUMNS),
            "phases": (self.phases, PHASE_COLUMNS),
            "segments": (self.segments, SEGMENT_COLUMNS),
            "scaling": (self.scaling, SCALING_COLUMNS),
        }


def build_tables(collection: Collection, target_accuracy: float | None = None) -> Tables:
    """All tables of ``collection``; ``target_accuracy`` overrides the runs' own targets."""
    runs, phases, segments = [], [], []
    varying = varying_params(collection.runs)
    for run in collection.runs:
        row = run_row(run, varying, target_accuracy)
        runs.append(row)
        phases.extend(phase_rows(run, row))
        segments.extend(segment_rows(run))
    return Tables(runs, phases, segments, scaling_rows(runs))


def _csv_text(rows: list[Row], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _jsonl_text(rows: list[Row]) -> str:
    return "".join(json.dumps(row, sort_keys=False) + "\n" for row in rows)


def _column(values: list[Any]) -> tuple[str, list[Any]]:
    """One Parquet column's type (bool, int64, double or string) and its values: a column whose
    values mix kinds (a damaged run's junk) becomes strings rather than failing the write."""
    present = [v for v in values if v is not None]
    if present and all(type(v) is bool for v in present):
        return "bool", values
    if all(type(v) is int and -_INT64_MAX <= v <= _INT64_MAX for v in present):
        return "int64", values
    if all(type(v) is float or (type(v) is int and abs(v) <= _FLOAT_MAX) for v in present):
        return "double", [None if v is None else float(v) for v in values]
    as_text = [v if isinstance(v, str) else json.dumps(v, default=str) for v in present]
    texts = iter(as_text)
    return "string", [None if v is None else next(texts) for v in values]


def _write_parquet(path: Path, rows: list[Row], columns: Sequence[str]) -> bool:
    """Write Parquet when pyarrow is importable; False when it is not."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return False
    arrays, fields = [], []
    for name in columns:
        kind, values = _column([r.get(name) for r in rows])
        arrays.append(pa.array(values, type=pa.type_for_alias(kind)))
        fields.append(name)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_arrays(arrays, names=fields), tmp)
    os.replace(tmp, path)
    return True


def write_tables(tables: Tables, out_dir: Path) -> list[Path]:
    """Write ``<table>.csv`` and ``<table>.jsonl`` (and ``.parquet``) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (rows, columns) in tables.named().items():
        for suffix, text in (("csv", _csv_text(rows, columns)), ("jsonl", _jsonl_text(rows))):
            write_text_atomic(out_dir / f"{stem}.{suffix}", text)
            written.append(out_dir / f"{stem}.{suffix}")
        if _write_parquet(out_dir / f"{stem}.parquet", rows, columns):
            written.append(out_dir / f"{stem}.parquet")
    return written


def cell_text(value: Any) -> str:
    """A value as a short human string: 4 significant digits for floats, '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def text_table(rows: list[Row], columns: Sequence[str], max_width: int = 64) -> str:
    """A fixed-width text table (cells longer than ``max_width`` are shortened)."""
    cells = [[cell_text(r.get(c))[:max_width] for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def render(rows: list[Row], columns: Sequence[str], fmt: str, view: Sequence[str]) -> str:
    """``rows`` for a terminal: ``table`` shows the ``view`` columns, csv/json show all."""
    if fmt == "csv":
        return _csv_text(rows, columns).rstrip("\n")
    if fmt == "json":
        return json.dumps([{c: r.get(c) for c in columns} for r in rows], indent=1)
    return text_table(rows, view)
