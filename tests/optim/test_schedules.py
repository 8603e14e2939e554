"""Hyperparameter schedules: numbers, callables and scheduler objects; no compounding; saved."""

from __future__ import annotations

import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim import MultiStepSchedule


def _train(pre: KFACPreconditioner, model: nn.Module, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(i)
        model.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        pre.step()


def test_values_do_not_compound_on_repeated_calls() -> None:
    pre = KFACPreconditioner(
        nn.Linear(3, 2), damping=MultiStepSchedule(0.1, [2, 4], 0.5), lr=lambda s: 0.1 / (1 + s)
    )
    assert [pre.hyperparameter("damping", s) for s in range(6)] == [
        0.1,
        0.1,
        0.05,
        0.05,
        0.025,
        0.025,
    ]
    assert pre.hyperparameter("damping", 4) == pre.hyperparameter("damping", 4) == 0.025
    assert pre.hyperparameter("lr", 3) == 0.1 / 4
    assert pre.hyperparameter("kl_clip") == 0.001


def test_update_intervals_follow_their_schedule() -> None:
    """factor_update_steps grows 1 -> 3 at step 3: factors update at steps 0, 1, 2, 3, 6."""
    model = nn.Linear(3, 2)
    pre = KFACPreconditioner(model, factor_update_steps=MultiStepSchedule(1, [3], 3))
    assert list(pre.layers) == ["Linear"]  # a bare module is named by its class
    seen = []
    for i in range(8):
        model.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        before = pre.factors["Linear"].A.clone() if pre.factors["Linear"].A is not None else None
        pre.step()
        if before is None or not torch.equal(before, pre.factors["Linear"].A):
            seen.append(i)
    assert seen == [0, 1, 2, 3, 6]


def test_scheduler_state_and_step_are_saved_and_restored() -> None:
    model = nn.Linear(3, 2)
    pre = KFACPreconditioner(model, damping=MultiStepSchedule(0.1, [2], 0.5))
    _train(pre, model, 3)
    state = pre.state_dict()
    assert state["steps"] == 3
    assert state["schedules"] == {"damping": {"initial": 0.1, "milestones": [2], "gamma": 0.5}}

    fresh = KFACPreconditioner(model, damping=MultiStepSchedule(1.0, [], 1.0))
    fresh.load_state_dict(state)
    assert fresh.steps == 3
    assert fresh.hyperparameter("damping") == 0.05
    assert fresh.hyperparameter("damping") == 0.05  # asking again changes nothing
