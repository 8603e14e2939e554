"""The harness every benchmark in this folder runs on.

A benchmark compares variants (SGD against SGD+K-FAC, HDF5 against a raw write, arrays against
the pilot, ...) in *rounds*: each round runs every variant once, the order rotating from round
to round (``interleave``), so that machine noise hits all of them alike. Per variant it reports
the median, min and max over rounds (``Stats``); ratios are taken per round, then summarised.

Every invocation records the 1-minute load average at its start and end, declares its targets
(name, measured value, threshold, direction: ``Benchmark.target``) and writes one results JSON,
``benchmarks/results/<script>.json`` (``Benchmark.finish``), with the date, the command, the
load, the targets and the benchmark's own figures. It prints the table of targets; with
``--check`` it exits 1 when any target is missed. Benchmarks that start themselves again as MPI
ranks or as fresh processes do it through ``launch`` (the worker writes its JSON to the path
``--worker`` names, ``write_worker_result``).

    python benchmarks/harness.py table [--since EPOCH] [--check]

prints the targets of every results JSON in one table (``make bench`` ends with it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS_DIR = HERE / "results"
HARNESS_SCHEMA = 1  # the "harness" key of a results JSON: files without it are not ours
# the launch variables of an outer job: a relaunched worker discovers its own
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

Direction = Literal["<=", ">="]
MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"
T = TypeVar("T")


# --- statistics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Median, min and max of a variant's values over rounds."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        values = [float(v) for v in values]
        if not values:
            raise ValueError("no values to summarise")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def scaled(self, factor: float) -> Stats:
        """The same figures times ``factor`` (seconds to milliseconds, bytes to MiB)."""
        return Stats(self.median * factor, self.min * factor, self.max * factor, self.n)

    def __format__(self, spec: str) -> str:
        """``f"{s:.2f}"`` reads ``1.16 (0.99–1.22)``: median (min–max)."""
        spec = spec or ".3g"
        return f"{self.median:{spec}} ({self.min:{spec}}–{self.max:{spec}})"


def stats(values: Iterable[float]) -> dict[str, float]:
    """``Stats.of(values)`` as a JSON-ready dict: median, min, max, n."""
    return Stats.of(values).as_dict()


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round by round ``a / b``: a ratio of two variants measured in the same round."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} values against {len(denominators)}")
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def save_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON, whole or not at all (a partial file
    renamed over it), so an interrupted benchmark leaves its earlier results readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)


def tts_score(runs: Sequence[Mapping[str, Any]]) -> tuple[float, float, float]:
    """A tuning grid point's median and mean steps and median time to target over its seeds
    (each run a mapping with ``steps`` and ``tts_s``; one that missed the target, ``tts_s``
    None, counts as infinitely many of each): lower is better. Steps are the same on a busy
    machine; time only breaks the ties steps leave."""
    steps = [math.inf if r.get("tts_s") is None else float(r["steps"]) for r in runs]
    times = [math.inf if r.get("tts_s") is None else float(r["tts_s"]) for r in runs]
    return statistics.median(steps), statistics.fmean(steps), statistics.median(times)


# --- interleaved rounds -----------------------------------------------------------------------


def rotation(variants: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index``: it starts at variant ``round_index mod n``, so every
    variant runs first (and last) equally often, and two variants alternate."""
    if not variants:
        return []
    start = round_index % len(variants)
    return [*variants[start:], *variants[:start]]


def interleave(
    variants: Mapping[str, Callable[[int], T]],
    rounds: int,
    *,
    warmup: int = 0,
    on_measure: Callable[[int, str, T], None] | None = None,
) -> dict[str, list[T]]:
    """Run every variant once per round, in ``rotation`` order; ``warmup`` rounds first,
    discarded. Each variant is called with its round index (warm-up rounds are negative) and
    returns its measurement; ``on_measure(round, name, value)`` sees each timed one. Returns
    the measurements per variant, in round order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(variants)
    for index in range(-warmup, 0):
        for name in rotation(names, index):
            variants[name](index)
    measured: dict[str, list[T]] = {name: [] for name in names}
    for index in range(rounds):
        for name in rotation(names, index):
            value = variants[name](index)
            measured[name].append(value)
            if on_measure is not None:
                on_measure(index, name, value)
    return measured


def load_average() -> float:
    """The 1-minute load average."""
    return round(os.getloadavg()[0], 2)


# --- targets ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A figure a benchmark must reach: ``value`` ``direction`` ``threshold`` (``None``: not
    measured in this invocation, e.g. an optional comparison whose package is missing)."""

    name: str
    value: float | None
    threshold: float
    direction: Direction
    unit: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.direction not in ("<=", ">="):
            raise ValueError(f"direction must be '<=' or '>=', got {self.direction!r}")

    @property
    def status(self) -> str:
        if self.value is None:
            return NOT_MEASURED
        if math.isnan(self.value):
            return MISSED
        ok = (
            self.value <= self.threshold if self.direction == "<=" else self.value >= self.threshold
        )
        return MET if ok else MISSED

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Target:
        return cls(
            data["name"],
            data["value"],
            data["threshold"],
            data["direction"],
            data.get("unit", ""),
            data.get("note", ""),
        )


