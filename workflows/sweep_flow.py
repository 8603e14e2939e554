"""The sweep workflow: render → submit → wait → collect → report, as a Parsl DAG.

``run_sweep(prepared, backend)`` is what ``kfac-hpc sweep --wait`` and an in-process backend
(local, parsl-slurm) call. The render step happened before (``prepare_sweep`` raises on bad
input, before anything starts); the wait step is the sweep's one wait loop
(:func:`kfac_hpc.sweep.waiting.wait_for_sweep`: backoff from 2 s to 60 s, reset on a change);
the manifest on disk is updated at every step, so ``kfac-hpc status`` works from another shell
and a killed workflow loses nothing.

The backend comes from the caller: this workflow imports no backend (the backends drive the
workflows, never the reverse).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import parsl
from parsl.app.app import python_app
from parsl.dataflow.errors import DependencyError

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.rundir import RUN
from kfac_hpc.sweep.errors import WorkflowError
from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.prepare import PreparedSweep
from kfac_hpc.sweep.slurm_commands import SlurmError
from kfac_hpc.sweep.waiting import FIRST_POLL_S, wait_for_sweep
from kfac_hpc.workflows.configs import login_config

if TYPE_CHECKING:
    from kfac_hpc.sweep.backends.base import SweepBackend

__all__ = ["collected_runs", "report", "run_sweep"]


def collected_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per point: its parameters, state and the summary of its ``run.json``."""
    rows = []
    for point in read_manifest(sweep_dir).points:
        summary: dict[str, Any] = {}
        run_json = sweep_dir / point.run_dir / RUN
        if run_json.exists():
            summary = json.loads(run_json.read_text())
        rows.append(
            {
                "point_id": point.point_id,
                "state": point.state,
                "params": point.params,
                "run": summary,
            }
        )
    return rows


def report(sweep_dir: Path) -> str:
    """The report's summary and scaling table, and where report.html is (report and tables
    written to ``SWEEP_DIR/report``) when the analysis extras are installed, else the
    collected run list."""
    try:
        from kfac_hpc.analysis.collect import CollectError, collect
        from kfac_hpc.analysis.output import build_tables, write_tables
        from kfac_hpc.analysis.report import terminal_text, write_report
    except ImportError as exc:  # matplotlib is the 'report' extra
        sys.stderr.write(f"kfac-hpc report unavailable ({exc}); showing the collected runs\n")
        return _run_list(collected_runs(sweep_dir))
    try:
        collection = collect(sweep_dir)
        tables = build_tables(collection, None)
        out_dir = sweep_dir / "report"
        write_tables(tables, out_dir / "tables")
        write_report(collection, tables, out_dir, None, None)
    except (CollectError, OSError) as exc:
        sys.stderr.write(f"kfac-hpc report failed ({exc}); showing the collected runs\n")
        return _run_list(collected_runs(sweep_dir))
    return f"{terminal_text(tables)}\n\nReport: {out_dir / 'report.html'}\n"


def _run_list(rows: list[dict[str, Any]]) -> str:
    row_format = "{:12}  {:>5}  {:>5}  {:9}  {:5}  {:9}  {:>8}  {:>8}"
    lines = [
        row_format.format(
            "point", "nodes", "ranks", "optimizer", "kfac", "state", "wall_s", "accuracy"
        )
    ]
    for row in rows:
        params, run = row["params"], row["run"]
        ranks = int(params["nodes"]) * int(params["ranks_per_node"])
        wall = f"{run['wall_s']:.1f}" if isinstance(run.get("wall_s"), (int, float)) else "-"
        acc = (
            f"{run['final_accuracy']:.3f}"
            if isinstance(run.get("final_accuracy"), (int, float))
            else "-"
        )
        optimizer, kfac = params.get("optimizer", "-"), str(params.get("kfac", "-"))
        fields = (row["point_id"], params["nodes"], ranks, optimizer, kfac, row["state"], wall, acc)
        lines.append(row_format.format(*fields))
    return "\n".join(lines) + "\n"


@python_app
def _submit_app(prepared: PreparedSweep, backend: SweepBackend) -> str:
    return str(len(backend.submit(prepared).arrays))


@python_app
def _wait_app(sweep_dir: Path, first_poll_s: float, inputs: Sequence[Any] = ()) -> str:
    return str(len(wait_for_sweep(sweep_dir, first_s=first_poll_s).points))


@python_app
def _report_app(sweep_dir: Path, inputs: Sequence[Any] = ()) -> str:
    return report(sweep_dir)


def run_sweep(
    prepared: PreparedSweep, backend: SweepBackend, first_poll_s: float = FIRST_POLL_S
) -> str:
    """Run the whole DAG with ``backend`` (the one ``prepared`` was prepared for) and return
    the report text. A backend that runs its points in this process returns when they ended;
    the others are followed from the login node."""
    sweep_dir = prepared.sweep_dir
    if backend.runs_in_process:
        done: Future[Any] = Future()
        try:
            backend.submit(prepared)
            done.set_result(report(sweep_dir))
        except Exception as exc:  # reported as the step's own error, as below
            done.set_exception(exc)
        return str(_step_result({"run": done}))
    with parsl.load(login_config(sweep_dir / "parsl")):
        submitted = _submit_app(prepared, backend)
        finished = _wait_app(sweep_dir, first_poll_s, inputs=[submitted])
        reported = _report_app(sweep_dir, inputs=[finished])
        return str(_step_result({"submit": submitted, "wait": finished, "report": reported}))


def _step_result(steps: dict[str, Future[Any]]) -> Any:
    """The last step's result. A failed step's own error is raised (bad input and Slurm errors
    as they are, anything else as :class:`WorkflowError`), never Parsl's DependencyError of the
    steps after it."""
    *_, last = steps.values()
    try:
        return last.result()
    except Exception:
        for name, future in steps.items():
            exc = future.exception()
            if exc is None or isinstance(exc, DependencyError):
                continue
            if isinstance(exc, InputError | SlurmError | WorkflowError):
                raise exc from None
            text = " ".join(str(exc).split())[:300]
            raise WorkflowError(f"step {name!r} failed: {type(exc).__name__}: {text}") from None
        raise
