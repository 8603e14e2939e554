"""The tables' Parquet copies, written by a forked process started before collecting.

Importing pyarrow (and numpy with it) takes longer than collecting a thousand unchanged runs
from the cache; a :class:`ParquetWriter` forks a process that imports it while the parent
collects, then receives the rows and writes the files while the parent writes CSV and JSON Lines.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

Row = dict[str, Any]
Named = dict[str, tuple[list[Row], list[str]]]  # file stem -> (rows, columns)
_INT64_MAX = 2**63 - 1
_FLOAT_MAX = sys.float_info.max


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


def _arrow_column(pa: Any, values: list[Any]) -> Any:
    """The Arrow array of one column, typed as :func:`_column` types it: pyarrow's own
    inference (C++) when it gives one of those types, :func:`_column` otherwise."""
    try:
        array = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        array = None
    if array is not None:
        if pa.types.is_null(array.type):  # no value at all: an int64 column of nulls
            return pa.array(values, type=pa.int64())
        if array.type in (pa.int64(), pa.float64(), pa.bool_(), pa.string()):
            return array
    kind, converted = _column(values)
    return pa.array(converted, type=pa.type_for_alias(kind))


def write_parquet(path: Path, rows: list[Row], columns: Sequence[str]) -> bool:
    """Write Parquet when pyarrow is importable; False when it is not."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return False
    arrays, fields = [], []
    for name in columns:
        arrays.append(_arrow_column(pa, [r.get(name) for r in rows]))
        fields.append(name)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_arrays(arrays, names=fields), tmp)
    os.replace(tmp, path)
    return True


def _write_all(named: Named, out_dir: Path) -> list[str]:
    """Write every table of ``named``; the paths written (none without pyarrow)."""
    return [
        str(out_dir / f"{stem}.parquet")
        for stem, (rows, columns) in named.items()
        if write_parquet(out_dir / f"{stem}.parquet", rows, columns)
    ]


class ParquetWriter:
    """Writes Parquet files in a forked child (in this process where fork is unavailable).

    ``with ParquetWriter() as writer: ...; writer.start(named, out_dir); ...; writer.wait()``
    """

    def __init__(self) -> None:
        self._process: Any = None
        self._jobs: Any = None  # parent's end of the pipe to the child
        self._results: Any = None  # parent's end of the pipe from the child
        self._inline: list[str] | None = None
        self._started = False

    def __enter__(self) -> ParquetWriter:
        if "fork" not in multiprocessing.get_all_start_methods():
            return self
        context = multiprocessing.get_context("fork")
        job_out, self._jobs = context.Pipe(duplex=False)
        self._results, result_in = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child, args=(job_out, self._jobs, result_in), daemon=True
        )
        self._process.start()
        job_out.close()
        result_in.close()
        return self

    def start(self, named: Named, out_dir: Path) -> None:
        """Hand over the tables; the files are written while the caller goes on."""
        self._started = True
        if self._process is None:
            self._inline = _write_all(named, out_dir)
        else:
            self._jobs.send((named, out_dir))

    def wait(self) -> list[Path]:
        """The Parquet files written; OSError when the child could not write them."""
        if self._process is None:
            return [Path(p) for p in self._inline or []]
        try:
            status, value = self._results.recv()
        except EOFError:  # the child died before answering
            status, value = "error", f"the Parquet writer exited with {self._process.exitcode}"
        if status != "ok":
            raise OSError(value)
        return [Path(p) for p in value]

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._process is None:
            return
        if not self._started:
            with contextlib.suppress(OSError):
                self._jobs.send(None)
        self._jobs.close()
        self._process.join()
        self._results.close()


def _child(jobs: Any, parent_end: Any, results: Any) -> None:
    """The forked writer: import pyarrow, then write the one job it is sent (None: nothing)."""
    parent_end.close()  # so that the parent's exit reads as end of file here
    with contextlib.suppress(ImportError):
        import pyarrow.parquet  # noqa: F401  (the import is the point: done while waiting)
    try:
        job = jobs.recv()
    except EOFError:
        return
    if job is None:
        return
    try:
        results.send(("ok", _write_all(*job)))
    except OSError as exc:
        results.send(("error", str(exc)))