def format_value(value: float | None, unit: str = "") -> str:
    """A figure and its unit: ``1.16×``, ``0.270×`` (a ratio, 3 digits), ``64 %`` (a fraction),
    ``2.78 s`` (3 significant digits)."""
    if value is None:
        return "—"
    if unit == "%":
        return f"{100 * value:.3g} %"
    if unit in ("×", "x"):
        return f"{value:.2f}×" if abs(value) >= 1 else f"{value:.3f}×"
    text = f"{value:.3g}"
    return f"{text} {unit}" if unit else text


def target_table(rows: Sequence[tuple[str, Target, str]]) -> str:
    """(benchmark, target, date) rows as an aligned table."""
    header = ("benchmark", "target", "measured", "threshold", "status", "date")
    body = [
        (
            bench.removeprefix("bench_"),
            t.name,
            format_value(t.value, t.unit),
            f"{'≤' if t.direction == '<=' else '≥'} {format_value(t.threshold, t.unit)}",
            t.status,
            date,
        )
        for bench, t, date in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *body]
    ]
    return "\n".join(lines)


def tally(targets: Iterable[Target]) -> str:
    """``3 targets: 2 met, 1 missed`` (and how many were not measured)."""
    statuses = [t.status for t in targets]
    counts = [f"{statuses.count(s)} {s}" for s in (MET, MISSED, NOT_MEASURED) if s in statuses]
    noun = "target" if len(statuses) == 1 else "targets"
    return f"{len(statuses)} {noun}" + (": " + ", ".join(counts) if counts else "")


def exit_code(targets: Iterable[Target], check: bool) -> int:
    """1 when ``check`` and a target is missed, else 0 (a target not measured is no miss)."""
    return int(check and any(t.status == MISSED for t in targets))


# --- one invocation ---------------------------------------------------------------------------


@dataclass
class Benchmark:
    """One invocation of a benchmark: its load average at start and end, its targets, its
    results JSON. ``name`` is the script's name without ``.py``."""

    name: str
    argv: Sequence[str] = field(default_factory=lambda: sys.argv[1:])
    results_dir: Path = RESULTS_DIR
    targets: list[Target] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.date = datetime.date.today().isoformat()
        self.started_at = time.time()
        self.started = time.perf_counter()
        self.load_start = load_average()
        self.command = " ".join(["python", f"benchmarks/{self.name}.py", *self.argv])

    @property
    def path(self) -> Path:
        return self.results_dir / f"{self.name}.json"

    def target(
        self,
        name: str,
        value: float | None,
        threshold: float,
        direction: Direction,
        unit: str = "",
        note: str = "",
    ) -> Target:
        """Declare a target of this invocation; returns it (``.status``: met, missed...)."""
        declared = Target(
            name, None if value is None else float(value), threshold, direction, unit, note
        )
        self.targets.append(declared)
        return declared

    def finish(self, results: Mapping[str, Any], *, check: bool = False) -> int:
        """Write the results JSON, print the table of targets; the exit code ``--check``
        asks for (1: a target missed)."""
        load_end = load_average()
        document = {
            "harness": HARNESS_SCHEMA,
            "benchmark": self.name,
            "command": self.command,
            "date": self.date,
            "started": datetime.datetime.fromtimestamp(self.started_at).isoformat(
                timespec="seconds"
            ),
            "wall_s": round(time.perf_counter() - self.started, 3),
            "load_average_1min": {"start": self.load_start, "end": load_end},
            "targets": [t.as_dict() for t in self.targets],
            "results": results,
        }
        self.results_dir.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.partial")
        partial.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")
        partial.replace(self.path)
        print(
            f"\nload average (1 min): {self.load_start:.2f} at the start, {load_end:.2f} at the end"
        )
        if self.targets:
            print(target_table([(self.name, t, self.date) for t in self.targets]))
        print(f"{tally(self.targets)}; wrote {self.path}")
        return exit_code(self.targets, check)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Stats):
        return value.as_dict()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def parser(
    doc: str | None, *, rounds: int | None = None, rounds_aliases: Sequence[str] = ()
) -> argparse.ArgumentParser:
    """The benchmark's argument parser with the harness's options: ``--check`` (exit 1 when a
    target is missed), ``--rounds N`` when ``rounds`` is its default, and the hidden
    ``--worker PATH`` of a relaunched worker."""
    description = " ".join((doc or "").strip().split("\n\n")[0].split()) or None
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    if rounds is not None:
        p.add_argument(
            "--rounds",
            *rounds_aliases,
            type=positive_int,
            default=rounds,
            help=f"interleaved rounds (default {rounds})",
        )
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return p


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# --- relaunched workers -----------------------------------------------------------------------


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment for a worker: unbuffered, the venv's tools first on PATH, no outer
    job's rank variables, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class JobRun:
    """One ``kfac-hpc train`` a benchmark ran: its run.json (``summary``), or the last line of
    its stderr (``error``, the summary then empty) when it failed."""

    run_dir: Path
    summary: dict[str, Any]
    error: str | None = None


