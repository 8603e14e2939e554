"""``kfac-hpc collect`` and ``kfac-hpc report``: parse, call the library, print.

Exit codes: 0 every point finished (``done``), 1 some point failed or is incomplete (the tables
and the report are still written), 2 bad input (nothing written): ``kfac-hpc collect: error:
FIELD: reason`` by the one exit path of every command (cli_errors.py).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kfac_hpc.analysis.collect import CollectError, Collection, collect
from kfac_hpc.analysis.incremental import collect_tables
from kfac_hpc.analysis.output import (
    FORMATS,
    RUN_TABLE_VIEW,
    build_tables,
    render,
    write_tables,
)
from kfac_hpc.analysis.parquet import ParquetWriter
from kfac_hpc.analysis.schema import DONE
from kfac_hpc.analysis.tables import RUN_COLUMNS
from kfac_hpc.cli_errors import guard
from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.exit_codes import ExitCode
from kfac_hpc.contracts.targets import Target

_source = click.argument(
    "source", type=click.Path(path_type=Path, file_okay=False), metavar="SWEEP_DIR"
)
_format = click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="table",
    show_default=True,
    help="Terminal output: an aligned table, CSV or JSON.",
)


class _Fraction(click.FloatRange):
    """A number in [0, 1]; NaN (which every comparison lets through) is rejected."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if number != number:
            self.fail(f"{value!r} is not a number in [0, 1]", param, ctx)
        return number


