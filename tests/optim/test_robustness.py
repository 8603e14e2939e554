"""Non-finite steps leave factors untouched; GradScaler works; failing eigh/inv fall back."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim.decompositions import decompose
from kfac_hpc.optim.finite import all_finite
from tests.helpers.models import small_cnn


def _batch(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(6, 1, 8, 8, dtype=dtype), torch.randint(0, 10, (6,))


def _factors(pre: KFACPreconditioner) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (f.A.clone(), f.G.clone()) for n, f in pre.factors.items()}  # type: ignore[union-attr]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _step(pre: KFACPreconditioner, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    pre.step()


@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_leaves_factors_untouched(bad: float, in_hook: bool) -> None:
    model = small_cnn()
    pre = KFACPreconditioner(model, update_factors_in_hook=in_hook)
    _step(pre, model, *_batch(0))
    before = _factors(pre)
    x, y = _batch(1)
    x[2, 0, 3, 3] = bad
    _step(pre, model, x, y)
    _assert_same(_factors(pre), before)
    assert pre.skipped_factor_updates == 1
    _step(pre, model, *_batch(2))  # the next finite step updates again
    assert not torch.equal(pre.factors["0"].A, before["0"][0])


def test_non_finite_gradient_of_unregistered_layer_skips_factor_update() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    pre = KFACPreconditioner(model)
    torch.manual_seed(0)
    model(torch.randn(3, 4)).sum().backward()
    pre.step()
    before = _factors(pre)
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    model[1].weight.grad[0] = float("inf")  # what the scaler would see: it skips this step
    pre.step()
    _assert_same(_factors(pre), before)


def test_grad_scaler_gives_unscaled_factors_and_its_skipped_step_changes_nothing() -> None:
    plain_model, scaled_model = small_cnn(), small_cnn()
    plain = KFACPreconditioner(plain_model, kl_clip=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaled = KFACPreconditioner(scaled_model, kl_clip=None, grad_scaler=scaler)
    opt = torch.optim.SGD(scaled_model.parameters(), lr=0.1)
    x, y = _batch(0)
    _step(plain, plain_model, x, y)
    opt.zero_grad()
    scaler.scale(nn.functional.cross_entropy(scaled_model(x), y)).backward()
    scaler.unscale_(opt)
    scaled.step()
    for name, (a, g) in _factors(plain).items():
        torch.testing.assert_close(scaled.factors[name].A, a)
        torch.testing.assert_close(scaled.factors[name].G, g, rtol=1e-4, atol=1e-7)
    for p, q in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    scaler.step(opt)
    scaler.update()

    before = _factors(scaled)
    params = [p.detach().clone() for p in scaled_model.parameters()]
    scaler.update(3e38)  # the next scaled loss overflows: the scaler will skip the step
    opt.zero_grad()
    scaler.scale(nn.functional.cross_entropy(scaled_model(x), y)).backward()
    scaler.unscale_(opt)
    scaled.step()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 3e38, "the scaler saw the overflow"
    _assert_same(_factors(scaled), before)
    for p, q in zip(params, scaled_model.parameters(), strict=True):
        assert torch.equal(p, q.detach())


def test_failing_eigh_keeps_previous_decomposition_and_warns_once_per_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = small_cnn()
    pre = KFACPreconditioner(model)
    _step(pre, model, *_batch(0))
    previous = {n: [t.clone() for t in held["A"]] for n, held in pre.second_order.items()}

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2):
            _step(pre, model, *_batch(seed))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == len(pre.layers), messages
    assert all("keeping the previous one" in m for m in messages)
    for name, tensors in previous.items():
        for old, new in zip(tensors, pre.second_order[name]["A"], strict=True):
            assert torch.equal(old, new)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_eigh_falls_back_to_float64_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    real = torch.linalg.eigh

    def float32_fails(matrix: torch.Tensor, *args: object, **kwargs: object) -> object:
        if matrix.dtype == torch.float32:
            raise RuntimeError("failed to converge")
        return real(matrix, *args, **kwargs)

    reference, model = small_cnn(), small_cnn()
    expected = KFACPreconditioner(reference)
    _step(expected, reference, *_batch(0))
    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    pre = KFACPreconditioner(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(pre, model, *_batch(0))
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_nan_factor_on_first_decomposition_uses_identity(method: str) -> None:
    """No previous decomposition to keep: the layer's gradient passes (nearly) unchanged."""
    model = nn.Sequential(nn.Linear(3, 2))
    pre = KFACPreconditioner(model, compute_method=method, kl_clip=None, damping=1e-3)
    torch.manual_seed(0)
    model(torch.randn(4, 3)).pow(2).mean().backward()
    grad = pre.layers["0"].grad_matrix().clone()
    pre._capture = False  # keep the poisoned factor below from being replaced by this step's
    pre.factors["0"].A = torch.full((4, 4), float("nan"))
    pre.factors["0"].G = torch.eye(2)
    with pytest.warns(RuntimeWarning, match="factor A of layer 0 failed.*using the identity"):
        pre.step()
    # G = I decomposes fine: eigen 1/(1·1 + λ); inverse (I + λ_G I)⁻¹ with π = 1, λ_G = √λ.
    scale = 1 / (1 + 1e-3) if method == "eigen" else 1 / (1 + 1e-3**0.5)
    torch.testing.assert_close(pre.layers["0"].grad_matrix(), grad * scale)


