"""The plan's predictions beside a sweep's measurements, per run and phase.

``kfac-hpc plan --explain SWEEP_DIR`` writes ``SWEEP_DIR/predicted.json`` (the name is
``contracts.rundir.PREDICTED``): for each run directory, keyed by its path relative to the
sweep, the predicted seconds per step of every phase, of the time outside every phase
(``other``) and of the whole step. This module reads it (files only: the cost model lives in
``kfac_hpc.plan``) and pairs each prediction with what the run measured (``run.json``: per-step
means averaged over ranks; the step is the ranks' mean step, ``contracts.records.phase_step_s``,
and ``other`` = that step − the sum of the phases).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.collect import Collection
from kfac_hpc.contracts.records import phase_step_s
from kfac_hpc.contracts.rundir import PREDICTED

__all__ = ["COLUMNS", "Predicted", "load_predicted", "predicted_rows"]

Row = dict[str, Any]
COLUMNS = ("run_id", "method", "world_size", "phase", "predicted_s", "measured_s", "ratio")


class Predicted:
    """``source``: where the plan's numbers came from; ``runs``: run path → predictions."""

    def __init__(self, source: str, runs: dict[str, dict[str, Any]]) -> None:
        self.source, self.runs = source, runs


def load_predicted(sweep_dir: Path) -> Predicted | None:
    """``SWEEP_DIR/predicted.json``, or None when there is none; ValueError when unreadable."""
    path = sweep_dir / PREDICTED
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return Predicted(str(data["source"]), dict(data["runs"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a predictions file of kfac-hpc plan: {exc}") from None


def _measured(summary: dict[str, Any]) -> dict[str, float] | None:
    phases, step_s = summary.get("phases_s"), phase_step_s(summary)
    if not isinstance(phases, dict) or step_s is None:
        return None
    out = {p: float(phases.get(p) or 0.0) for p in schema.PHASES}
    out["other"] = step_s - sum(out.values())
    out["step"] = step_s
    return out


def predicted_rows(collection: Collection, predicted: Predicted) -> list[Row]:
    """One row per (finished run with a prediction, phase predicted or measured > 0), the
    ``other`` and ``step`` rows included: predicted and measured seconds per step, and their
    ratio (predicted / measured; None when nothing was measured)."""
    rows: list[Row] = []
    root = collection.source.resolve()
    for run in collection.runs:
        try:
            key = run.path.resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        pred, measured = predicted.runs.get(key), _measured(run.summary)
        if pred is None or measured is None:
            continue
        values = {**pred.get("phases_s", {}), "other": pred["other_s"], "step": pred["step_s"]}
        for phase in (*schema.PHASES, "other", "step"):
            p, m = float(values.get(phase) or 0.0), measured[phase]
            if phase != "step" and abs(p) < 1e-9 and abs(m) < 1e-9:
                continue
            rows.append(
                {
                    "run_id": run.run_id,
                    "method": pred.get("method"),
                    "world_size": run.value("world_size"),
                    "phase": phase,
                    "predicted_s": p,
                    "measured_s": m,
                    "ratio": p / m if m > 0 else None,
                }
            )
    return rows
