"""FOSI keeps the model's parameters as views of its flat buffer (flat_params.py).

The Parameter objects stay the model's; a step's update is the parameters' new values; the
model's load_state_dict writes into the buffer; gradients set to None, replaced by new tensors
or zeroed in place all reach the step. The step's result is checked against the dense formula of
test_step.py (float64, tolerance 1e-12 relative) over several steps, and against the base
optimizer bit for bit without a spectrum.
"""

from __future__ import annotations

import torch
from torch import nn

from kfac_hpc.optim.fosi import FOSI


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    return model(x).pow(2).mean()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def test_parameters_are_views_of_the_buffer_and_keep_their_identity() -> None:
    model = _model()
    params = list(model.parameters())
    ids = [id(p) for p in params]
    opt = FOSI(params, torch.optim.SGD(params, lr=0.1), warmup=100, model=model)
    assert [id(p) for p in model.parameters()] == ids
    assert all(p.is_leaf and p.requires_grad for p in params)
    opt.flat.values.zero_()  # a write into the buffer is a write into the parameters
    assert all(bool((p == 0).all()) for p in params)


def test_load_state_dict_of_the_model_writes_the_parameters_fosi_steps() -> None:
    model, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    params = list(model.parameters())
    opt = FOSI(params, torch.optim.SGD(params, lr=0.1), warmup=100, model=model)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(opt.flat.values, _flat(list(other.parameters())), rtol=0, atol=0)
    _loss(model, 0).backward()
    want = _flat(list(other.parameters())) - 0.1 * _flat([p.grad for p in params])
    opt.step()  # SGD's p.add_(grad, alpha=-lr) may round once less than the oracle
    torch.testing.assert_close(_flat(params), want, rtol=1e-14, atol=1e-14)


def test_replaced_parameter_data_is_adopted_at_the_next_step() -> None:
    model = _model()
    params = list(model.parameters())
    opt = FOSI(params, torch.optim.SGD(params, lr=0.1), warmup=100, model=model)
    params[0].data = torch.ones_like(params[0])  # no longer a view of the buffer
    model.zero_grad()
    _loss(model, 0).backward()
    want = _flat(params) - 0.1 * _flat([p.grad for p in params])
    opt.step()  # SGD's p.add_(grad, alpha=-lr) may round once less than the oracle
    torch.testing.assert_close(_flat(params), want, rtol=1e-14, atol=1e-14)
    assert params[0].data_ptr() == opt.flat.values.data_ptr()


def test_gradients_none_new_or_zeroed_equal_the_base_bit_for_bit() -> None:
    """Without a spectrum FOSI is SGD: the same parameters whatever form the gradients take
    (None for an unused parameter, new tensors after set_to_none, zeroed and accumulated
    into)."""
    plain, wrapped = _model(), _model()
    base = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    params = list(wrapped.parameters())
    opt = FOSI(params, torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
               warmup=100, model=wrapped)  # fmt: skip
    for step in range(6):
        set_to_none = step % 2 == 0
        for model, optimizer in ((plain, base), (wrapped, opt)):
            optimizer.zero_grad(set_to_none=set_to_none)
            _loss(model, step).backward()
            if step == 3:  # the last bias unused this step: SGD's weight decay still acts
                last = list(model.parameters())[-1]
                last.grad = None if model is wrapped else torch.zeros_like(last)
            optimizer.step()
        for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
            assert torch.equal(a, b), f"differs at step {step}"


def test_several_steps_with_a_spectrum_equal_the_dense_formula() -> None:
    """θ' = θ + s(I − P)d2 + d1 over three steps of heavy-ball SGD (lr η, momentum μ, no
    weight decay), velocity v and the base's momentum buffer b carried in float64 here."""
    model = _model()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    lr, mu, beta, alpha = 0.05, 0.9, 0.9, 0.05
    opt = FOSI(params, torch.optim.SGD(params, lr=lr, momentum=mu), k=2, l=0, alpha=alpha,
               warmup=100, model=model)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(n, 2, generator=gen, dtype=torch.float64))
    V, lam = q.T.contiguous(), torch.tensor([8.0, 2.0], dtype=torch.float64)
    opt.set_spectrum(lam, V)
    P = V.T @ V
    theta, v, b = _flat(params), torch.zeros(n, dtype=torch.float64), None
    scale = min(max(8.0 / 2.0, 1.0), 3.0, max(1.0, 1.0 / (lr / (1 - mu) * 2.0)))
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        g = _flat([p.grad for p in params])
        g1 = P @ g
        v = beta * v + (1 - beta) * g1
        d1 = -alpha * V.T @ ((V @ v) / lam.abs())
        base_grad = g - g1
        b = base_grad if b is None else mu * b + base_grad
        d2 = (torch.eye(n, dtype=torch.float64) - P) @ (-lr * b)
        theta = theta + scale * d2 + d1
        opt.step()
        got = _flat(params)
        torch.testing.assert_close(got, theta, rtol=1e-12, atol=1e-12 * theta.abs().max().item())
