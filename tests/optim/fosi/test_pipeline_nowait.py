"""DHO2 with pipelined curvature and a staleness bound: the training ranks never wait for the
curvature ranks.

Real processes (mpiexec, gloo) run tests/helpers/rank_scripts/fosi_nowait.py at P = 2 and 3
(the last rank computes ESEs; bound 2 steps, ESEs requested at steps 1, 6, 11). The curvature
rank's ESE of step 6 is held until training rank 0 has finished step 9 — a training rank that
waited for it would never get there (the held rank then fails the job after a timeout). Steps 8
and 9, past the bound, must be the base optimizer's update alone and be counted; the held
result is swapped in once it has arrived.

Every step of every training rank is checked against a dense replay (float64, full-length
vectors, torch.func gradients of the global batch): θ ← θ − lr·g on the counted steps and
before the first swap, else FOSI's formula with the eigenpairs swapped in at that step
(g1 = VᵀVg, v ← βv + (1 − β)g1, d1 = −α Vᵀ(|λ|⁻¹ ⊙ Vv), d2 = −lr(g − g1) projected out of
span(V), θ ← θ + s·d2 + d1), to ``|Δ| <= 1e-10 · max|θ|``. A state saved with the held ESE in
flight makes the resumed run take the base update from that ESE's bound (step 8) until the next
ESE arrives.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import run_mpi
from tests.helpers.launch import RANK_SCRIPTS
from tests.helpers.rank_scripts.fosi_nowait import LR, OPTIONS
from tests.helpers.rank_scripts.fosi_sharded import batch, build_model

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "fosi_nowait.py"
RTOL = 1e-10


def run(world_size: int, out: Path) -> list[dict[str, Any]]:
    proc = run_mpi(world_size, [sys.executable, str(SCRIPT), str(out)])
    assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    assert [r["world_size"] for r in ranks] == [world_size] * world_size
    assert [r["rank"] for r in ranks] == list(range(world_size))
    return [r["results"] for r in ranks]


def gradient(theta: torch.Tensor, step: int) -> torch.Tensor:
    """The mean cross-entropy gradient of the global batch of ``step`` at ``theta``."""
    model = build_model()
    with torch.no_grad():
        sizes = [p.numel() for p in model.parameters()]
        for p, value in zip(model.parameters(), theta.split(sizes), strict=True):
            p.copy_(value.view_as(p))
    x, y = batch(step)
    nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


def scale(values: torch.Tensor, top: int) -> float:
    """s = clip(λ_max/λ_k, 1, clip), at most the Newton bound 1/(lr λ_k) but at least 1."""
    lam_k = float(values[top - 1])
    if lam_k <= 0:
        return 1.0
    ratio = min(max(float(values[0]) / lam_k, 1.0), 3.0)
    return min(ratio, max(1.0 / (LR * lam_k), 1.0))


class Replay:
    """Dense FOSI over full-length vectors: the eigenpairs in use and the velocity."""

    def __init__(self) -> None:
        self.spectrum: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self.velocity: torch.Tensor | None = None

    def step(self, theta: torch.Tensor, step: int, record: dict[str, Any]) -> torch.Tensor:
        if step in record["installs"]:
            self.spectrum = record["installs"][step]
            if self.velocity is None:
                self.velocity = torch.zeros_like(theta)
        g = gradient(theta, step)
        if self.spectrum is None or step in record["late_steps"]:
            return theta - LR * g
        values, top, V = self.spectrum
        assert self.velocity is not None
        P = V.T @ V
        g1 = P @ g
        self.velocity = 0.9 * self.velocity + 0.1 * g1
        d1 = -OPTIONS["alpha"] * V.T @ ((V @ self.velocity) / values.abs())
        d2 = -LR * (g - g1)
        d2 = d2 - P @ d2
        return theta + scale(values, top) * d2 + d1


def assert_replayed(replay: Replay, record: dict[str, Any], steps: range, what: str) -> None:
    for i, step in enumerate(steps):
        want = replay.step(record["before"][i], step, record)
        got = record["after"][i]
        bound = RTOL * want.abs().max().item()
        err = (got - want).abs().max().item()
        assert err <= bound, f"{what} step {step}: max |Δ| {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_ranks_never_wait_and_take_the_base_update_past_the_bound(
    world_size: int, tmp_path: Path
) -> None:
    ranks = run(world_size, tmp_path)
    training = [r for r in ranks if not r["curvature_rank"]]
    assert len(training) == world_size - 1 and ranks[-1]["curvature_rank"]
    for r, results in enumerate(training):
        main, resumed = results["run"], results["resumed"]
        late = main["late_steps"]
        # the held ESE (step 6) arrived at step 10 at the earliest: 8 and 9 are past its bound;
        # ESE 1 arrived before step 2 (held there), so steps 2..7 use it
        assert late[:2] == [8, 9] and not set(late) & {0, 1, 2, 3, 4, 5, 6, 7, 10}, late
        assert sorted(main["installs"])[:2] == [2, 10]
        assert main["staleness"][:2] == [1, 4]  # swapped at steps 2 and 10
        assert_replayed(Replay(), main, range(15), f"P={world_size} rank {r}")
        # resumed before step 10 with the held ESE in flight: the base update from its bound
        # (step 8) until ESE 11 arrives (held before step 12)
        assert resumed["late_from"] == 8
        assert resumed["late_steps"] == [8, 9, 10, 11]
        assert sorted(resumed["installs"]) == [12]
        replay = Replay()
        assert_replayed(replay, main, range(10), f"P={world_size} rank {r}")
        assert_replayed(replay, resumed, range(10, 15), f"resumed P={world_size} rank {r}")
        assert results["run"]["after"][9].equal(resumed["before"][0])
        # ending with an ESE in flight: FOSI.close waited for it (the curvature rank's send
        # would otherwise have met a closed connection: every rank must have written its file)
        closing = results["closing"]
        assert closing["in_flight_at_end"] == 1 and closing["in_flight_after_close"] == 0