def run_job(args: Sequence[str], ranks: int, work: Path, timeout: float = 1200) -> JobRun:
    """The real job, ``kfac-hpc train ARGS``, in a fresh run directory under ``work``: behind
    ``mpiexec -n ranks`` for ranks > 1, one thread a rank. Raises RuntimeError when run.json's
    world size is not ``ranks``."""
    run_dir = Path(tempfile.mkdtemp(dir=work)) / "run"
    cmd = [sys.executable, "-m", "kfac_hpc", "train", "--run-dir", str(run_dir), *args]
    if ranks > 1:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *cmd]
    env = worker_env({"OMP_NUM_THREADS": "1"})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
        return JobRun(run_dir, {}, lines[-1][:300])
    summary = json.loads((run_dir / "run.json").read_text())
    if summary["world_size"] != ranks:
        raise RuntimeError(f"{' '.join(args)}: asked for {ranks} ranks, ran on "
                           f"{summary['world_size']}")  # fmt: skip
    return JobRun(run_dir, summary)


def launch(
    script: str | Path,
    *args: str,
    ranks: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    quiet: bool = False,
) -> Any:
    """Run ``script`` again as a worker (``--worker PATH`` appended; under the venv's
    ``mpiexec -n ranks`` when ``ranks`` is given) and return the JSON it wrote there. Its
    output streams through unless ``quiet``; a failure ends the benchmark with its tail."""
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(script), *args, "--worker", str(out)]
        if ranks is not None:
            cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *cmd]
        pipe = subprocess.PIPE if quiet else None
        proc = subprocess.run(
            cmd,
            env=worker_env(env),
            timeout=timeout,
            cwd=REPO,
            stdout=pipe,
            stderr=pipe,
            text=True,
            check=False,
        )
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or "")[-2000:]
            raise SystemExit(
                f"{Path(script).name}: worker exited {proc.returncode} "
                f"({' '.join(cmd)}){': ' + tail if tail else ''}"
            )
        return json.loads(out.read_text())


def write_worker_result(path: Path, result: Any) -> None:
    """A worker's result for ``launch``: JSON at ``path``, written whole or not at all."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(result, default=_jsonable))
    partial.replace(path)


# --- the table of every benchmark ---------------------------------------------------------------


def read_results(directory: Path = RESULTS_DIR, since: float | None = None) -> list[dict[str, Any]]:
    """Every harness results JSON in ``directory`` (started at or after ``since``, epoch
    seconds), by benchmark name. Other JSON files there (accumulated rounds) are skipped."""
    found = []
    for path in sorted(directory.glob("*.json")):
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(document, dict) or document.get("harness") != HARNESS_SCHEMA:
            continue
        started = datetime.datetime.fromisoformat(document["started"]).timestamp()
        if since is None or started >= since:
            found.append(document)
    return found


def combined_rows(documents: Iterable[Mapping[str, Any]]) -> list[tuple[str, Target, str]]:
    return [
        (d["benchmark"], Target.from_dict(t), d["date"]) for d in documents for t in d["targets"]
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The targets of every benchmark's results JSON.")
    sub = p.add_subparsers(dest="command", required=True)
    table = sub.add_parser("table", help="print one table of every target")
    table.add_argument("--since", type=float, help="only results started after (epoch s)")
    table.add_argument("--dir", type=Path, default=RESULTS_DIR, help="results folder")
    table.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    documents = read_results(args.dir, args.since)
    rows = combined_rows(documents)
    if not rows:
        print(f"no benchmark results in {args.dir}")
        return 0
    print(target_table(rows))
    noun = "benchmark" if len(documents) == 1 else "benchmarks"
    print(f"{len(documents)} {noun}, {tally(t for _, t, _ in rows)}")
    return exit_code([t for _, t, _ in rows], args.check)


if __name__ == "__main__":
    sys.exit(main())
