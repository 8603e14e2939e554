"""The cost model next to a finished run: predicted seconds per phase for a run directory's
resolved configuration, beside what the run measured (for ``kfac-hpc report`` to show)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kfac_hpc.plan.model import PlanConfig
from kfac_hpc.plan.planner import Planned

__all__ = ["config_of_run", "predicted_vs_measured"]

_STRATEGIES = {
    "comm-opt": "kfac-comm-opt",
    "hybrid-opt": "kfac-hybrid-opt",
    "mem-opt": "kfac-mem-opt",
}


def config_of_run(config: dict[str, Any]) -> PlanConfig:
    """The plan configuration of a run's ``config.json`` (resolved, with ``world_size``).

    A numeric ``grad_worker_fraction`` maps to the named strategy it equals (1 → comm-opt,
    0.5 → hybrid-opt, 1/P → mem-opt); other fractions raise ``ValueError``.
    """
    ranks = int(config["world_size"])
    method = "sgd"
    if config.get("kfac"):
        fraction = config.get("grad_worker_fraction", "comm-opt")
        if isinstance(fraction, str):
            method = _STRATEGIES[fraction.strip().lower().replace("_", "-")]
        elif float(fraction) == 1.0:
            method = "kfac-comm-opt"
        elif float(fraction) * ranks == 1.0:
            method = "kfac-mem-opt"
        elif float(fraction) == 0.5:
            method = "kfac-hybrid-opt"
        else:
            raise ValueError(f"grad_worker_fraction {fraction} is not a strategy the plan models")
    return PlanConfig(
        method,
        ranks,
        int(config["batch_size"]),
        str(config.get("scaling", "strong")),
        int(config.get("factor_update_steps", 1)),
        int(config.get("inv_update_steps", 1)),
        float(config.get("allreduce_bucket_cap_mb", 25.0)),
    )


def predicted_vs_measured(planned: Planned, run_dir: Path) -> dict[str, dict[str, float]]:
    """``{phase: {"predicted_s": ..., "measured_s": ...}}`` plus ``step`` for one run dir
    (measured: run.json's per-step means over the run, averaged over ranks)."""
    config = json.loads((run_dir / "config.json").read_text())
    run = json.loads((run_dir / "run.json").read_text())
    prediction = planned.model.predict(config_of_run(config))
    measured: dict[str, float] = run.get("phases_s", {})
    out = {
        phase: {"predicted_s": seconds, "measured_s": float(measured.get(phase, 0.0))}
        for phase, seconds in prediction.phases_s.items()
    }
    step = run.get("step_s", {})
    out["step"] = {
        "predicted_s": prediction.step_s,
        "measured_s": float(step["mean"] if isinstance(step, dict) else step),
    }
    return out
