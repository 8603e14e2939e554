"""One class per supported module type: how its inputs and output gradients become K-FAC
statistics, and how its gradient is viewed as the matrix that K-FAC preconditions.

Shapes (per group; ``groups`` > 1 only for grouped/depthwise Conv2d, whose Fisher block is
block-diagonal over the groups, so each group gets its own factors):

- A: (n_A, n_A) with n_A = inputs per group (+1 for the bias), or (groups, n_A, n_A);
- G: (n_G, n_G) with n_G = outputs per group, or (groups, n_G, n_G);
- gradient matrix: (n_G, n_A) or (groups, n_G, n_A); the bias is the last column.

Scaling convention (docs/kfac.md): with M rows (all leading dimensions, and for Conv2d all
output locations) and N = the size of dimension 0 (the batch),

    A = (1/M) Σ_rows a aᵀ,   G = (1/N) Σ_rows (c·g)(c·g)ᵀ,

where g is the gradient of the loss w.r.t. the layer output and c = N · accumulation_steps /
grad_scale turns the gradient of a batch-mean loss into per-example gradients. For a Linear
layer on (N, in) inputs, G ⊗ A is then exactly K-FAC's approximation of the empirical Fisher
(1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ.

K-FAC-reduce (Eschenhagen et al. 2023, ``KFACApprox.REDUCE``) makes each sample one row: its
inputs (patches) averaged and its output gradients summed over the weight-sharing dimensions
(the output locations of a convolution, the middle dimensions of a Linear), so M = N; this is
curvlinops' ``kfac_approx="reduce"``. With ``sample_fraction`` f < 1 the statistics use only
the first ⌈f·N⌉ samples of the (shuffled) batch: A and G are then the same formulas over those
samples, c still using the full N.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_hpc.contracts.choices import KFACApprox  # defined once, with the job's choices
from kfac_hpc.optim.conv_rows import RowGeometry, inside, row_shift_moments

__all__ = ["Conv1dLayer", "Conv2dLayer", "KFACApprox", "KFACLayer", "LinearLayer", "make_layer"]


class KFACLayer:
    """A registered module: its factor statistics and its gradient as a matrix."""

    kind = "layer"

    def __init__(self, name: str, module: nn.Module, groups: int, n_a: int, n_g: int) -> None:
        self.name = name
        self.module = module
        self.groups = groups
        self.n_a = n_a
        self.n_g = n_g
        self.approx = KFACApprox.EXPAND
        self.sample_fraction = 1.0

    @property
    def weight(self) -> Tensor:
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight

    @property
    def bias(self) -> Tensor | None:
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, Tensor) else None

    @property
    def factor_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of A and G."""
        lead = (self.groups,) if self.groups > 1 else ()
        return (*lead, self.n_a, self.n_a), (*lead, self.n_g, self.n_g)

    def as_batch(self, t: Tensor) -> Tensor:
        """The module input or output gradient with its batch as dimension 0."""
        return t

    def a_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None, int]:
        """Σ a aᵀ (groups, n_in, n_in), Σ a (groups, n_in) (None for a layer without bias) and
        the row count M, without the bias column, from the batched module input ``x``."""
        raise NotImplementedError

    def g_moments(self, g: Tensor) -> Tensor:
        """Σ g gᵀ over the rows, (groups, n_G, n_G), from the batched output gradient ``g``."""
        raise NotImplementedError

    def factor_flops(self, sample_shape: tuple[int, ...]) -> int:
        """FLOPs of the GEMMs that ``a_factor`` and ``g_factor`` run per sample whose module
        input has shape ``sample_shape`` (no batch dimension): what a factor update costs."""
        raise NotImplementedError

    def _sampled(self, t: Tensor) -> Tensor:
        """The first ⌈f·N⌉ samples of a batched tensor (a view: no copy)."""
        if self.sample_fraction >= 1.0:
            return t
        return t[: max(1, math.ceil(self.sample_fraction * t.shape[0]))]

    def a_factor(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """A of one batch from the module input ``x``, shape ``factor_shapes[0]``."""
        cov, col, m = self.a_moments(self._sampled(self.as_batch(x.detach())).to(dtype))
        if col is not None:
            # Bias folded in as a column of ones, without copying the rows to append it.
            full = cov.new_empty(self.groups, self.n_a, self.n_a)
            full[:, :-1, :-1] = cov
            full[:, :-1, -1] = col
            full[:, -1, :-1] = col
            full[:, -1, -1] = float(m)
            cov = full
        cov.div_(m)
        return cov if self.groups > 1 else cov[0]

    def g_factor(self, g: Tensor, grad_multiplier: float, dtype: torch.dtype) -> Tensor:
        """G of one batch from the output gradient ``g`` (see the module docstring)."""
        g = self.as_batch(g.detach())
        batch = g.shape[0]
        sampled = self._sampled(g)
        # (1/N) Σ (N·c g)(N·c g)ᵀ = N c² Σ g gᵀ; over S < N samples (1/S) Σ (N·c g)(N·c g)ᵀ
        scale = grad_multiplier * grad_multiplier * batch
        if len(sampled) < batch:
            scale *= batch / len(sampled)
        cov = self.g_moments(sampled.to(dtype)) * scale
        return cov if self.groups > 1 else cov[0]

    def grad_matrix(self) -> Tensor:
        """The gradient as (groups?, n_G, n_A) with the bias as the last column."""
        w = self.weight.grad
        assert w is not None, f"{self.name}: no gradient"
        mat = w.reshape(self.groups, self.n_g, -1)
        bias = self.bias
        if bias is not None:
            assert bias.grad is not None, f"{self.name}: no bias gradient"
            mat = torch.cat([mat, bias.grad.reshape(self.groups, self.n_g, 1)], -1)
        return mat if self.groups > 1 else mat[0]

    def set_grad(self, matrix: Tensor) -> None:
        """Write a matrix shaped like ``grad_matrix()`` back into the parameter gradients."""
        mat = matrix.reshape(self.groups, self.n_g, self.n_a)
        w = self.weight.grad
        assert w is not None
        n_w = self.n_a - (1 if self.bias is not None else 0)
        w.copy_(mat[..., :n_w].reshape(w.shape))
        bias = self.bias
        if bias is not None and bias.grad is not None:
            bias.grad.copy_(mat[..., n_w].reshape(bias.grad.shape))

    def parameters(self) -> list[Tensor]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def describe(self) -> str:
        group = f", groups={self.groups}" if self.groups > 1 else ""
        return f"{self.name} ({self.kind}, A {self.n_a}, G {self.n_g}{group})"


class LinearLayer(KFACLayer):
    """``nn.Linear`` with any number of leading dimensions (all of them count as rows)."""

    kind = "Linear"

    def __init__(self, name: str, module: nn.Linear) -> None:
        n_a = module.in_features + (1 if module.bias is not None else 0)
        super().__init__(name, module, 1, n_a, module.out_features)

    def as_batch(self, t: Tensor) -> Tensor:
        return t.unsqueeze(0) if t.dim() == 1 else t

    def _shared(self, t: Tensor) -> bool:
        return self.approx is KFACApprox.REDUCE and t.dim() > 2

    def a_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None, int]:
        rows = x.flatten(1, -2).mean(1) if self._shared(x) else x.reshape(-1, x.shape[-1])
        col = rows.sum(0).unsqueeze(0) if self.bias is not None else None
        return _gram(rows.mT.unsqueeze(0)), col, rows.shape[0]

    def g_moments(self, g: Tensor) -> Tensor:
        rows = g.flatten(1, -2).sum(1) if self._shared(g) else g.reshape(-1, g.shape[-1])
        return _gram(rows.mT.unsqueeze(0))

    def factor_flops(self, sample_shape: tuple[int, ...]) -> int:
        shared = self.approx is KFACApprox.REDUCE and len(sample_shape) > 1
        rows = 1 if shared else math.prod(sample_shape[:-1])
        return rows * (_gram_flops(sample_shape[-1]) + _gram_flops(self.n_g))