def _target(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--target-accuracy`` and ``--target-loss``: one bar for every run's time to target."""
    loss = click.option(
        "--target-loss",
        type=_Positive(),
        default=None,
        help="Test loss for time-to-target (lower is better: a language model's validation "
        "loss), overriding each run's own target.",
    )
    accuracy = click.option(
        "--target-accuracy",
        type=_Fraction(0.0, 1.0),
        default=None,
        help="Accuracy for time-to-target, overriding each run's own target (compare at one bar).",
    )
    return accuracy(loss(command))


class _Positive(click.FloatRange):
    """A finite number above 0 (NaN and infinity refused)."""

    def __init__(self) -> None:
        super().__init__(min=0.0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number above 0", param, ctx)
        return number


def _target_or_exit(accuracy: float | None, loss: float | None) -> Target | None:
    """The override asked for, if any; both given is bad input naming ``--target-loss``."""
    if accuracy is not None and loss is not None:
        raise InputError("--target-loss", "give one target: --target-accuracy or --target-loss")
    if accuracy is not None:
        return Target("accuracy", accuracy)
    return None if loss is None else Target("loss", loss)


def _collect_or_exit(source: Path, name: str = "SWEEP_DIR") -> Collection:
    """The collection of ``source``; InputError naming the argument ``name`` if bad."""
    return _or_exit(lambda: collect(source), name)


T = TypeVar("T")


def _or_exit(gather: Callable[[], T], name: str) -> T:
    """``gather()``; its CollectError as bad input (InputError) naming the argument ``name``."""
    try:
        return gather()
    except CollectError as exc:
        raise InputError(name, str(exc)) from None


def _write_or_exit(out_dir: Path, write: Callable[[], object]) -> None:
    try:
        write()
    except OSError as exc:  # a read-only sweep directory, a full disk
        raise InputError("--out", f"cannot write to {out_dir}: {exc}; pass --out DIR") from None


def _exit_code(states: list[str]) -> int:
    return int(ExitCode.DONE if all(s == DONE for s in states) else ExitCode.FAILED)


def _summary_line(states: list[str]) -> str:
    counts: dict[str, int] = {}
    for state in states:
        counts[state] = counts.get(state, 0) + 1
    text = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return f"{len(states)} run(s): {text}"


@click.command("collect")
@_source
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where the tables go  [default: SWEEP_DIR/analysis].",
)
@_format
@_target
@guard("collect")
def collect_command(
    source: Path,
    out: Path | None,
    fmt: str,
    target_accuracy: float | None,
    target_loss: float | None,
) -> None:
    """Gather every run of SWEEP_DIR (or any folder of run directories) into tidy tables.

    Writes runs, phases, segments and scaling tables as CSV and JSON Lines (and Parquet when
    pyarrow is installed) and prints the runs. Exit code 0: every point is done; 1: some
    failed or are incomplete; 2: bad input.
    """
    target = _target_or_exit(target_accuracy, target_loss)
    out_dir = out or source / "analysis"
    with ParquetWriter() as parquet:  # imports pyarrow in a child while the runs are collected
        collected = _or_exit(lambda: collect_tables(source, target), "SWEEP_DIR")
        tables = collected.tables
        _write_or_exit(out_dir, lambda: write_tables(tables, out_dir, parquet))
    click.echo(render(tables.runs, RUN_COLUMNS, fmt, RUN_TABLE_VIEW))
    click.echo(f"{_summary_line(collected.states)}; tables in {out_dir}", err=True)
    sys.exit(_exit_code(collected.states))


def _predicted_or_exit(collection: Collection) -> tuple[str, list[dict[str, Any]]] | None:
    """The plan's predictions of SWEEP_DIR (``kfac-hpc plan --explain``) beside the runs."""
    from kfac_hpc.analysis.predicted import load_predicted, predicted_rows

    try:
        loaded = load_predicted(collection.source)
    except ValueError as exc:
        raise InputError("SWEEP_DIR", f"{exc}; rerun kfac-hpc plan --explain") from None
    return None if loaded is None else (loaded.source, predicted_rows(collection, loaded))


@click.command("report")
@_source
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where report.md, report.html and the plots go  [default: SWEEP_DIR/report].",
)
@click.option(
    "--baseline",
    type=click.Path(path_type=Path, file_okay=False, exists=True),
    default=None,
    help="Another sweep to compare against (a table with regressions flagged).",
)
@click.option(
    "--regression-threshold",
    type=_Fraction(0.0, 1.0),
    default=0.05,
    show_default=True,
    help="Relative change (fraction) beyond which a worse figure counts as a regression.",
)
@_format
@_target
@guard("report")
def report_command(
    source: Path,
    out: Path | None,
    baseline: Path | None,
    regression_threshold: float,
    fmt: str,
    target_accuracy: float | None,
    target_loss: float | None,
) -> None:
    """Write report.md, a self-contained report.html and PNG plots for SWEEP_DIR.

    Prints the scaling table (one row per configuration and node count), the baseline
    comparison and, when SWEEP_DIR/predicted.json exists (kfac-hpc plan --explain), the plan's
    predictions beside the measurements; with --format json one object {"scaling": [...],
    "comparison": [...] or null, "predicted": [...] when there are predictions}.
    Exit code 0: every point is done; 1: some failed or are incomplete (the report is still
    written); 2: bad input.
    """
    from kfac_hpc.analysis.compare import COMPARE_COLUMNS, compare
    from kfac_hpc.analysis.metrics import SCALING_COLUMNS

    try:
        from kfac_hpc.analysis.report import (
            COMPARE_TABLE,
            PREDICTED_TABLE,
            SCALING_VIEW,
            terminal_text,
            write_report,
        )
    except ImportError as exc:  # matplotlib is the 'report' extra
        missing = exc.name or "matplotlib"
        raise InputError(missing, f"{exc}; install it: pip install 'kfac-hpc[report]'") from None

    target = _target_or_exit(target_accuracy, target_loss)
    # The baseline first: a bad one is bad input before anything (a cache) is written.
    base = None if baseline is None else _collect_or_exit(baseline, "--baseline")
    collection = _collect_or_exit(source)
    tables = build_tables(collection, target)
    comparison = None
    if base is not None:
        base_tables = build_tables(base, target)
        comparison = compare(tables.scaling, base_tables.scaling, regression_threshold)
    predicted = _predicted_or_exit(collection)
    out_dir = out or source / "report"
    _write_or_exit(out_dir, lambda: write_tables(tables, out_dir / "tables"))
    _write_or_exit(
        out_dir,
        lambda: write_report(collection, tables, out_dir, comparison, baseline, predicted),
    )
    if fmt == "json":  # one document: the scaling table, and the comparison (or null)
        document = {"scaling": tables.scaling, "comparison": comparison}
        if predicted is not None:
            document["predicted"] = predicted[1]
        click.echo(json.dumps(document, indent=1))
    else:
        if fmt == "table":  # the summary and the scaling table in words
            click.echo(terminal_text(tables))
        else:
            click.echo(render(tables.scaling, SCALING_COLUMNS, fmt, SCALING_VIEW))
        if comparison is not None:
            click.echo("")
            click.echo(render(comparison, COMPARE_COLUMNS, fmt, COMPARE_TABLE))
        if predicted is not None:
            from kfac_hpc.analysis import predicted as plan_rows

            click.echo(f"\npredicted ({predicted[0]}) vs measured, per step:")
            click.echo(render(predicted[1], plan_rows.COLUMNS, fmt, PREDICTED_TABLE))
        if fmt == "table":
            click.echo(f"\nReport: {out_dir / 'report.html'}")
    states = [run.state for run in collection.runs]
    click.echo(f"{_summary_line(states)}; report in {out_dir / 'report.md'}", err=True)
    sys.exit(_exit_code(states))
