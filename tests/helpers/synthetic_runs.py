"""Run directories with chosen timings, following docs/contracts.md exactly.

For the collector's tests (known timings give known metrics), its benchmark and the example
plots in the docs. Every step of a synthetic run takes ``step_s`` seconds on rank-average,
so its throughput is ``global_batch_size / step_s`` and its wall time ``steps * step_s``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kfac_hpc.analysis import schema


@dataclass
class SyntheticRun:
    """One run: ``phases_s`` (per step, rank-average) must sum to at most ``step_s``.

    ``accuracy`` maps eval steps to accuracies; ``attempt_ends`` are the steps at which
    attempts ended before the last (a requeue after each); ``rank_skew`` multiplies rank r's
    step time by ``1 + rank_skew * (r - (world - 1) / 2)`` (its mean over ranks stays step_s).
    """

    name: str
    nodes: int
    step_s: float
    phases_s: dict[str, float]
    ranks_per_node: int = 1
    optimizer: str = "sgd"
    kfac: bool = False
    scaling: str = "strong"
    batch_size: int = 64
    steps: int = 100
    window_steps: int = 10
    accuracy: dict[int, float] = field(default_factory=dict)
    target_accuracy: float | None = None
    attempt_ends: tuple[int, ...] = ()
    rank_skew: float = 0.0
    seed: int = 0
    model: str = "small_cnn"
    dataset: str = "digits"
    state: str = "done"  # done | error | preempted | running (no marker, no run.json)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size if self.scaling == "weak" else self.batch_size

    def params(self) -> dict[str, Any]:
        """The sweep parameters of this run (the manifest's ``params``)."""
        return {
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "optimizer": self.optimizer,
            "kfac": self.kfac,
            "scaling": self.scaling,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }


def _attempt_of(run: SyntheticRun, step: int) -> int:
    """Attempt that ran ``step`` (1-based): attempt k runs steps (ends[k-1], ends[k]]."""
    return sum(1 for end in run.attempt_ends if step > end)


def _rank_factors(run: SyntheticRun) -> list[float]:
    middle = (run.world_size - 1) / 2
    return [1 + run.rank_skew * (r - middle) for r in range(run.world_size)]


def _records(run: SyntheticRun, last_step: int) -> list[dict[str, Any]]:
    factors = _rank_factors(run)
    out: list[dict[str, Any]] = []
    evals = dict(run.accuracy)
    for step in range(1, last_step + 1):
        wall = step * run.step_s
        if step % run.window_steps == 0:
            out.append(
                {
                    "schema": schema.RUN_SCHEMA,
                    "kind": "train",
                    "attempt": _attempt_of(run, step),
                    "step": step,
                    "epoch": step // 50,
                    "wall_s": wall,
                    "window_steps": run.window_steps,
                    "loss": 2.0 / (1 + step / 50),
                    "samples_per_s": run.global_batch_size / run.step_s,
                    "step_s": run.step_s,
                    "phases_s": run.phases_s,
                    "rank_step_s": [run.step_s * f for f in factors],
                    "rank_phases_s": {p: [v * f for f in factors] for p, v in run.phases_s.items()},
                }
            )
        if step in evals:
            out.append(
                {
                    "schema": schema.RUN_SCHEMA,
                    "kind": "eval",
                    "attempt": _attempt_of(run, step),
                    "step": step,
                    "epoch": step // 50,
                    "wall_s": wall,
                    "loss": 1.0 - evals[step],
                    "accuracy": evals[step],
                }
            )
    return out


def _summary(run: SyntheticRun) -> dict[str, Any]:
    ends = [*run.attempt_ends, run.steps]
    starts = [0, *run.attempt_ends]
    reached = [
        s
        for s, a in sorted(run.accuracy.items())
        if run.target_accuracy and a >= run.target_accuracy
    ]
    accs = [run.accuracy[s] for s in sorted(run.accuracy)]
    per_rank = run.global_batch_size / run.step_s / run.world_size
    factors = _rank_factors(run)
    return {
        "schema": schema.RUN_SCHEMA,
        "state": "done",
        "run_id": run.name,
        "config_hash": f"hash-{run.name}",
        "model": run.model,
        "dataset": run.dataset,
        "optimizer": run.optimizer,
        "kfac": run.kfac,
        "grad_worker_fraction": 1.0,
        "scaling": run.scaling,
        "world_size": run.world_size,
        "nodes": run.nodes,
        "ranks_per_node": run.ranks_per_node,
        "launcher": "pmi",
        "backend": "gloo",
        "global_batch_size": run.global_batch_size,
        "per_rank_batch_size": run.global_batch_size // run.world_size,
        "steps": run.steps,
        "epochs": run.steps // 50,
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "target_accuracy": run.target_accuracy,
        "time_to_target_s": reached[0] * run.step_s if reached else None,
        "step_to_target": reached[0] if reached else None,
        "wall_s": run.steps * run.step_s,
        "compute_s": run.steps * run.step_s,
        "attempts": [
            {
                "attempt": i,
                "start_step": start,
                "end_step": end,
                "wall_s": (end - start) * run.step_s,
                "end": "done" if i == len(ends) - 1 else "preempted",
            }
            for i, (start, end) in enumerate(zip(starts, ends, strict=True))
        ],
        "restarts": len(run.attempt_ends),
        "step_s": {"mean": run.step_s, "p50": run.step_s, "p90": run.step_s},
        "samples_per_s": run.global_batch_size / run.step_s,
        "samples_per_s_per_rank": [per_rank / f for f in factors],
        "phases_s": run.phases_s,
        "rank_phases_s": {p: [v * f for f in factors] for p, v in run.phases_s.items()},
        "peak_rss_bytes": 400_000_000,
        "peak_cuda_bytes": None,
        "versions": {"kfac_hpc": "synthetic"},
    }


def write_run_dir(path: Path, run: SyntheticRun) -> Path:
    """Write ``run`` as a run directory at ``path`` (created) and return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "checkpoints").mkdir(exist_ok=True)
    config = {
        "schema": schema.RUN_SCHEMA,
        **run.params(),
        "model": run.model,
        "dataset": run.dataset,
        "steps": run.steps,
        "log_every": run.window_steps,
        "target_accuracy": run.target_accuracy,
        "config_hash": f"hash-{run.name}",
    }
    (path / "config.json").write_text(json.dumps(config))
    last = run.steps if run.state == "done" else (run.attempt_ends or (run.steps // 2,))[-1]
    lines = [json.dumps(r) for r in _records(run, last)]
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    if run.state == "done":
        (path / "run.json").write_text(json.dumps(_summary(run)))
        (path / "done").write_text("")
    elif run.state in ("error", "preempted"):
        (path / run.state).write_text("synthetic failure\n" if run.state == "error" else "")
    return path


def write_sweep(
    sweep_dir: Path, runs: list[SyntheticRun], states: dict[str, str] | None = None
) -> Path:
    """A sweep directory: ``manifest.json`` listing ``runs`` and their run directories.

    ``states`` overrides a point's manifest state by run name (default: the run's own state,
    ``running`` for runs without an end marker). Returns the manifest's path.
    """
    states = states or {}
    points = []
    for index, run in enumerate(runs):
        write_run_dir(sweep_dir / "runs" / run.name, run)
        default = (
            "done" if run.state == "done" else ("failed" if run.state == "error" else run.state)
        )
        points.append(
            {
                "point_id": run.name,
                "params": run.params(),
                "config_hash": f"hash-{run.name}",
                "run_dir": f"runs/{run.name}",
                "array": f"n{run.nodes}",
                "array_index": index,
                "array_job_id": "1000",
                "job_id": f"1000_{index}",
                "attempts": len(run.attempt_ends) + 1,
                "state": states.get(run.name, default),
                "detail": "",
            }
        )
    manifest = {"schema": 1, "kind": "sweep_manifest", "name": sweep_dir.name, "points": points}
    path = sweep_dir / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1))
    return path


def _demo_phases(nodes: int, kfac: bool, noise: float) -> dict[str, float]:
    """Per-step seconds of an illustrative model: compute shrinks as 1/n (global batch 1024
    split over n nodes), allreduces grow with log2(2n); K-FAC adds factor and eigen work."""
    phases = {
        "data": 0.004 / nodes,
        "forward": 0.060 / nodes * noise,
        "backward": 0.120 / nodes * noise,
        "grad_allreduce": 0.003 * math.log2(2 * nodes) if nodes > 1 else 0.0,
        "optimizer": 0.003,
    }
    if kfac:
        phases |= {
            "factor_compute": 0.030 / nodes * noise,
            "factor_comm": 0.002 * math.log2(2 * nodes) if nodes > 1 else 0.0,
            "inverse_compute": 0.040 / nodes,
            "inverse_comm": 0.001 * math.log2(nodes) if nodes > 1 else 0.0,
            "precondition": 0.010,
        }
    return phases


def demo_sweep(sweep_dir: Path | str, repeats: int = 3) -> Path:
    """An illustrative synthetic sweep (SGD vs K-FAC, 1-16 nodes, ``repeats`` repeats) for
    docs and demos: clearly not measured; every number follows :func:`_demo_phases`."""
    rng = random.Random(0)
    runs = []
    for nodes in (1, 2, 4, 8, 16):
        for kfac in (False, True):
            for seed in range(repeats):
                noise = 1 + rng.uniform(-0.04, 0.04)
                phases = _demo_phases(nodes, kfac, noise)
                tau = 45.0 if kfac else 80.0  # steps to 63 % of the final accuracy
                runs.append(
                    SyntheticRun(
                        f"{'kfac' if kfac else 'sgd'}-n{nodes}-s{seed}",
                        nodes,
                        sum(phases.values()) * 1.02,
                        phases,
                        ranks_per_node=4,
                        kfac=kfac,
                        batch_size=1024,
                        model="resnet50",
                        dataset="synthetic_imagenet",
                        steps=300,
                        window_steps=10,
                        seed=seed,
                        accuracy={s: 0.97 * (1 - math.exp(-s / tau)) for s in range(20, 301, 20)},
                        target_accuracy=0.9,
                        rank_skew=0.002 * nodes,
                    )
                )
    write_sweep(Path(sweep_dir), runs)
    return Path(sweep_dir)
