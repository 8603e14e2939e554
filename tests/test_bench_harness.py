"""benchmarks/harness.py: statistics, interleaved rounds, targets, results JSON and the exit
codes of ``--check``, without running a real benchmark."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_harness", BENCHMARKS / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


harness = _load_harness()


def test_stats_are_median_min_max_over_rounds() -> None:
    s = harness.Stats.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.n) == (2.5, 1.0, 10.0, 4)
    assert harness.stats([5.0]) == {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1}
    assert f"{harness.Stats.of([1.0, 1.5, 2.0]):.2f}" == "1.50 (1.00–2.00)"
    assert harness.Stats.of([0.001, 0.002, 0.003]).scaled(1e3).median == pytest.approx(2.0)
    with pytest.raises(ValueError):
        harness.Stats.of([])


def test_ratios_are_taken_round_by_round() -> None:
    assert harness.ratios([2.0, 6.0], [1.0, 3.0]) == [2.0, 2.0]
    with pytest.raises(ValueError):
        harness.ratios([1.0], [1.0, 2.0])


def test_rotation_puts_every_variant_first_equally_often() -> None:
    names = ["a", "b", "c"]
    orders = [harness.rotation(names, r) for r in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(order) == names for order in orders)
    assert [order[0] for order in orders].count("a") == 2
    assert [harness.rotation(["x", "y"], r) for r in range(3)] == [
        ["x", "y"],
        ["y", "x"],
        ["x", "y"],
    ]
    assert harness.rotation([], 3) == []


def test_interleave_runs_each_variant_once_per_round_and_drops_the_warmup() -> None:
    calls: list[tuple[str, int]] = []

    def variant(name: str):  # type: ignore[no-untyped-def]
        def run(index: int) -> float:
            calls.append((name, index))
            return float(index)

        return run

    seen: list[tuple[int, str, float]] = []
    measured = harness.interleave(
        {"sgd": variant("sgd"), "kfac": variant("kfac")},
        3,
        warmup=1,
        on_measure=lambda r, name, value: seen.append((r, name, value)),
    )
    # the warm-up round (index -1) comes first and is not returned
    assert calls[:2] == [("kfac", -1), ("sgd", -1)]
    # then each round holds both variants, the order alternating
    assert calls[2:] == [("sgd", 0), ("kfac", 0), ("kfac", 1), ("sgd", 1), ("sgd", 2), ("kfac", 2)]
    assert measured == {"sgd": [0.0, 1.0, 2.0], "kfac": [0.0, 1.0, 2.0]}
    assert [(r, n) for r, n, _ in seen] == [(r, n) for n, r in calls[2:]]
    with pytest.raises(ValueError):
        harness.interleave({"a": lambda r: 1.0}, 0)


def test_target_status_follows_the_direction() -> None:
    t = harness.Target
    assert t("ratio", 1.0, 1.1, "<=").status == "met"
    assert t("ratio", 1.1, 1.1, "<=").status == "met"
    assert t("ratio", 1.2, 1.1, "<=").status == "missed"
    assert t("rate", 0.95, 0.9, ">=").status == "met"
    assert t("rate", 0.5, 0.9, ">=").status == "missed"
    assert t("rate", math.nan, 0.9, ">=").status == "missed"
    assert t("optional", None, 0.5, "<=").status == "not measured"
    with pytest.raises(ValueError):
        t("ratio", 1.0, 1.0, "<")
    again = t.from_dict(t("ratio", 1.2, 1.1, "<=", "×", "note").as_dict())
    assert again == t("ratio", 1.2, 1.1, "<=", "×", "note")


def test_values_are_printed_with_their_unit() -> None:
    assert harness.format_value(1.159, "×") == "1.16×"
    assert harness.format_value(0.27, "×") == "0.270×"
    assert harness.format_value(0.64, "%") == "64 %"
    assert harness.format_value(2.783, "s") == "2.78 s"
    assert harness.format_value(None, "s") == "—"


@pytest.mark.parametrize(
    ("value", "check", "code"),
    [(1.0, False, 0), (1.0, True, 0), (2.0, False, 0), (2.0, True, 1), (None, True, 0)],
)
def test_finish_writes_the_results_json_and_check_exits_1_on_a_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: float | None, check: bool, code: int
) -> None:
    args = harness.parser(__doc__, rounds=3).parse_args(["--check"] if check else [])
    assert (args.check, args.rounds) == (check, 3)
    bench = harness.Benchmark("bench_fake", argv=["--rounds", "3"], results_dir=tmp_path)
    bench.target("fake step / SGD step", value, 1.5, "<=", "×")
    bench.target("fake rate", 0.95, 0.9, ">=", "%")
    assert bench.finish({"figure": harness.Stats.of([1.0, 2.0])}, check=args.check) == code
    document = json.loads((tmp_path / "bench_fake.json").read_text())
    assert document["harness"] == harness.HARNESS_SCHEMA
    assert document["command"] == "python benchmarks/bench_fake.py --rounds 3"
    assert set(document["load_average_1min"]) == {"start", "end"}
    assert document["results"]["figure"]["median"] == 1.5
    assert [t["status"] for t in document["targets"]][1] == "met"
    table = capsys.readouterr().out
    assert "fake step / SGD step" in table and "≤ 1.50×" in table


def test_rounds_must_be_positive() -> None:
    parser = harness.parser(None, rounds=3, rounds_aliases=("--repeats",))
    assert parser.parse_args(["--repeats", "2"]).rounds == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "0"])


def _write(directory: Path, name: str, status_value: float, started: float) -> None:
    bench = harness.Benchmark(name, argv=[], results_dir=directory)
    bench.started_at = started
    bench.target("a ratio", status_value, 1.0, "<=", "×")
    bench.finish({})


def test_the_combined_table_reads_every_results_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = time.time()
    _write(tmp_path, "bench_old", 5.0, now - 3600)
    _write(tmp_path, "bench_new", 0.5, now)
    (tmp_path / "bench_x.rounds.json").write_text('{"rounds": []}')  # not a harness file
    capsys.readouterr()
    directory = ["--dir", str(tmp_path)]

    def rows() -> list[str]:
        return [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]]

    assert harness.main(["table", *directory]) == 0
    assert rows() == ["new", "old"]
    assert harness.main(["table", *directory, "--check"]) == 1  # bench_old missed its target
    assert rows() == ["new", "old"]
    assert harness.main(["table", *directory, "--check", "--since", str(now - 60)]) == 0
    assert rows() == ["new"]


def test_a_benchmark_script_exits_1_under_check_when_it_misses(tmp_path: Path) -> None:
    script = tmp_path / "bench_fake.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import harness

        parser = harness.parser(__doc__, rounds=2)
        parser.add_argument("threshold", type=float)
        args = parser.parse_args()
        bench = harness.Benchmark("bench_fake", results_dir=Path({str(tmp_path)!r}))
        measured = harness.interleave({{"a": lambda r: 2.0, "b": lambda r: 1.0}}, args.rounds)
        ratio = harness.Stats.of(harness.ratios(measured["a"], measured["b"])).median
        bench.target("a / b", ratio, args.threshold, "<=", "×")
        sys.exit(bench.finish(measured, check=args.check))
        """)
    )

    def run(*args: str) -> int:
        cmd = [sys.executable, str(script), *args]
        return subprocess.run(cmd, capture_output=True, timeout=60, check=False).returncode

    assert run("--check", "--rounds", "2", "1.5") == 1
    assert run("--rounds", "2", "1.5") == 0
    assert run("--check", "3.0") == 0
    assert json.loads((tmp_path / "bench_fake.json").read_text())["results"]["a"] == [2.0, 2.0]


