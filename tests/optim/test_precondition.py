"""Preconditioned gradients equal dense solves; the KL clip equals a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim.decomposition_methods import make_method
from kfac_hpc.optim.options import ComputeMethod
from tests.helpers.models import dense_eigen_step, dense_inverse_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, groups=2, stride=2),
        nn.BatchNorm2d(4),
        nn.Flatten(),
        nn.Linear(16, 3),
    ).double()


def _run_step(pre: KFACPreconditioner, model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """One backward pass and ``pre.step()``; returns every layer's gradient matrix before it."""
    torch.manual_seed(seed)
    x = torch.randn(5, 2, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    before = {name: layer.grad_matrix().clone() for name, layer in pre.layers.items()}
    pre.step()
    return before


@pytest.mark.parametrize("outer", [True, False], ids=["outer-product", "no-outer-product"])
def test_eigen_equals_dense_kronecker_solve(outer: bool) -> None:
    model = _model()
    damping = 0.03
    pre = KFACPreconditioner(
        model,
        damping=damping,
        kl_clip=None,
        inv_dtype=torch.float64,
        compute_eigenvalue_outer_product=outer,
    )
    _run_step(pre, model)  # step 0: factors and eigendecompositions
    before = _run_step(pre, model, seed=2)  # step 1: factors updated (decay) and eigen recomputed
    state = pre.state_dict()["layers"]
    for name, layer in pre.layers.items():
        expected = dense_eigen_step(state[name]["A"], state[name]["G"], before[name], damping)
        torch.testing.assert_close(layer.grad_matrix(), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", [None, "pi_split", "per_factor"])
def test_inverse_equals_factored_damping_formula(mode: str | None) -> None:
    """Both damping modes of the inverse method; the default (None) is ``pi_split``."""
    model = _model()
    damping = 0.01
    extra = {} if mode is None else {"damping_mode": mode}
    pre = KFACPreconditioner(
        model,
        damping=damping,
        kl_clip=None,
        inv_dtype=torch.float64,
        compute_method="inverse",
        **extra,
    )
    before = _run_step(pre, model)
    state = pre.state_dict()["layers"]
    for name, layer in pre.layers.items():
        a, g = state[name]["A"], state[name]["G"]
        expected = dense_inverse_step(a, g, before[name], damping, mode or "pi_split")
        torch.testing.assert_close(layer.grad_matrix(), expected, rtol=1e-9, atol=1e-12)


def test_second_order_is_reused_between_inverse_updates() -> None:
    """With inv_update_steps=3, step 1 preconditions with step 0's eigenbasis although its
    factors moved (dynamic update decoupling)."""
    model = _model()
    pre = KFACPreconditioner(
        model, damping=0.03, kl_clip=None, inv_update_steps=3, inv_dtype=torch.float64
    )
    _run_step(pre, model)
    a0 = pre.state_dict()["layers"]["5"]["A"].clone()
    g0 = pre.state_dict()["layers"]["5"]["G"].clone()
    before = _run_step(pre, model, seed=2)
    assert not torch.allclose(pre.state_dict()["layers"]["5"]["A"], a0)
    expected = dense_eigen_step(a0, g0, before["5"], 0.03)
    torch.testing.assert_close(pre.layers["5"].grad_matrix(), expected, rtol=1e-9, atol=1e-12)


def test_kl_clip_matches_hand_computation_and_leaves_unregistered_alone() -> None:
    lr, kl_clip, damping = 0.5, 1e-4, 0.03
    reference = _model()
    unclipped = KFACPreconditioner(
        reference, damping=damping, kl_clip=None, inv_dtype=torch.float64
    )
    before = _run_step(unclipped, reference)
    v = {name: layer.grad_matrix().clone() for name, layer in unclipped.layers.items()}
    vg = sum((v[n] * before[n]).sum().item() for n in v)
    nu = min(1.0, math.sqrt(kl_clip / abs(lr * lr * vg)))
    assert nu < 1, "the test must exercise the clip"

    model = _model()
    clipped = KFACPreconditioner(
        model, damping=damping, kl_clip=kl_clip, lr=lr, inv_dtype=torch.float64
    )
    _run_step(clipped, model)
    for name, layer in clipped.layers.items():
        torch.testing.assert_close(layer.grad_matrix(), nu * v[name], rtol=1e-9, atol=1e-14)
    # BatchNorm is not registered: neither in the KL sum nor scaled by ν.
    bn_ref, bn = reference[3], model[3]
    assert "3" not in clipped.layers
    torch.testing.assert_close(bn.weight.grad, bn_ref.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("kind", [ComputeMethod.EIGEN, ComputeMethod.INVERSE])
def test_second_order_data_is_column_major_on_every_path(kind: ComputeMethod) -> None:
    """Computed (no copy of what LAPACK returns), received (broadcast buffers), loaded and
    identity data all hold one layout, so every rank's preconditioning GEMMs round alike."""
    method = make_method(kind, torch.float64, True)
    torch.manual_seed(0)
    rows = torch.randn(3, 5, 7, dtype=torch.float64)
    factors = rows @ rows.mT  # grouped: (3, 5, 5)
    computed = method.compute(factors, factors, 1e-3, ["A"])["A"]
    assert computed is not None
    matrix = computed.tensors()[0]
    cpu = torch.device("cpu")
    for data in (
        computed,
        method.empty((3, 5, 5), cpu),
        method.identity((3, 5, 5), cpu),
        method.from_tensors([t.contiguous() for t in computed.tensors()]),
    ):
        held = data.tensors()[0]
        assert held.mT.is_contiguous() and not held.is_contiguous(), held.stride()
    loaded = method.from_tensors([t.contiguous() for t in computed.tensors()])
    assert torch.equal(loaded.tensors()[0], matrix)


def test_comm_opt_times_no_gradient_broadcast() -> None:
    """Under COMM-OPT (one rank: every rank is a grad worker of every layer) no gradient is
    broadcast, so the phase is not timed: it reads 0, not the cost of looking for routes."""
    model = _model()
    pre = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    assert pre.assignment.distribution.value == "comm-opt"
    _run_step(pre, model)
    assert pre.last_timings["grad_broadcast"] == 0.0
    assert pre.last_timings["precondition"] > 0.0  # the timed phases still are
