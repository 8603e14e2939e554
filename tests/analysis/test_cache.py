"""The collector's per-run cache and process pool: a second collect re-reads only the runs whose
files changed, and cached, pooled and plain reads give the same tables."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from kfac_hpc.analysis.cache import CACHE_DIR, CACHE_FOLDER
from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep

collect_module = importlib.import_module("kfac_hpc.analysis.collect")
PHASES = {"forward": 0.01, "backward": 0.02, "grad_allreduce": 0.005}


def _sweep(root, count=40):
    runs = [
        SyntheticRun(
            f"r{i:02d}",
            2 ** (i % 3),
            0.05,
            PHASES,
            ranks_per_node=2,
            kfac=bool(i % 2),
            seed=i,
            steps=60,
            accuracy={30: 0.5, 60: 0.9},
            target_accuracy=0.8,
            rank_skew=0.02,
            attempt_ends=(20,) if i % 7 == 0 else (),
            state="running" if i == 5 else "done",
        )
        for i in range(count)
    ]
    write_sweep(root, runs)


def _reads(monkeypatch):
    """A list that records the run directories read from disk from now on."""
    seen: list[str] = []
    real = collect_module.read_run_dir

    def counting(path, point=None):
        seen.append(path.name)
        return real(path, point)

    monkeypatch.setattr(collect_module, "read_run_dir", counting)
    monkeypatch.setattr(collect_module, "RUNS_PER_WORKER", 10**9)  # in-process: countable
    return seen


def test_second_collect_rereads_only_changed_runs(tmp_path, monkeypatch):
    _sweep(tmp_path)
    plain = build_tables(collect(tmp_path, cache=False))
    assert not (tmp_path / CACHE_DIR).exists()
    reads = _reads(monkeypatch)
    first = build_tables(collect(tmp_path))
    assert len(reads) == 40
    assert len(list((tmp_path / CACHE_DIR / CACHE_FOLDER).glob("*.run"))) == 40
    reads.clear()
    cached = build_tables(collect(tmp_path))
    assert reads == []
    monkeypatch.chdir(tmp_path.parent)
    collect(Path(tmp_path.name))  # the same sweep, spelt relative: still cached
    assert reads == []
    assert cached == first == plain  # every table, every value
    metrics = tmp_path / "runs" / "r03" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(True)[:-2]))  # two records fewer
    (tmp_path / "runs" / "r05" / "done").write_text("")  # a marker appears
    os.utime(tmp_path / "runs" / "r07" / "config.json")  # only the mtime changes
    reads.clear()
    again = collect(tmp_path)
    assert sorted(reads) == ["r03", "r05", "r07"]
    assert again.runs[3].stats.windows == 5  # the train and eval records of step 60 are gone
    assert again.runs[5].state == "invalid"  # done marker without run.json: re-read, not stale


def test_pool_and_in_process_reads_agree(tmp_path, monkeypatch):
    _sweep(tmp_path, count=48)
    monkeypatch.setattr(collect_module, "RUNS_PER_WORKER", 4)  # a pool even on one CPU pair
    monkeypatch.setattr(collect_module, "_cpus", lambda: 2)
    pooled = build_tables(collect(tmp_path))  # read by two worker processes, then cached
    monkeypatch.setattr(collect_module, "RUNS_PER_WORKER", 10**9)
    plain = build_tables(collect(tmp_path, cache=False))
    assert pooled == plain


def test_unwritable_cache_is_skipped(tmp_path):
    _sweep(tmp_path, count=3)
    (tmp_path / CACHE_DIR).write_text("a file where the cache folder would go")
    assert len(collect(tmp_path).runs) == 3


def test_cache_of_another_version_is_ignored(tmp_path, monkeypatch):
    _sweep(tmp_path, count=3)
    collect(tmp_path)
    for path in (tmp_path / CACHE_DIR / CACHE_FOLDER).glob("*.run"):
        head, _, payload = path.read_text().partition("\n")
        path.write_text(head.replace("collect-cache", "collect-cache-0") + "\n" + payload)
    reads = _reads(monkeypatch)
    assert [r.state for r in collect(tmp_path).runs] == ["done"] * 3
    assert len(reads) == 3


def test_cache_text_reads_back_what_orjson_cannot_write():
    """NaN, infinities and integers beyond 64 bits (a damaged run.json's) survive the cache."""
    from kfac_hpc.analysis.cache import dumps, loads

    plain = {"a": [1.5, 2.0], "b": {"c": 2**63 + 1, "d": None}, "e": "x"}
    assert loads(dumps(plain)) == plain and not dumps(plain).startswith("=")
    for odd in ({"a": [1.5, float("inf")]}, {"b": {"c": 10**25}}, {"n": float("nan")}):
        back = loads(dumps(odd))
        assert repr(back) == repr(odd)  # NaN compares unequal to itself; its repr does not
