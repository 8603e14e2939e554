"""FOSI's state and the settings it was saved with: a state saved around another base optimizer
is refused (ValueError naming both, nothing loaded); one saved with another k or l loads
without its eigenpairs, which the next step re-estimates. The library refuses only what is
mathematically invalid (k + l above the parameter count, NaN, wrong types), not large values.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kfac_hpc.optim.fosi import FOSI, FOSIOptions, NonFiniteCurvature

BASES = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _setup(base: str = "sgd", k: int = 2, l: int = 1) -> tuple[nn.Module, FOSI]:  # noqa: E741
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    optimizer = FOSI(
        model.parameters(), BASES[base](model.parameters()), k=k, l=l, warmup=1, ese_every=100,
        model=model, residual_tol=1.0, ese_check=False,  # every pair kept: states of k + l
    )  # fmt: skip
    return model, optimizer


def _train(model: nn.Module, opt: FOSI, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (12,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y))


def _saved(base: str = "sgd", k: int = 2, l: int = 1) -> dict[str, Any]:  # noqa: E741
    model, opt = _setup(base, k, l)
    _train(model, opt, range(4))  # one ESE, at step 1
    assert opt.ese_count == 1 and opt.eigenvalues.numel() == k + l
    return opt.full_state_dict()


def _legacy(state: dict[str, Any]) -> dict[str, Any]:
    """A state as written before it named its base optimizer, k and l."""
    return {key: v for key, v in state.items() if key not in ("base_optimizer", "k", "l")}


@pytest.mark.parametrize(("saved", "loaded"), [("sgd", "adam"), ("adam", "sgd"), ("adam", "adamw")])
@pytest.mark.parametrize("legacy", [False, True])
def test_state_of_another_base_optimizer_is_refused_and_nothing_loaded(saved, loaded, legacy):
    state = _saved(saved)
    if legacy:
        state = _legacy(state)
    _, opt = _setup(loaded)
    with pytest.raises(ValueError, match="base optimizer"):
        opt.load_full_state_dict(state)
    assert opt.step_count == 0 and opt.vectors is None
    if not legacy:
        with pytest.raises(ValueError, match=f"{type(opt.base).__name__}"):
            opt.load_full_state_dict(state)


def test_state_names_its_base_optimizer_k_and_l():
    state = _saved("adamw", k=2, l=1)
    assert (state["base_optimizer"], state["k"], state["l"]) == ("AdamW", 2, 1)
    assert state["reestimated_at"] == []


@pytest.mark.parametrize("legacy", [False, True])
def test_other_k_or_l_drops_the_eigenpairs_and_the_next_step_reestimates(legacy):
    state = _saved(k=2, l=1)
    if legacy:  # older states: told by more eigenpairs than k + l
        state = _legacy(state)
    model, opt = _setup(k=1, l=0)
    opt.load_full_state_dict(state)
    assert opt.vectors is None and opt.velocity is None and opt.eigenvalues.numel() == 0
    assert opt.reestimate_pending and opt.reestimated_at == [4]
    _train(model, opt, range(4, 5))  # not an ESE step of the schedule (warmup 1, every 100)
    assert opt.ese_count == 2 and opt.eigenvalues.numel() == 1 and not opt.reestimate_pending
    _train(model, opt, range(5, 6))
    assert opt.ese_count == 2  # back on the schedule
    assert opt.full_state_dict()["reestimated_at"] == [4]


def test_same_k_and_l_keeps_the_eigenpairs():
    state = _saved(k=2, l=1)
    model, opt = _setup(k=2, l=1)
    opt.load_full_state_dict(state)
    assert not opt.reestimate_pending and opt.eigenvalues.numel() == 3
    _train(model, opt, range(4, 5))
    assert opt.ese_count == 1 and opt.reestimated_at == []


def test_k_plus_l_above_the_parameter_count_is_refused():
    model = nn.Linear(2, 2)  # 6 parameters
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"k \+ l <= 6"):
        FOSI(model.parameters(), base, k=6, l=1, model=model)
    FOSI(model.parameters(), base, k=6, l=0, model=model)  # all of them: valid


def test_large_but_valid_values_are_the_caller_s_choice():
    FOSIOptions(k=5000, l=5000, alpha=1e12, clip=1e12, ese_every=2**40, lanczos_iters=10**9)
    model = nn.Linear(2, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    FOSI(model.parameters(), base, k=2, lanczos_iters=10**9, alpha=1e9, clip=1e9, model=model)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("alpha", float("nan")),
        ("alpha", 0.0),
        ("alpha", "0.1"),
        ("alpha", True),
        ("momentum", float("nan")),
        ("momentum", "0.9"),
        ("clip", float("inf")),
        ("clip", 0.5),
        ("k", -1),
        ("k", 2.0),
    ],
)
def test_invalid_values_are_refused_naming_the_option(name, value):
    with pytest.raises(ValueError, match=f"FOSI option {name}="):
        FOSIOptions(**{name: value})


def test_non_finite_curvature_says_its_step_and_whether_training_diverged():
    model, opt = _setup()
    _train(model, opt, range(1))
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    with pytest.raises(NonFiniteCurvature) as caught:
        _train(model, opt, range(1, 2))
    assert caught.value.step == 1 and caught.value.diverged
