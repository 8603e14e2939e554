"""The cost model next to finished runs: predicted seconds per phase for a run directory's
resolved configuration, beside what the run measured; and ``kfac-hpc plan --explain``, which
writes the predictions of every run of a sweep to ``SWEEP_DIR/predicted.json`` for
``kfac-hpc report`` to show (the report reads files only; it never runs the cost model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.options import OPTIONS
from kfac_hpc.contracts.records import phase_step_s
from kfac_hpc.contracts.rundir import CONFIG, PREDICTED, RUN, write_json_atomic
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.model import PlanConfig
from kfac_hpc.plan.planner import Planned, build_cost_model

__all__ = ["config_of_run", "explain_sweep", "predicted_vs_measured"]

_STRATEGIES = {
    "comm-opt": "kfac-comm-opt",
    "hybrid-opt": "kfac-hybrid-opt",
    "mem-opt": "kfac-mem-opt",
}


def config_of_run(config: dict[str, Any]) -> PlanConfig:
    """The plan configuration of a run's ``config.json`` (resolved, with ``world_size``),
    every FOSI option the plan prices included (k, l, the ESE's interval, warm-up, Lanczos
    steps, curvature fraction, basis dtype, reorthogonalization, kept basis, subspace check)
    and the run's ``steps`` (None for a run of ``epochs``: the ESE's steady state).

    A numeric ``grad_worker_fraction`` maps to the named strategy it equals (1 → comm-opt,
    0.5 → hybrid-opt, 1/P → mem-opt); other fractions raise ``ValueError``.
    """
    ranks = int(config["world_size"])
    method = "fosi" if config.get("fosi") else "sgd"
    if config.get("kfac"):
        fraction = _get(config, "grad_worker_fraction")
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
        str(_get(config, "scaling")),
        int(_get(config, "factor_update_steps")),
        int(_get(config, "inv_update_steps")),
        float(_get(config, "allreduce_bucket_cap_mb")),
        int(_get(config, "fosi_k")),
        int(_get(config, "fosi_l")),
        int(_get(config, "ese_every")),
        _get(config, "lanczos_iters"),
        fosi_curvature_fraction=float(_get(config, "fosi_curvature_fraction")),
        fosi_lanczos_dtype=str(_get(config, "fosi_lanczos_dtype")),
        fosi_reorthogonalize=str(_get(config, "fosi_reorthogonalize")),
        fosi_keep_basis=bool(_get(config, "fosi_keep_basis")),
        fosi_warmup=int(_get(config, "fosi_warmup")),
        fosi_ese_check=bool(_get(config, "fosi_ese_check")),
        steps=None if _get(config, "steps") is None else int(_get(config, "steps")),
    )


def _get(config: dict[str, Any], name: str) -> Any:
    """The run's value of option ``name``; the job's default (the option table's) when its
    config.json predates the option."""
    return config.get(name, OPTIONS[name].default)


def predicted_vs_measured(planned: Planned, run_dir: Path) -> dict[str, dict[str, float]]:
    """``{phase: {"predicted_s": ..., "measured_s": ...}}`` plus ``step`` for one run dir
    (measured: run.json's per-step means over the run, averaged over ranks; the step is the
    ranks' mean step, ``contracts.records.phase_step_s``, so ``other`` is the mean time outside
    every phase)."""
    config = json.loads((run_dir / "config.json").read_text())
    run = json.loads((run_dir / "run.json").read_text())
    prediction = planned.model.predict(config_of_run(config))
    measured: dict[str, float] = run.get("phases_s", {})
    out = {
        phase: {"predicted_s": seconds, "measured_s": float(measured.get(phase, 0.0))}
        for phase, seconds in prediction.phases_s.items()
    }
    step_s = phase_step_s(run) or 0.0
    out["other"] = {
        "predicted_s": prediction.other_s,
        "measured_s": step_s - sum(r["measured_s"] for r in out.values()),
    }
    out["step"] = {"predicted_s": prediction.step_s, "measured_s": step_s}
    return out


def explain_sweep(
    sweep_dir: Path, profile: str | None, calibration_ranks: list[int]
) -> tuple[Path, int]:
    """Predict every finished run directory under ``sweep_dir`` (``config.json`` and
    ``run.json``); write ``sweep_dir/predicted.json``; return its path and the run count.
    One cost model per (model, dataset), measured here (at the first run's local batch)
    unless ``profile``."""
    runs = sorted(p.parent for p in sweep_dir.rglob(CONFIG) if (p.parent / RUN).is_file())
    if not runs:
        raise PlanInputError(
            "explain", f"no finished run directory ({CONFIG} and {RUN}) under {sweep_dir}"
        )
    models: dict[tuple[str, str], Planned] = {}
    predicted: dict[str, dict[str, Any]] = {}
    sources = set()
    for run_dir in runs:
        try:
            config = json.loads((run_dir / CONFIG).read_text())
            cfg = config_of_run(config)
        except (OSError, KeyError, TypeError, ValueError) as exc:  # unreadable, not JSON, bad
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise PlanInputError("explain", f"{run_dir / CONFIG}: {reason}") from None
        key = (str(config.get("model")), str(config.get("dataset")))
        if key not in models:
            models[key] = build_cost_model(*key, profile, calibration_ranks, cfg.local_batch)
        pred = models[key].model.predict(cfg)
        sources.add(models[key].source)
        predicted[run_dir.relative_to(sweep_dir).as_posix()] = {
            "method": cfg.method,
            "ranks": cfg.ranks,
            "phases_s": pred.phases_s,
            "other_s": pred.other_s,
            "step_s": pred.step_s,
        }
    out = sweep_dir / PREDICTED
    write_json_atomic(out, {"source": "; ".join(sorted(sources)), "runs": predicted})
    return out, len(predicted)
