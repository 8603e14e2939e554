"""The row-shifted A of a convolution equals Σ patch patchᵀ from torch's own im2col
(F.unfold), in float64, for every geometry it serves, chunk sizes included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_hpc.optim import layers
from kfac_hpc.optim.conv_rows import RowGeometry, row_shift_moments

# (channels, groups, kernel, dilation, width stride, (left, right, top, bottom), height, width)
GEOMETRIES = {
    "same_3x3": (3, 1, (3, 3), (1, 1), 1, (1, 1, 1, 1), 6, 5),
    "valid_3x3": (2, 1, (3, 3), (1, 1), 1, (0, 0, 0, 0), 7, 6),
    "full_3x2": (2, 1, (3, 2), (1, 1), 1, (1, 1, 2, 2), 5, 4),
    "same_even_4x2": (2, 1, (4, 2), (1, 1), 1, (0, 1, 1, 2), 6, 5),
    "dilated_rows": (2, 1, (3, 3), (2, 1), 1, (1, 1, 2, 2), 7, 6),
    "dilated_cols": (2, 1, (2, 3), (1, 2), 1, (2, 2, 0, 1), 5, 7),
    "width_stride_2": (3, 1, (3, 3), (1, 1), 2, (1, 1, 1, 1), 6, 7),
    "5x1": (2, 1, (5, 1), (1, 1), 1, (0, 0, 2, 2), 6, 3),
    "groups_2": (2, 2, (3, 3), (1, 1), 1, (1, 1, 1, 1), 5, 5),
    "depthwise": (1, 3, (3, 3), (1, 1), 1, (0, 0, 0, 0), 5, 6),
    "tall_kernel": (2, 1, (5, 3), (1, 1), 1, (1, 1, 0, 0), 5, 4),
}


def _dense(x: torch.Tensor, g: RowGeometry) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Σ a aᵀ and Σ a per group over the patches F.unfold extracts."""
    covs, cols = [], []
    for group in x.split(g.channels, 1):
        patches = F.unfold(
            F.pad(group, g.pad), g.kernel, dilation=g.dilation, stride=(1, g.width_stride)
        )  # (n, C·kh·kw, locations)
        rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
        covs.append(rows.T @ rows)
        cols.append(rows.sum(0))
    count = x.shape[0] * patches.shape[-1]
    return torch.stack(covs), torch.stack(cols), count


@pytest.mark.parametrize("chunk_samples", [1, 2, 5], ids=["chunk1", "chunk2", "whole"])
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_row_shift_moments_equal_unfold(name: str, chunk_samples: int) -> None:
    """Batch 5 in chunks of 1, 2 (a shorter last chunk) and 5 samples."""
    channels, groups, kernel, dilation, sw, pad, h, w = GEOMETRIES[name]
    geometry = RowGeometry(channels, groups, kernel, dilation, sw, pad, h, w)
    torch.manual_seed(0)
    x = torch.randn(5, channels * groups, h, w, dtype=torch.float64)
    chunk_bytes = chunk_samples * geometry.sample_elements() * x.element_size()
    cov, col, count = row_shift_moments(x, geometry, True, chunk_bytes)
    expected_cov, expected_col, expected_count = _dense(x, geometry)
    assert count == expected_count
    torch.testing.assert_close(cov, expected_cov, rtol=1e-12, atol=1e-11)
    assert col is not None
    torch.testing.assert_close(col, expected_col, rtol=1e-12, atol=1e-11)
    assert row_shift_moments(x, geometry, False, chunk_bytes)[1] is None


def test_products_subtract_only_rows_inside_the_image() -> None:
    """'same' 3×3 with one padding row each side: one full product per lag and exactly two
    cut rows (the last image row for kernel row 0, the first for kernel row 2, at lag 0)."""
    geometry = RowGeometry(4, 1, (3, 3), (1, 1), 1, (1, 1, 1, 1), 8, 8)
    assert list(geometry.products()) == [
        (0, -1, 0, 10),
        (0, 0, 8, 9),
        (0, 2, 1, 2),
        (1, -1, 0, 9),
        (2, -1, 0, 8),
    ]


@pytest.mark.parametrize(
    ("kwargs", "row_shifted"),
    [
        (dict(kernel_size=3, padding=1), True),
        (dict(kernel_size=3, padding=1, stride=(1, 2)), True),
        (dict(kernel_size=3, padding=1, stride=2), False),
        (dict(kernel_size=1), False),
    ],
    ids=["stride1", "width_stride2", "stride2", "1x1"],
)
def test_conv_layers_use_row_shift_for_unit_height_stride(
    kwargs: dict[str, object], row_shifted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unit height stride and a kernel taller than one row take the row-shifted product;
    the rest keep im2col. Both give the same A."""
    calls: list[RowGeometry] = []

    def spy(*args: object) -> object:
        calls.append(args[1])  # type: ignore[arg-type]
        return row_shift_moments(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(layers, "row_shift_moments", spy)
    conv = nn.Conv2d(3, 4, **kwargs).double()  # type: ignore[arg-type]
    layer = layers.make_layer("conv", conv)
    assert layer is not None
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    a = layer.a_factor(x, torch.float64)
    assert bool(calls) == row_shifted
    patches = F.unfold(x, conv.kernel_size, padding=conv.padding, stride=conv.stride)
    rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
    rows = torch.cat([rows, torch.ones(len(rows), 1, dtype=rows.dtype)], 1)  # bias column
    torch.testing.assert_close(a, rows.T @ rows / len(rows), rtol=1e-12, atol=1e-12)


def test_an_empty_batch_counts_no_patches() -> None:
    """No samples: no chunk, no division by zero; the count is 0 (A = Σ/0 is then non-finite,
    and the preconditioner's finiteness check skips the update)."""
    geometry = RowGeometry(*GEOMETRIES["same_3x3"])
    x = torch.empty(0, geometry.channels, geometry.height, geometry.width, dtype=torch.float64)
    cov, col, count = row_shift_moments(x, geometry, True, 1 << 20)
    assert count == 0 and cov.shape == (1, 27, 27) and col is not None and col.shape == (1, 27)
