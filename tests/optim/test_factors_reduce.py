"""K-FAC-reduce factors equal curvlinops' ``kfac_approx="reduce"``; Conv1d factors equal the
dense float64 computation; factors from a subsample of the batch equal the dense factors of
the same samples (constants: docs/kfac.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim.layers import KFACApprox, make_layer
from tests.helpers.models import dense_factors, dense_patches, output_grad

REDUCE_CONVS = {
    "plain": dict(in_channels=3, out_channels=4, kernel_size=3),
    "stride_pad": dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
    "dilation": dict(in_channels=2, out_channels=3, kernel_size=3, dilation=(2, 1), padding=1),
    "rect_no_bias": dict(in_channels=3, out_channels=5, kernel_size=(2, 3), bias=False),
}


class _ConvNet(nn.Module):
    def __init__(self, conv_kwargs: dict[str, object]) -> None:
        super().__init__()
        self.conv = nn.Conv2d(**conv_kwargs)  # type: ignore[arg-type]
        self.fc = nn.LazyLinear(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class _SharedLinearNet(nn.Module):
    """A Linear applied to every one of T positions (weight sharing), then a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 6)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.shared(x)).mean(1))


def _compare_with_curvlinops(net: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> None:
    curvlinops = pytest.importorskip("curvlinops")
    y = torch.randint(0, 5, (x.shape[0],))
    net(x)  # materialise lazy layers
    loss_func = nn.CrossEntropyLoss()
    params = [p for p in net.parameters() if p.requires_grad]
    oracle = curvlinops.KFACLinearOperator(
        net,
        loss_func,
        params,
        [(x, y)],
        fisher_type="empirical",
        kfac_approx="reduce",
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    oracle.compute_kronecker_factors()
    pre = KFACPreconditioner(net, kl_clip=None, kfac_approx="reduce")
    net.zero_grad()
    loss_func(net(x), y).backward()
    pre.step()
    state = pre.state_dict()["layers"]
    for name in names:
        torch.testing.assert_close(
            state[name]["A"], oracle._input_covariances[name], rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            state[name]["G"], oracle._gradient_covariances[name], rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("name", list(REDUCE_CONVS))
def test_conv_reduce_factors_match_curvlinops(name: str) -> None:
    torch.manual_seed(0)
    net = _ConvNet(REDUCE_CONVS[name]).double()
    x = torch.randn(6, net.conv.in_channels, 7, 6, dtype=torch.float64)
    _compare_with_curvlinops(net, x, ("conv", "fc"))


def test_shared_linear_reduce_factors_match_curvlinops() -> None:
    torch.manual_seed(0)
    net = _SharedLinearNet().double()
    _compare_with_curvlinops(net, torch.randn(5, 7, 4, dtype=torch.float64), ("shared", "fc"))


def test_reduce_equals_expand_without_weight_sharing() -> None:
    """A 1x1 convolution on a 1x1 image and a 2-D Linear have nothing to reduce."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    grad = output_grad(lin, x)
    expand = make_layer("m", lin)
    reduce = make_layer("m", lin, KFACApprox.REDUCE)
    assert expand is not None and reduce is not None
    torch.testing.assert_close(reduce.a_factor(x, torch.float64), expand.a_factor(x, torch.float64))
    torch.testing.assert_close(
        reduce.g_factor(grad, 1.0, torch.float64), expand.g_factor(grad, 1.0, torch.float64)
    )


CONV1DS = {
    "plain": dict(in_channels=3, out_channels=4, kernel_size=3),
    "stride_pad": dict(in_channels=2, out_channels=5, kernel_size=5, stride=2, padding=2),
    "same_dilated": dict(in_channels=2, out_channels=3, kernel_size=3, padding="same", dilation=2),
    "groups_no_bias": dict(in_channels=4, out_channels=6, kernel_size=3, groups=2, bias=False),
}


def _as_conv2d(conv: nn.Conv1d) -> nn.Conv2d:
    """The same layer as a Conv2d of kernel height 1 (weights shared)."""
    padding: str | tuple[int, int] = (
        conv.padding if isinstance(conv.padding, str) else (0, conv.padding[0])
    )
    twin = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        (1, conv.kernel_size[0]),
        stride=(1, conv.stride[0]),
        padding=padding,
        dilation=(1, conv.dilation[0]),
        groups=conv.groups,
        bias=conv.bias is not None,
    ).double()
    with torch.no_grad():
        twin.weight.copy_(conv.weight.unsqueeze(2))
        if conv.bias is not None:
            assert twin.bias is not None
            twin.bias.copy_(conv.bias)
    return twin


@pytest.mark.parametrize("name", list(CONV1DS))
def test_conv1d_factors_equal_dense(name: str) -> None:
    """Conv1d on (N, C, L) against the dense loops on the (N, C, 1, L) twin, and through the
    preconditioner's first update, to 1e-12."""
    torch.manual_seed(0)
    conv = nn.Conv1d(**CONV1DS[name]).double()  # type: ignore[arg-type]
    x = torch.randn(4, conv.in_channels, 11, dtype=torch.float64)
    twin = _as_conv2d(conv)
    grad = output_grad(conv, x)
    expected_a, expected_g = dense_factors(twin, x.unsqueeze(2), grad.unsqueeze(2))
    layer = make_layer("m", conv)
    assert layer is not None and layer.kind == "Conv1d"
    torch.testing.assert_close(layer.a_factor(x, torch.float64), expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        layer.g_factor(grad, 1.0, torch.float64), expected_g, rtol=1e-12, atol=1e-12
    )
    model = nn.Sequential(conv)
    pre = KFACPreconditioner(model, kl_clip=None, inv_dtype=torch.float64)
    model.zero_grad()
    output_grad(model, x)
    pre.step()
    state = pre.state_dict()["layers"]["0"]
    torch.testing.assert_close(state["A"], expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state["G"], expected_g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["plain", "stride_pad", "same_dilated"])
def test_conv1d_reduce_factors_equal_dense(name: str) -> None:
    """Reduce: A = (1/N) Σ_n ā ā^T with ā the mean patch, G = N Σ_n ĝ ĝ^T with ĝ the gradient
    summed over positions, by dense loops."""
    torch.manual_seed(0)
    conv = nn.Conv1d(**CONV1DS[name]).double()  # type: ignore[arg-type]
    x = torch.randn(4, conv.in_channels, 11, dtype=torch.float64)
    grad = output_grad(conv, x)
    n = x.shape[0]
    mean_patch = dense_patches(x.unsqueeze(2), _as_conv2d(conv)).mean(1)[:, 0]  # (N, n_in)
    rows = torch.cat([mean_patch, torch.ones(n, 1, dtype=torch.float64)], 1)
    expected_a = sum(torch.outer(r, r) for r in rows) / n
    summed = grad.sum(-1)  # (N, C_out)
    expected_g = sum(torch.outer(n * r, n * r) for r in summed) / n
    layer = make_layer("m", conv, KFACApprox.REDUCE)
    assert layer is not None
    torch.testing.assert_close(layer.a_factor(x, torch.float64), expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        layer.g_factor(grad, 1.0, torch.float64), expected_g, rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("approx", list(KFACApprox))
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.7])
def test_subsampled_factors_equal_dense_factors_of_the_same_rows(
    fraction: float, approx: KFACApprox
) -> None:
    """With sample_fraction f, A is the dense A of the first ⌈f·N⌉ samples; G is their dense G
    with per-example gradients N·g of the full batch N: (N/S)² times the dense G of S samples
    (whose helper scales by S)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    x = torch.randn(8, 3, 6, 5, dtype=torch.float64)
    grad = output_grad(conv, x)
    kept = {0.25: 2, 0.5: 4, 0.7: 6}[fraction]
    full = make_layer("m", conv, approx)
    sub = make_layer("m", conv, approx, fraction)
    assert full is not None and sub is not None
    expected_a = full.a_factor(x[:kept], torch.float64)
    expected_g = full.g_factor(grad[:kept], 1.0, torch.float64) * (8 / kept) ** 2
    if approx is KFACApprox.EXPAND:  # the expand layer itself is the dense computation
        dense_a, dense_g = dense_factors(conv, x[:kept], grad[:kept])
        torch.testing.assert_close(expected_a, dense_a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(expected_g, dense_g * (8 / kept) ** 2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sub.a_factor(x, torch.float64), expected_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        sub.g_factor(grad, 1.0, torch.float64), expected_g, rtol=1e-12, atol=1e-12
    )


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="kfac_approx must be one of expand, reduce"):
        KFACPreconditioner(nn.Linear(2, 2), kfac_approx="shrink")
    with pytest.raises(ValueError, match=r"factor_sample_fraction must be a number in \(0, 1\]"):
        KFACPreconditioner(nn.Linear(2, 2), factor_sample_fraction=0.0)
