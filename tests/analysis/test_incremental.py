"""``kfac-hpc collect`` from cached rows: the same tables and files as building them from a
fresh read, rows rebuilt only for changed runs or a changed context, and the Parquet child."""

from __future__ import annotations

import filecmp
import importlib
import os

import pytest

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.incremental import collect_tables
from kfac_hpc.analysis.output import build_tables, write_tables
from kfac_hpc.analysis.parquet import ParquetWriter
from kfac_hpc.contracts.targets import Target
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

collect_module = importlib.import_module("kfac_hpc.analysis.collect")
incremental = importlib.import_module("kfac_hpc.analysis.incremental")
PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.005}
TABLES = ("runs", "phases", "segments", "scaling")


def _sweep(root, count=12):
    runs = [
        SyntheticRun(
            f"r{i:02d}",
            2 ** (i % 3),
            0.05 * (1 + i % 4),
            PHASES,
            ranks_per_node=2,
            kfac=bool(i % 2),
            seed=i,
            steps=60,
            accuracy={30: 0.5 + 0.02 * i, 60: 0.9},
            target_accuracy=0.8,
            rank_skew=0.02,
            attempt_ends=(20,) if i % 5 == 0 else (),
            state="running" if i == 4 else ("error" if i == 7 else "done"),
        )
        for i in range(count)
    ]
    write_sweep(root, runs)


def _counting(monkeypatch):
    """(run dirs read from disk, runs whose rows were built), recorded from now on."""
    reads: list[str] = []
    built: list[str] = []
    real_read, real_rows = incremental.read_run_dir, incremental._rows_of

    def read(path, point=None):
        reads.append(path.name)
        return real_read(path, point)

    def rows(run, *args):
        built.append(run.path.name)
        return real_rows(run, *args)

    monkeypatch.setattr(incremental, "read_run_dir", read)
    monkeypatch.setattr(incremental, "_rows_of", rows)
    monkeypatch.setattr(collect_module, "RUNS_PER_WORKER", 10**9)  # in-process: countable
    return reads, built


@pytest.mark.parametrize("target", [None, Target("accuracy", 0.7), Target("loss", 0.4)])
def test_cached_rows_give_the_tables_and_files_of_a_fresh_read(tmp_path, target):
    _sweep(tmp_path / "s")
    fresh = build_tables(collect(tmp_path / "s", cache=False), target)
    for _ in range(2):  # built and cached, then from the cache
        collected = collect_tables(tmp_path / "s", target)
        for name in TABLES:
            assert getattr(collected.tables, name) == getattr(fresh, name), name
    assert collected.states == [row["state"] for row in fresh.runs]
    write_tables(fresh, tmp_path / "fresh")
    write_tables(collected.tables, tmp_path / "cached")
    names = sorted(p.name for p in (tmp_path / "fresh").iterdir())
    assert len(names) >= 8  # csv and jsonl of each table (and parquet with pyarrow)
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "fresh", tmp_path / "cached", names, shallow=False
    )
    assert (mismatch, errors) == ([], [])


def test_only_changed_runs_are_read_and_a_new_context_only_rebuilds_rows(tmp_path, monkeypatch):
    _sweep(tmp_path)
    reads, built = _counting(monkeypatch)
    collect_tables(tmp_path)
    assert len(reads) == len(built) == 12
    reads.clear(), built.clear()
    collect_tables(tmp_path)
    assert (reads, built) == ([], [])
    os.utime(tmp_path / "runs" / "r03" / "metrics.jsonl")
    (tmp_path / "runs" / "r04" / "done").write_text("")  # a marker appears
    collect_tables(tmp_path)
    assert sorted(reads) == sorted(built) == ["r03", "r04"]
    reads.clear(), built.clear()
    again = collect_tables(tmp_path, Target("accuracy", 0.6))  # another bar: rows, not reads
    assert reads == [] and len(built) == 12
    assert {row["target_accuracy"] for row in again.tables.runs} == {0.6}
    reads.clear(), built.clear()
    by_loss = collect_tables(tmp_path, Target("loss", 0.6))  # the same value, another metric
    assert reads == [] and len(built) == 12
    assert {(row["target_loss"], row["target_accuracy"]) for row in by_loss.tables.runs} == {
        (0.6, None)
    }


def test_parquet_child_reports_a_write_it_cannot_do(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs.parquet").mkdir()  # a folder where the file must go
    rows = [{"a": 1, "b": 2.5}]
    with ParquetWriter() as writer:
        writer.start({"runs": (rows, ["a", "b"])}, tmp_path / "out")
        with pytest.raises(OSError):
            writer.wait()


def test_parquet_child_that_gets_no_job_ends_with_the_block(tmp_path):
    with ParquetWriter() as writer:
        process = writer._process
    if process is not None:  # forked: it was told there is nothing to write, and ended
        assert not process.is_alive() and process.exitcode == 0


@pytest.mark.parametrize(
    "values",
    [
        [1, 2, None],
        [1, 2.5, None],
        [0.5, float("nan"), None],
        [True, False, None],
        ["a", None, "b"],
        [None, None],
        [1, "0.1", 2.0],  # mixed kinds: strings
        [True, 1],
        [{"a": 1}, [1, 2], None],
        [2**63 - 1, -(2**63 - 1)],
        [2**70, 1.5],
    ],
)
def test_arrow_inference_types_each_column_as_the_python_rules_do(values):
    pa = pytest.importorskip("pyarrow")
    from kfac_hpc.analysis.parquet import _arrow_column, _column

    kind, expected = _column(values)
    array = _arrow_column(pa, values)
    assert array.type == pa.type_for_alias(kind)
    got = array.to_pylist()
    assert len(got) == len(expected)
    assert all(a == b or (a != a and b != b) for a, b in zip(got, expected, strict=True))  # NaN
