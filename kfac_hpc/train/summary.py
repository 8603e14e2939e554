"""The attempts of a run and its final summary (``run.json``), built from files on disk.

Attempts are logged in ``RUN_DIR/.attempts.jsonl`` (the job's own bookkeeping, not part of the
collector's contract): a ``start`` line when an attempt begins and an ``end`` line when it ends
cleanly. An attempt without an ``end`` line was killed; its end step is the furthest of its last
``metrics.jsonl`` record and the checkpoint the next attempt resumed from, its wall time the span
of its records. Everything ``run.json`` reports over the whole run (phase means,
throughput, accuracies, time to target) is computed from ``metrics.jsonl``, so attempts add up.
"""

from __future__ import annotations

import json
from typing import Any

from kfac_hpc.contracts import PHASES, SCHEMA_VERSION, RunDir
from kfac_hpc.contracts.records import EVAL, TRAIN

__all__ = ["AttemptLog", "build_summary"]


class AttemptLog:
    """Read and append the attempts of one run directory."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.path = run_dir.attempts

    def _lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def _append(self, entry: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()

    def start(self, attempt: int, start_step: int) -> None:
        self._append({"event": "start", "attempt": attempt, "start_step": start_step})

    def end(self, attempt: int, end_step: int, wall_s: float, end: str) -> None:
        self._append(
            {"event": "end", "attempt": attempt, "end_step": end_step, "wall_s": wall_s, "end": end}
        )

    def attempts(self) -> list[dict[str, Any]]:
        """One entry per attempt: attempt, start_step, end_step, wall_s, end."""
        by_attempt: dict[int, dict[str, Any]] = {}
        for line in self._lines():
            entry = by_attempt.setdefault(line["attempt"], {"attempt": line["attempt"]})
            if line["event"] == "start":
                entry["start_step"] = line["start_step"]
            else:
                entry.update({k: line[k] for k in ("end_step", "wall_s", "end")})
        records = self.run_dir.read_metrics()
        numbers = sorted(by_attempt)
        for i, number in enumerate(numbers):
            entry = by_attempt[number]
            if "end" in entry:
                continue
            mine = [r for r in records if r.get("attempt") == number]
            # it got at least as far as its last record and the checkpoint the next one resumed
            reached = [r["step"] for r in mine] + [entry.get("start_step", 0)]
            if i + 1 < len(numbers):
                reached.append(by_attempt[numbers[i + 1]].get("start_step", 0))
            entry["end_step"] = max(reached)
            first = min((r["wall_s"] for r in mine), default=0.0)
            last = max((r["wall_s"] for r in mine), default=0.0)
            entry["wall_s"] = last - first
            entry["end"] = "killed"
        return [by_attempt[k] for k in numbers]

    def next_attempt(self) -> int:
        numbers = [line["attempt"] for line in self._lines()]
        return max(numbers) + 1 if numbers else 0


def _phase_means(records: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """Per-step means over all train windows (weighted by their steps) of the final world size."""
    windows = [r for r in records if len(r["rank_step_s"]) == world_size]
    steps = sum(r["window_steps"] for r in windows)
    if steps == 0:
        return {
            "compute_s": 0.0,
            "phases_s": dict.fromkeys(PHASES, 0.0),
            "rank_phases_s": {n: [0.0] * world_size for n in PHASES},
            "rank_step_s": [0.0] * world_size,
        }
    names = list(windows[0]["phases_s"])
    rank_phases = {
        n: [
            sum(r["window_steps"] * r["rank_phases_s"][n][i] for r in windows) / steps
            for i in range(world_size)
        ]
        for n in names
    }
    rank_step = [
        sum(r["window_steps"] * r["rank_step_s"][i] for r in windows) / steps
        for i in range(world_size)
    ]
    return {
        "compute_s": sum(r["window_steps"] * r["step_s"] for r in records),
        "phases_s": {n: sum(v) / world_size for n, v in rank_phases.items()},
        "rank_phases_s": rank_phases,
        "rank_step_s": rank_step,
    }


def _quality(evals: list[dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """Final and best test accuracy and loss, and the first time the target was reached:
    ``target_accuracy`` (higher is better) or ``target_loss`` (lower is better)."""
    accuracy, loss = facts.get("target_accuracy"), facts.get("target_loss")
    if accuracy is not None:
        reached = [e for e in evals if e["accuracy"] >= accuracy]
    else:
        reached = [e for e in evals if loss is not None and e["loss"] <= loss]
    first = min(reached, key=lambda e: e["wall_s"]) if reached else None
    return {
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "best_accuracy": max((e["accuracy"] for e in evals), default=None),
        "final_test_loss": evals[-1]["loss"] if evals else None,
        "best_test_loss": min((e["loss"] for e in evals), default=None),
        "target_accuracy": accuracy,
        "target_loss": loss,
        "time_to_target_s": first["wall_s"] if first else None,
        "step_to_target": first["step"] if first else None,
    }


def build_summary(
    run_dir: RunDir, state: str, facts: dict[str, Any], error: str | None = None
) -> dict[str, Any]:
    """The ``run.json`` object. ``facts`` holds what only the live job knows (world size,
    launcher, batch sizes, step statistics, memory, versions, ...); the rest is read from disk."""
    records = run_dir.read_metrics()
    train = [r for r in records if r.get("kind") == TRAIN]
    evals = sorted(
        (r for r in records if r.get("kind") == EVAL), key=lambda r: (r["attempt"], r["step"])
    )
    attempts = AttemptLog(run_dir).attempts()
    world_size = facts["world_size"]
    means = _phase_means(train, world_size)
    per_rank_batch = facts["per_rank_batch_size"]
    rank_rates = [per_rank_batch / s if s > 0 else 0.0 for s in means["rank_step_s"]]
    summary: dict[str, Any] = {"schema": SCHEMA_VERSION, "state": state}
    if error is not None:
        summary["error"] = error
    summary.update(facts)
    summary.update(_quality(evals, facts))
    summary.update(
        {
            "wall_s": sum(a["wall_s"] for a in attempts),
            "compute_s": means["compute_s"],
            "attempts": attempts,
            "restarts": max(0, len(attempts) - 1),
            "samples_per_s": sum(rank_rates),
            "samples_per_s_per_rank": rank_rates,
            "phases_s": means["phases_s"],
            "rank_phases_s": means["rank_phases_s"],
            "rank_step_s": means["rank_step_s"],
        }
    )
    return summary
