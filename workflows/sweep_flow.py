"""The sweep workflow: render → submit → wait → collect → report, as a Parsl DAG.

``run_sweep(prepared)`` is what ``kfac-hpc sweep --wait`` and ``--backend local`` call. The
render step happened before (``prepare_sweep`` raises on bad input, before anything starts);
the manifest on disk is updated at every step, so ``kfac-hpc status`` works from another shell
and a killed workflow loses nothing.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import parsl
from kfac_hpc.workflows.configs import local_config, slurm_config
from parsl.app.app import bash_app, python_app

from kfac_hpc.sweep.command import train_argv
from kfac_hpc.sweep.follow import prepare_for_retry, resumable, status
from kfac_hpc.sweep.manifest import Manifest, PointRecord, locked_manifest, read_manifest
from kfac_hpc.sweep.submit import PreparedSweep, new_manifest, submit_sweep

__all__ = ["collected_runs", "report", "run_local_points", "run_sweep", "wait_for_sweep"]

_LIVE = ("pending", "submitted", "running", "requeued")
PREEMPTED_EXIT_CODE = 75


@bash_app
def _train_point(
    command: str,
    parsl_resource_specification: dict[str, int] | None = None,
    stdout: str | None = None,
    stderr: str | None = None,
) -> str:
    """One point under the executor's MPI launcher (``$PARSL_MPI_PREFIX`` = mpiexec -n R)."""
    return f"$PARSL_MPI_PREFIX {command}"


def _point_command(manifest: Manifest, sweep_dir: Path, point: PointRecord) -> str:
    env = {
        "OMP_NUM_THREADS": str(point.params["cpus_per_task"]),
        "PYTHONUNBUFFERED": "1",
        **manifest.profile["env"],
    }
    argv = [
        *manifest.profile["train_command"],
        "--run-dir",
        str(sweep_dir / point.run_dir),
        *train_argv(point.params),
    ]
    # The prefix is `mpiexec ... `, so the environment goes through `env` (hydra passes it on).
    return shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv])


def run_local_points(sweep_dir: Path, point_ids: Sequence[str] | None = None) -> None:
    """Run points (all, or ``point_ids``) with local MPI ranks, ``max_concurrent`` at a time."""
    manifest = read_manifest(sweep_dir)
    todo = [p for p in manifest.points if point_ids is None or p.point_id in point_ids]
    concurrency = 1 if manifest.spec["serial"] else int(manifest.spec["max_concurrent"] or 1)
    (sweep_dir / "logs").mkdir(exist_ok=True)
    with parsl.load(local_config(sweep_dir / "parsl", concurrency)):
        futures: dict[concurrent.futures.Future[Any], str] = {}
        for point in todo:
            ranks = int(point.params["nodes"]) * int(point.params["ranks_per_node"])
            log = str(
                sweep_dir / "logs" / f"{manifest.name}-{point.array}_local_{point.array_index}.out"
            )
            future = _train_point(
                _point_command(manifest, sweep_dir, point),
                parsl_resource_specification={
                    "num_nodes": 1,
                    "num_ranks": ranks,
                    "ranks_per_node": ranks,
                },
                stdout=(log, "a"),
                stderr=(log, "a"),
            )
            futures[future] = point.point_id
        _mark(sweep_dir, [p.point_id for p in todo], "running", attempt=True)
        for future in concurrent.futures.as_completed(futures):
            _finish_local(sweep_dir, futures[future], future)


def _mark(sweep_dir: Path, point_ids: Sequence[str], state: str, attempt: bool = False) -> None:
    with locked_manifest(sweep_dir) as manifest:
        for point in manifest.points:
            if point.point_id in point_ids:
                point.state, point.detail, point.job_id = state, "", "local"
                point.attempts += int(attempt)


def _finish_local(sweep_dir: Path, point_id: str, future: concurrent.futures.Future[Any]) -> None:
    """The point's state from its markers, else from the exit code of its launcher."""
    exc = future.exception()
    code = getattr(exc, "exitcode", 0 if exc is None else 1)
    with locked_manifest(sweep_dir) as manifest:
        point = next(p for p in manifest.points if p.point_id == point_id)
        run_dir = sweep_dir / point.run_dir
        if (run_dir / "done").exists():
            point.state, point.detail = "done", ""
        elif code == PREEMPTED_EXIT_CODE or (run_dir / "preempted").exists():
            point.state, point.detail = "preempted", "checkpointed; kfac-hpc resume continues it"
        else:
            point.state, point.detail = "failed", f"exit code {code}; see logs/"


def resume_local(sweep_dir: Path) -> list[str]:
    """Rerun the failed, cancelled and preempted points of a local sweep."""
    with locked_manifest(sweep_dir) as manifest:
        todo = resumable(manifest)
        for point in todo:
            prepare_for_retry(sweep_dir, point)
    ids = [p.point_id for p in todo]
    if ids:
        run_local_points(sweep_dir, ids)
    return ids


def wait_for_sweep(
    sweep_dir: Path, poll_s: float = 2.0, timeout_s: float | None = None
) -> Manifest:
    """Poll ``status`` until no point is pending, submitted, running or requeued, on two polls
    in a row: one scheduler snapshot can miss a task that is changing state (a requeue)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    settled = False
    while True:
        manifest, _ = status(sweep_dir)
        if not any(p.state in _LIVE for p in manifest.points):
            if settled:
                return manifest
            settled = True
        else:
            settled = False
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"sweep {sweep_dir} still running after {timeout_s} s")
        time.sleep(poll_s)


def collected_runs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per point: its parameters, state and the summary of its ``run.json``."""
    rows = []
    for point in read_manifest(sweep_dir).points:
        summary: dict[str, Any] = {}
        run_json = sweep_dir / point.run_dir / "run.json"
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
    """The collector's report when ``kfac_hpc.analysis`` is installed, else the run list."""
    if importlib.util.find_spec("kfac_hpc.analysis.report") is not None:
        out = subprocess.run(
            [sys.executable, "-m", "kfac_hpc", "report", str(sweep_dir)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode in (0, 1):  # 1: the report is written, some point is not done
            return out.stdout
        sys.stderr.write(
            f"kfac-hpc report failed ({out.stderr.strip()}); showing the collected runs\n"
        )
    return _run_list(collected_runs(sweep_dir))


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
def _submit_app(prepared: PreparedSweep) -> str:
    return str(len(submit_sweep(prepared).arrays))


@python_app
def _wait_app(sweep_dir: Path, poll_s: float, inputs: Sequence[Any] = ()) -> str:
    return str(len(wait_for_sweep(sweep_dir, poll_s).points))


@python_app
def _report_app(sweep_dir: Path, inputs: Sequence[Any] = ()) -> str:
    return report(sweep_dir)


def run_sweep(prepared: PreparedSweep, poll_s: float = 2.0) -> str:
    """Run the whole DAG for either backend and return the report text."""
    sweep_dir = prepared.sweep_dir
    if prepared.backend == "local":
        new_manifest(prepared).write(sweep_dir)
        run_local_points(sweep_dir)
        return report(sweep_dir)
    with parsl.load(slurm_config(sweep_dir / "parsl")):
        submitted = _submit_app(prepared)
        finished = _wait_app(sweep_dir, poll_s, inputs=[submitted])
        return str(_report_app(sweep_dir, inputs=[finished]).result())