def test_launch_returns_what_the_worker_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(
        textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import harness

        args = harness.parser(None).parse_args(sys.argv[2:])
        if sys.argv[1] == "fail":
            sys.exit(3)
        result = {{"arg": sys.argv[1], "rank": os.environ.get("RANK")}}
        harness.write_worker_result(args.worker, result)
        """)
    )
    monkeypatch.setenv("RANK", "3")  # an outer job's rank: the worker does not inherit it
    assert harness.launch(worker, "ok", quiet=True) == {"arg": "ok", "rank": None}
    assert harness.launch(worker, "ok", quiet=True, env={"RANK": "7"}) == {"arg": "ok", "rank": "7"}
    with pytest.raises(SystemExit, match="worker exited 3"):
        harness.launch(worker, "fail", quiet=True)


def test_tts_score_ranks_by_median_steps_then_mean_then_time():
    reached = [{"steps": 30, "tts_s": 9.0}, {"steps": 50, "tts_s": 12.0}]
    missed = {"steps": None, "tts_s": None}
    assert harness.tts_score([*reached, {"steps": 40, "tts_s": 20.0}]) == (40, 40, 12.0)
    # one seed missed the target: it counts as infinitely many steps and seconds
    score = harness.tts_score([*reached, missed])
    assert score[0] == 50 and score[1] == math.inf and score[2] == 12.0
    assert min(score, harness.tts_score([missed, missed, reached[0]])) == score
    # equal steps: the time breaks the tie
    fast, slow = [{"steps": 40, "tts_s": 5.0}], [{"steps": 40, "tts_s": 6.0}]
    assert harness.tts_score(fast) < harness.tts_score(slow)


def test_save_json_replaces_the_file_whole(tmp_path):
    path = tmp_path / "results" / "rounds.json"
    harness.save_json(path, {"runs": [1]})
    harness.save_json(path, {"runs": [1, 2]})
    assert json.loads(path.read_text()) == {"runs": [1, 2]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["rounds.json"]