class Conv2dLayer(KFACLayer):
    """``nn.Conv2d``: im2col patches as A's rows, every output location as a row of G. With
    unit height stride and a kernel taller than one row, A comes from row-shifted products of
    the width-unfolded input instead (:mod:`kfac_hpc.optim.conv_rows`): the same matrix,
    without the im2col copy and with fewer FLOPs.

    Handles stride, dilation, integer/tuple/'same'/'valid' padding, every padding mode and
    groups (per-group factors: depthwise layers get ``groups`` tiny factors). Under K-FAC-reduce
    a sample's rows are its patches averaged (A) and its output gradients summed (G) over the
    output locations, so each sample is one row.
    """

    kind = "Conv2d"

    def __init__(self, name: str, module: nn.Conv2d | nn.Conv1d) -> None:
        self.kernel, self.stride, self.dilation = (
            self._pair(v) for v in (module.kernel_size, module.stride, module.dilation)
        )
        n_in = module.in_channels // module.groups * self.kernel[0] * self.kernel[1]
        n_a = n_in + (1 if module.bias is not None else 0)
        super().__init__(name, module, module.groups, n_a, module.out_channels // module.groups)
        self.padding_mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        self._pad = self._explicit_padding(module.padding)

    @staticmethod
    def _pair(value: tuple[int, ...]) -> tuple[int, int]:
        return (value[0], value[1])

    def _explicit_padding(self, padding: str | tuple[int, ...]) -> tuple[int, int, int, int]:
        """(left, right, top, bottom) as ``F.pad`` takes them."""
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding == "same":
            pads: list[int] = []
            for k, d in zip(reversed(self.kernel), reversed(self.dilation), strict=True):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return (pads[0], pads[1], pads[2], pads[3])
        ph, pw = (int(p) for p in padding)
        return (pw, pw, ph, ph)

    def as_batch(self, t: Tensor) -> Tensor:
        return t.unsqueeze(0) if t.dim() == 3 else t

    def a_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None, int]:
        n_in = self.n_a - (1 if self.bias is not None else 0)
        with_sum = self.bias is not None
        if self.approx is KFACApprox.REDUCE:
            return _moments(x, self._patch_means, (self.groups, n_in, 1), with_sum)
        x, pad = self._padded(x)
        if self._row_shifted():
            return row_shift_moments(x, self._rows(x, pad), with_sum, _CPU_CHUNK_BYTES)
        p, q = self._out_size(x, pad)
        columns = functools.partial(self._patch_matrix, pad=pad)
        return _moments(x, columns, (self.groups, n_in, p * q), with_sum)

    def factor_flops(self, sample_shape: tuple[int, ...]) -> int:
        n_in = self.n_a - (1 if self.bias is not None else 0)
        if self.approx is KFACApprox.REDUCE:  # one row per sample
            return self.groups * (_gram_flops(n_in) + _gram_flops(self.n_g))
        x, pad = self._padded(self.as_batch(torch.empty((1, *sample_shape), device="meta")))
        p, q = self._out_size(x, pad)
        g_flops = 2 * self.groups * self.n_g**2 * p * q  # one full Gram per sample
        if self._row_shifted():
            return self._rows(x, pad).gemm_flops_per_sample() + g_flops
        return self.groups * _gram_flops(n_in, p * q) + g_flops

    def _padded(self, x: Tensor) -> tuple[Tensor, tuple[int, int, int, int]]:
        """x and the zero padding its taps see: other padding modes pad x once up front."""
        if self.padding_mode != "constant" and any(self._pad):
            return F.pad(x, self._pad, mode=self.padding_mode), (0, 0, 0, 0)
        return x, self._pad

    def _row_shifted(self) -> bool:
        """Whether A comes from row-shifted products (unit height stride, kernel height > 1)."""
        return self.stride[0] == 1 and self.kernel[0] > 1

    def _rows(self, x: Tensor, pad: tuple[int, int, int, int]) -> RowGeometry:
        """The row-shifted product's geometry for the input x (n, C, H, W)."""
        channels = x.shape[1] // self.groups
        return RowGeometry(
            channels, self.groups, self.kernel, self.dilation, self.stride[1], pad, *x.shape[2:]
        )

    def _out_size(self, x: Tensor, pad: tuple[int, int, int, int]) -> tuple[int, int]:
        """Output height and width of the input x (n, C, H, W) padded by ``pad``."""
        (kh, kw), (dh, dw), (sh, sw) = self.kernel, self.dilation, self.stride
        h, w = x.shape[2] + pad[2] + pad[3], x.shape[3] + pad[0] + pad[1]
        return (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1

    def _taps(
        self, x: Tensor, pad: tuple[int, int, int, int]
    ) -> Iterator[tuple[int, int, slice, slice, Tensor]]:
        """For every kernel tap (i, j) whose window meets the unpadded input x (n, C, H, W)
        under zero padding ``pad``: the output rows and columns it meets and that window,
        (n, C, rows, columns). The other output positions of the tap read padding."""
        p, q = self._out_size(x, pad)
        (kh, kw), (dh, dw), (sh, sw) = self.kernel, self.dilation, self.stride
        for i in range(kh):
            rows, top = inside(p, x.shape[2], i * dh - pad[2], sh)
            for j in range(kw):
                cols, left = inside(q, x.shape[3], j * dw - pad[0], sw)
                if rows.stop > rows.start and cols.stop > cols.start:
                    window = x[:, :, top::sh, left::sw]
                    size = (rows.stop - rows.start, cols.stop - cols.start)
                    yield i, j, rows, cols, window[:, :, : size[0], : size[1]]

    def _patch_matrix(self, x: Tensor, out: Tensor, pad: tuple[int, int, int, int]) -> Tensor:
        """im2col of the input chunk x (n, C, H, W) zero-padded by ``pad``, written into the
        zero-initialised ``out`` (groups, C/groups·kh·kw, ≥ n·P·Q) and returned as its first
        n·P·Q columns, rows ordered like ``weight.view(out, -1)``. One strided copy per kernel
        tap of only the positions inside the input: the padding entries of ``out`` are never
        written, so they stay zero from chunk to chunk and the input is never padded."""
        n, c = x.shape[:2]
        p, q = self._out_size(x, pad)
        grid = out.view(c, *self.kernel, -1, p, q)
        for i, j, rows, cols, window in self._taps(x, pad):
            grid[:, i, j, :n, rows, cols].copy_(window.permute(1, 0, 2, 3))
        return out[..., : n * p * q]

    def _patch_means(self, x: Tensor, out: Tensor) -> Tensor:
        """The patches of the input chunk x (n, C, H, W), padded, averaged over the output
        locations, written into ``out`` (groups, C/groups·kh·kw, ≥ n) and returned as its
        first n columns: one window sum per kernel tap, no im2col copy."""
        if any(self._pad):  # chunk by chunk: the padded chunk stays in cache
            x = F.pad(x, self._pad, mode=self.padding_mode)
        n, c = x.shape[:2]
        p, q = self._out_size(x, (0, 0, 0, 0))
        sums = out.view(c, *self.kernel, -1)
        for i, j, _, _, window in self._taps(x, (0, 0, 0, 0)):
            sums[:, i, j, :n].copy_(window.sum((2, 3)).T)
        return out[..., :n].div_(p * q)

    def g_moments(self, g: Tensor) -> Tensor:
        if self.approx is KFACApprox.REDUCE:
            sums = g.sum((2, 3)).reshape(g.shape[0], self.groups, self.n_g)
            return _gram(sums.permute(1, 2, 0))
        # Σ over samples of each sample's (C/groups × H·W) Gram: batched GEMMs on the gradient
        # as it lies, no copy into a rows matrix; chunks bound the per-sample products.
        per_sample = g.reshape(g.shape[0] * self.groups, self.n_g, -1)
        budget = _CUDA_CHUNK_BYTES if g.is_cuda else _CPU_CHUNK_BYTES
        sample_bytes = self.groups * self.n_g * self.n_g * g.element_size()
        samples = max(1, budget // sample_bytes)
        cov = g.new_zeros(self.groups, self.n_g, self.n_g)
        for part in per_sample.split(samples * self.groups):
            cov += torch.bmm(part, part.mT).unflatten(0, (-1, self.groups)).sum(0)
        return cov


class Conv1dLayer(Conv2dLayer):
    """``nn.Conv1d`` as a Conv2d of height 1: inputs (N, C, L) are viewed as (N, C, 1, L)."""

    kind = "Conv1d"

    @staticmethod
    def _pair(value: tuple[int, ...]) -> tuple[int, int]:
        return (1, value[0]) if len(value) == 1 else (value[0], value[1])

    def _explicit_padding(self, padding: str | tuple[int, ...]) -> tuple[int, int, int, int]:
        if isinstance(padding, str):
            return super()._explicit_padding(padding)
        return super()._explicit_padding((0, int(padding[0])))

    def as_batch(self, t: Tensor) -> Tensor:
        return (t.unsqueeze(0) if t.dim() == 2 else t).unsqueeze(2)


# On CPUs the batch is processed in chunks whose im2col or width-unfolded matrix is at most this
# large: one reused buffer per factor. Measured on ResNet-32 b64, 2 threads, the whole im2col
# factor pass: 2 MiB 317 ms, 4 MiB 281, 16 MiB 265, 32 MiB 283. The buffer is K-FAC memory on
# every rank, and under MEM-OPT the largest part left, so 4 MiB keeps the rank's peak low. With
# the row-shifted A (im2col only for strided convolutions) the pass reads, medians of 3 × 5:
# 1 MiB 153 ms, 2 MiB 145, 4 MiB 147, 8 MiB 151, 16 MiB 158; at 2 MiB the MEM-OPT/COMM-OPT
# peak of bench_kfac_memory.py read 0.300 and 0.308 against 0.294 and 0.298 at 4 MiB.
_CPU_CHUNK_BYTES = 4 << 20
# On GPUs, the most memory a convolution's G may hold in per-sample products at once.
_CUDA_CHUNK_BYTES = 64 << 20


def _block_edges(d: int) -> list[int]:
    """Column block boundaries for :func:`_gram_into`: up to 6 blocks of at least 64 columns
    (big enough for efficient GEMMs); one block below 128 columns."""
    blocks = 1 if d < 128 else min(6, -(-d // 64))
    return [d * i // blocks for i in range(blocks + 1)]


def _gram_flops(d: int, columns: int = 1) -> int:
    """FLOPs of :func:`_gram_into` on a (d × columns) matrix."""
    return sum(
        2 * end * (end - start) * columns for start, end in itertools.pairwise(_block_edges(d))
    )


def _gram_into(cov: Tensor, mat: Tensor, edges: list[int]) -> None:
    """cov += mat matᵀ for mat (groups, d, K), upper block triangle only: block column j gets
    rows [0, end_j) from one GEMM, so ``len(edges) - 1`` blocks cost (blocks+1)/(2·blocks) of
    the full product. :func:`_mirror` fills the lower triangle once at the end."""
    for start, end in itertools.pairwise(edges):
        cov[:, :end, start:end].baddbmm_(mat[:, :end], mat[:, start:end].mT)


def _mirror(cov: Tensor, edges: list[int]) -> None:
    """Copy the upper off-diagonal blocks of ``cov`` to the lower ones (exactly symmetric)."""
    for start, end in itertools.pairwise(edges[1:]):
        cov[:, start:end, :start] = cov[:, :start, start:end].mT


def _gram(mat: Tensor) -> Tensor:
    """mat matᵀ (groups, d, d) for mat (groups, d, K), computing only the upper blocks."""
    edges = _block_edges(mat.shape[1])
    cov = torch.zeros(mat.shape[0], mat.shape[1], mat.shape[1], dtype=mat.dtype, device=mat.device)
    _gram_into(cov, mat, edges)
    _mirror(cov, edges)
    return cov


def _moments(
    data: Tensor,
    columns: Callable[[Tensor, Tensor], Tensor],
    shape: tuple[int, int, int],
    with_sum: bool,
) -> tuple[Tensor, Tensor | None, int]:
    """Σ v vᵀ (groups, d, d), Σ v (groups, d) if ``with_sum`` and the count over the columns v
    of the batch ``data``, batch chunk by batch chunk (one chunk on GPUs). ``shape`` is
    (groups, d, columns per sample); ``columns(chunk, buffer)`` writes a chunk's columns into
    ``buffer`` (groups, d, ≥ chunk·columns per sample) and returns them. The buffer is
    allocated once, zero-filled, and reused by every chunk."""
    groups, d, per_sample = shape
    sample_bytes = groups * d * per_sample * data.element_size()
    chunk = len(data) if data.is_cuda else max(1, _CPU_CHUNK_BYTES // sample_bytes)
    buffer = data.new_zeros(groups, d, min(chunk, len(data)) * per_sample)
    edges = _block_edges(d)
    cov = data.new_zeros(groups, d, d)
    col = data.new_zeros(groups, d) if with_sum else None
    for part in data.split(chunk):
        mat = columns(part, buffer)
        _gram_into(cov, mat, edges)
        if col is not None:
            col += mat.sum(-1)
    _mirror(cov, edges)
    return cov, col, len(data) * per_sample


def make_layer(
    name: str,
    module: nn.Module,
    approx: KFACApprox = KFACApprox.EXPAND,
    sample_fraction: float = 1.0,
) -> KFACLayer | None:
    """The K-FAC layer of a supported module with trainable weights, else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or not weight.requires_grad:
        return None
    layer: KFACLayer
    if isinstance(module, nn.Linear):
        layer = LinearLayer(name, module)
    elif isinstance(module, nn.Conv2d):
        layer = Conv2dLayer(name, module)
    elif isinstance(module, nn.Conv1d):
        layer = Conv1dLayer(name, module)
    else:
        return None
    layer.approx = approx
    layer.sample_fraction = sample_fraction
    return layer
