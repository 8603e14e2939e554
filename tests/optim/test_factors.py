"""A and G equal a dense float64 computation and curvlinops' KFAC (constant 1: docs/kfac.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim.layers import KFACApprox, make_layer
from tests.conftest import require_module
from tests.helpers.models import dense_factors, output_grad, profiled_gemm_flops

CONVS = {
    "plain": dict(in_channels=3, out_channels=4, kernel_size=3),
    "stride_pad": dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
    "tuple_pad": dict(in_channels=2, out_channels=3, kernel_size=(3, 2), padding=(2, 1)),
    "same_even": dict(in_channels=2, out_channels=3, kernel_size=(4, 2), padding="same"),
    "same_dilated": dict(in_channels=2, out_channels=3, kernel_size=3, padding="same", dilation=2),
    "valid": dict(in_channels=2, out_channels=3, kernel_size=2, padding="valid", stride=(1, 2)),
    "dilation": dict(in_channels=2, out_channels=3, kernel_size=3, dilation=(2, 1), padding=1),
    "groups": dict(in_channels=4, out_channels=6, kernel_size=3, groups=2, padding=1),
    "depthwise": dict(in_channels=3, out_channels=3, kernel_size=3, groups=3),
    "reflect": dict(
        in_channels=2, out_channels=3, kernel_size=3, padding=1, padding_mode="reflect"
    ),
    "no_bias": dict(in_channels=3, out_channels=4, kernel_size=3, bias=False, stride=2),
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 4), (3, 2, 4)], ids=["2d", "leading-dims"])
def test_linear_factors_equal_dense(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=bias).double()
    x = torch.randn(*shape, dtype=torch.float64)
    _check_layer(layer, x)


@pytest.mark.parametrize("batch", [1, 3], ids=["batch1", "batch3"])
@pytest.mark.parametrize("name", list(CONVS))
def test_conv_factors_equal_dense(name: str, batch: int) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(**CONVS[name]).double()
    x = torch.randn(batch, conv.in_channels, 7, 6, dtype=torch.float64)
    _check_layer(conv, x)


def test_wide_conv_factors_use_column_blocks_and_equal_dense() -> None:
    """145 im2col columns (with bias): the blocked upper-triangle Gram path, batch 1 and 5."""
    torch.manual_seed(0)
    for batch in (1, 5):
        conv = nn.Conv2d(16, 4, 3, padding=1).double()
        _check_layer(conv, torch.randn(batch, 16, 6, 5, dtype=torch.float64))


@pytest.mark.parametrize("name", ["plain", "stride_pad", "groups", "no_bias"])
def test_unbatched_conv_factors_equal_dense(name: str) -> None:
    """A (C, H, W) input is one sample: the factors of the batch of that one sample (G is not
    C_out times larger), through the layer helpers and the preconditioner's hooks."""
    torch.manual_seed(0)
    conv = nn.Conv2d(**CONVS[name]).double()
    x = torch.randn(conv.in_channels, 7, 6, dtype=torch.float64)

    def grad_of_output(module: nn.Module) -> torch.Tensor:
        out = module(x)
        out.retain_grad()
        ((out - 1.0) ** 2).sum().backward()  # the mean over a batch of one sample
        assert out.grad is not None
        return out.grad

    grad = grad_of_output(conv)
    expected_a, expected_g = dense_factors(conv, x[None], grad[None])
    layer = make_layer("m", conv)
    assert layer is not None
    torch.testing.assert_close(layer.a_factor(x, torch.float64), expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        layer.g_factor(grad, 1.0, torch.float64), expected_g, rtol=1e-12, atol=1e-12
    )
    model = nn.Sequential(conv)
    pre = KFACPreconditioner(model, kl_clip=None, inv_dtype=torch.float64)
    model.zero_grad()
    grad_of_output(model)
    pre.step()
    state = pre.state_dict()["layers"]["0"]
    torch.testing.assert_close(state["A"], expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["G"], expected_g, rtol=1e-12, atol=1e-12)


