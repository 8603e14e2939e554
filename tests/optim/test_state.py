"""state_dict()/load_state_dict() are exact inverses, layer-keyed, and check shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from tests.helpers.models import dense_eigen_step, dense_inverse_step, small_cnn


def _step(pre: KFACPreconditioner, model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """One backward pass and ``pre.step()``; every layer's gradient matrix before it."""
    torch.manual_seed(seed)
    model.zero_grad()
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (4,))
    nn.functional.cross_entropy(model(x), y).backward()
    before = {name: layer.grad_matrix().clone() for name, layer in pre.layers.items()}
    pre.step()
    return before


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("include_second_order", [True, False])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_round_trip_continues_identically(include_second_order: bool, method: str) -> None:
    damping = 0.001
    opts = dict(
        compute_method=method,
        inv_update_steps=3,
        inv_dtype=torch.float64,
        damping=damping,
        kl_clip=None,
    )
    model = small_cnn(torch.float64)
    pre = KFACPreconditioner(model, **opts)
    for seed in range(2):
        _step(pre, model, seed)
    state = pre.state_dict(include_second_order=include_second_order)
    assert set(state["layers"]) == {"0", "2", "5"}
    assert all(isinstance(t, torch.Tensor) for e in state["layers"].values() for t in e.values())
    if include_second_order:
        keys = {"QA", "dA", "QG", "dG"} if method == "eigen" else {"A_inv", "G_inv"}
        assert keys <= set(state["layers"]["0"])

    copy = small_cnn(torch.float64)
    copy.load_state_dict(model.state_dict())
    restored = KFACPreconditioner(copy, **opts)
    restored.load_state_dict(state)
    assert restored.state_dict(include_second_order=include_second_order).keys() == state.keys()
    _step(pre, model, 7)  # step 2: no inverse update due, so loaded second-order data is used
    before = _step(restored, copy, 7)
    if include_second_order:
        for a, b in zip(_grads(model), _grads(copy), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return
    # Recomputed from this step's factors (the loaded ones updated at step 2): the dense
    # formula of the method with those factors.
    dense = dense_eigen_step if method == "eigen" else dense_inverse_step
    factors = restored.state_dict()["layers"]
    for name, layer in restored.layers.items():
        expected = dense(factors[name]["A"], factors[name]["G"], before[name], damping)
        torch.testing.assert_close(layer.grad_matrix(), expected, rtol=1e-9, atol=1e-12)
    assert restored.memory_usage() == pre.memory_usage()


def test_load_checks_shapes_naming_the_layer() -> None:
    model = small_cnn(torch.float64)
    pre = KFACPreconditioner(model)
    _step(pre, model, 0)
    state = pre.state_dict()
    state["layers"]["2"]["G"] = torch.zeros(5, 5, dtype=torch.float64)
    fresh = KFACPreconditioner(small_cnn(torch.float64))
    with pytest.raises(ValueError, match=r"layer 2: factor G has shape \(5, 5\).*\(32, 32\)"):
        fresh.load_state_dict(state)
    assert fresh.factors["0"].A is None, "a failed load changes nothing"
    state["layers"]["9"] = state["layers"].pop("2")
    with pytest.raises(ValueError, match="layers this model lacks: 9"):
        fresh.load_state_dict(state)


def test_memory_usage_counts_factors_and_second_order_separately() -> None:
    model = small_cnn(torch.float32)
    pre = KFACPreconditioner(model, compute_eigenvalue_outer_product=False)
    assert pre.memory_usage() == {"factors_bytes": 0, "second_order_bytes": 0, "total_bytes": 0}
    torch.manual_seed(0)
    nn.functional.cross_entropy(
        model(torch.randn(4, 1, 8, 8)), torch.randint(0, 10, (4,))
    ).backward()
    pre.step()
    sizes = [(10, 16), (145, 32), (513, 10)]  # (n_A, n_G) of the three layers
    factors = sum(a * a + g * g for a, g in sizes) * 4
    second = sum(a * a + a + g * g + g for a, g in sizes) * 4
    assert pre.memory_usage() == {
        "factors_bytes": factors,
        "second_order_bytes": second,
        "total_bytes": factors + second,
    }


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_later_steps_never_modify_saved_state_tensors_in_place(method: str) -> None:
    """What lets an asynchronous checkpoint reference the state instead of copying it: the
    tensors of a state_dict() keep their values and their ``_version`` through later factor
    and second-order updates."""
    model = small_cnn(torch.float64)
    pre = KFACPreconditioner(model, compute_method=method, inv_dtype=torch.float64)
    _step(pre, model, 0)
    state = pre.state_dict(include_second_order=True)
    tensors = [t for entry in state["layers"].values() for t in entry.values()]
    saved = [(t.clone(), t._version) for t in tensors]
    for seed in (1, 2):
        _step(pre, model, seed)
    assert not torch.equal(pre.state_dict()["layers"]["0"]["A"], state["layers"]["0"]["A"])
    for tensor, (value, version) in zip(tensors, saved, strict=True):
        assert tensor._version == version
        assert torch.equal(tensor, value)