def test_inplace_activation_after_layer_is_fine() -> None:
    """Hooks on the output tensor see the gradient w.r.t. the conv output, not the ReLU's."""
    a, b = small_cnn(), small_cnn()
    for m in b.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    pa, pb = KFACPreconditioner(a), KFACPreconditioner(b)
    x, y = _batch(0)
    _step(pa, a, x, y)
    _step(pb, b, x, y)
    _assert_same(_factors(pa), _factors(pb))


def test_accumulation_and_hook_modes_agree() -> None:
    """Two micro-batches of 3 (accumulation_steps=2, loss/2) give the factors of their mean;
    computing factors in hooks or in step() is the same."""
    x, y = _batch(0)
    factors = []
    for in_hook in (True, False):
        model = small_cnn()
        pre = KFACPreconditioner(model, accumulation_steps=2, update_factors_in_hook=in_hook)
        for part in (slice(0, 3), slice(3, 6)):
            (nn.functional.cross_entropy(model(x[part]), y[part]) / 2).backward()
        pre.step()
        factors.append(_factors(pre))
    _assert_same(factors[0], factors[1])
    halves = []
    for part in (slice(0, 3), slice(3, 6)):
        model = small_cnn()
        pre = KFACPreconditioner(model)
        _step(pre, model, x[part], y[part])
        halves.append(_factors(pre))
    for name, (a, g) in factors[0].items():
        torch.testing.assert_close(a, (halves[0][name][0] + halves[1][name][0]) / 2)
        torch.testing.assert_close(g, (halves[0][name][1] + halves[1][name][1]) / 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_finite_is_exact_when_a_finite_sum_overflows(dtype: torch.dtype) -> None:
    """A sum that overflows on finite elements must not be taken for an inf element."""
    overflowing = torch.full((8,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert bool(torch.isinf(overflowing.sum()))
    assert all_finite([overflowing]) and all_finite([torch.ones(3, dtype=dtype), overflowing])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_all_finite_finds_every_inf_and_nan(dtype: torch.dtype) -> None:
    assert all_finite([]) and all_finite([torch.ones(2, 3, dtype=dtype)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for position in (0, 5):
            t = torch.ones(2, 3, dtype=dtype)
            t.view(-1)[position] = bad
            assert not all_finite([torch.zeros(4, dtype=dtype), t])
    opposite = torch.tensor([float("inf"), -float("inf")], dtype=dtype)  # sums to NaN
    assert not all_finite([opposite])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["both", "upper", "lower"])
def test_decompose_returns_none_for_a_non_finite_factor_without_raising(
    bad: float, where: str
) -> None:
    """Wherever the non-finite entry is: eigh reads one triangle only and may return a finite
    result for a matrix with NaN in the other (a loaded factor is not checked on load)."""
    matrix = torch.eye(3)
    if where in ("both", "upper"):
        matrix[0, 2] = bad
    if where in ("both", "lower"):
        matrix[2, 0] = bad
    assert decompose(matrix, torch.float32) is None
    result = decompose(torch.diag(torch.tensor([3.0, 1.0, 2.0])), torch.float32)
    assert result is not None
    torch.testing.assert_close(result.d, torch.tensor([1.0, 2.0, 3.0]))