def _check_layer(module: nn.Module, x: torch.Tensor) -> None:
    """Both the layer helpers and the preconditioner's first update (which starts from the
    batch statistics) give the dense factors, to 1e-12."""
    expected_a, expected_g = dense_factors(module, x, output_grad(module, x))
    layer = make_layer("m", module)
    assert layer is not None
    torch.testing.assert_close(layer.a_factor(x, torch.float64), expected_a, rtol=1e-12, atol=1e-12)
    grad = output_grad(module, x)
    torch.testing.assert_close(
        layer.g_factor(grad, 1.0, torch.float64), expected_g, rtol=1e-12, atol=1e-12
    )
    model = nn.Sequential(module)
    pre = KFACPreconditioner(model, kl_clip=None, inv_dtype=torch.float64)
    model.zero_grad()
    output_grad(model, x)
    pre.step()
    state = pre.state_dict()["layers"]["0"]
    torch.testing.assert_close(state["A"], expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["G"], expected_g, rtol=1e-12, atol=1e-12)


class _Net(nn.Module):
    def __init__(self, conv_kwargs: dict[str, object]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(**conv_kwargs)  # type: ignore[arg-type]
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.LazyLinear(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.conv(x)).flatten(1))


# curvlinops refuses unequal 'same' padding and shares one factor over groups: those cases are
# checked against the dense computation above only.
@pytest.mark.parametrize("name", ["plain", "stride_pad", "same_dilated", "dilation", "no_bias"])
def test_factors_match_curvlinops_kfac(name: str) -> None:
    """curvlinops' KFAC (expand, empirical Fisher, mean CE loss, bias folded in) has exactly our
    A and G: A = mean over rows of a aᵀ, G = N Σ_rows g gᵀ for the batch-mean loss."""
    curvlinops = require_module("curvlinops")
    torch.manual_seed(0)
    net = _Net(CONVS[name]).double()
    x = torch.randn(6, net.conv.in_channels, 7, 6, dtype=torch.float64)
    y = torch.randint(0, 5, (6,))
    net(x)  # materialise the lazy layer
    loss_func = nn.CrossEntropyLoss()
    params = [p for p in net.parameters() if p.requires_grad]
    oracle = curvlinops.KFACLinearOperator(
        net,
        loss_func,
        params,
        [(x, y)],
        fisher_type="empirical",
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    oracle.compute_kronecker_factors()

    pre = KFACPreconditioner(net, kl_clip=None)
    net.zero_grad()
    loss_func(net(x), y).backward()
    pre.step()
    state = pre.state_dict()["layers"]
    for module_name in ("conv", "fc"):
        ours_a, ours_g = state[module_name]["A"], state[module_name]["G"]
        torch.testing.assert_close(
            ours_a, oracle._input_covariances[module_name], rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            ours_g, oracle._gradient_covariances[module_name], rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("name", ["stride_pad", "groups", "same_even"])
def test_conv_factors_chunked_over_the_batch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPUs the batch is processed in cache-sized chunks: one sample per chunk here."""
    import kfac_hpc.optim.layers as layers

    monkeypatch.setattr(layers, "_CPU_CHUNK_BYTES", 1)
    torch.manual_seed(0)
    conv = nn.Conv2d(**CONVS[name]).double()
    _check_layer(conv, torch.randn(4, conv.in_channels, 7, 6, dtype=torch.float64))


@pytest.mark.parametrize("approx", list(KFACApprox))
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize(
    "module",
    [
        *(nn.Conv2d(**kwargs) for kwargs in CONVS.values()),
        nn.Conv2d(20, 8, 3, padding=1),  # the blocked triangle of a wider im2col matrix
        nn.Conv1d(3, 4, 5, padding=2),
        nn.Linear(150, 70),
    ],
    ids=[*CONVS, "wide", "conv1d", "linear"],
)
def test_factor_flops_are_the_flops_of_the_gemms_that_run(
    module: nn.Module, chunked: bool, approx: KFACApprox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the cost model charges a factor update is what the factor code executes, counted
    from the GEMM shapes the profiler records (batch 3, in cache chunks of one sample too)."""
    import kfac_hpc.optim.layers as layers

    if chunked:
        monkeypatch.setattr(layers, "_CPU_CHUNK_BYTES", 1)
    layer = make_layer("m", module, approx)
    assert layer is not None
    sample = (module.in_features,) if isinstance(module, nn.Linear) else (module.in_channels, 7, 6)
    if isinstance(module, nn.Conv1d):
        sample = (module.in_channels, 9)
    x = torch.randn(3, *sample)
    grad = torch.randn_like(module(x))
    executed = profiled_gemm_flops(
        lambda: (layer.a_factor(x, torch.float32), layer.g_factor(grad, 1.0, torch.float32))
    )
    assert executed > 0
    assert 3 * layer.factor_flops(sample) == executed
