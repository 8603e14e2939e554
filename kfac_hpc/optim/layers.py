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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Conv2dLayer", "KFACLayer", "LinearLayer", "make_layer"]


class KFACLayer:
    """A registered module: its factor statistics and its gradient as a matrix."""

    kind = "layer"

    def __init__(self, name: str, module: nn.Module, groups: int, n_a: int, n_g: int) -> None:
        self.name = name
        self.module = module
        self.groups = groups
        self.n_a = n_a
        self.n_g = n_g

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

    def a_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None, int]:
        """Σ a aᵀ (groups, n_in, n_in), Σ a (groups, n_in) (None for a layer without bias) and
        the row count M, without the bias column, from the module input ``x``."""
        raise NotImplementedError

    def g_moments(self, g: Tensor) -> Tensor:
        """Σ g gᵀ over the rows, (groups, n_G, n_G), from the output gradient ``g``."""
        raise NotImplementedError

    def a_factor(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """A of one batch from the module input ``x``, shape ``factor_shapes[0]``."""
        cov, col, m = self.a_moments(x.detach().to(dtype))
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
        batch = g.shape[0] if g.dim() > 1 else 1
        # (1/N) Σ (N·c g)(N·c g)ᵀ = N c² Σ g gᵀ
        cov = self.g_moments(g.detach().to(dtype)) * (grad_multiplier * grad_multiplier * batch)
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

    def a_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None, int]:
        rows = x.reshape(-1, x.shape[-1])
        col = rows.sum(0).unsqueeze(0) if self.bias is not None else None
        return _gram(rows.mT.unsqueeze(0)), col, rows.shape[0]

    def g_moments(self, g: Tensor) -> Tensor:
        return _gram(g.reshape(-1, g.shape[-1]).mT.unsqueeze(0))


class Conv2dLayer(KFACLayer):
    """``nn.Conv2d``: im2col patches as A's rows, every output location as a row of G.

    Handles stride, dilation, integer/tuple/'same'/'valid' padding, every padding mode and
    groups (per-group factors: depthwise layers get ``groups`` tiny factors).
    """

    kind = "Conv2d"

    def __init__(self, name: str, module: nn.Conv2d) -> None:
        kh, kw = module.kernel_size
        n_in = module.in_channels // module.groups * kh * kw
        n_a = n_in + (1 if module.bias is not None else 0)
        super().__init__(name, module, module.groups, n_a, module.out_channels // module.groups)
        self.conv = module
        self._pad = self._explicit_padding(module)

    @staticmethod
    def _explicit_padding(module: nn.Conv2d) -> tuple[int, int, int, int]:
        """(left, right, top, bottom) as ``F.pad`` takes them."""
        if module.padding == "valid":
            return (0, 0, 0, 0)
        if module.padding == "same":
            pads: list[int] = []
            for k, d in zip(reversed(module.kernel_size), reversed(module.dilation), strict=True):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            return (pads[0], pads[1], pads[2], pads[3])
        ph, pw = (int(p) for p in module.padding)
        return (pw, pw, ph, ph)

    def a_moments(self, x: Tensor) -> tuple[Tensor, Tensor | None, int]:
        if x.dim() == 3:
            x = x.unsqueeze(0)
        mode = "constant" if self.conv.padding_mode == "zeros" else self.conv.padding_mode
        if not any(self._pad):
            return _moments(x, self._patch_matrix, self.bias is not None)

        def padded_patches(chunk: Tensor) -> Tensor:  # padded chunk by chunk: stays in cache
            return self._patch_matrix(F.pad(chunk, self._pad, mode=mode))

        return _moments(x, padded_patches, self.bias is not None)

    def _patch_matrix(self, x: Tensor) -> Tensor:
        """im2col of the padded input (n, C, H, W) as (groups, C/groups·kh·kw, n·P·Q), rows
        ordered like ``weight.view(out, -1)``. Built from kh·kw strided copies, several times
        faster on CPUs than ``F.unfold`` and directly in the layout of one GEMM."""
        n, c, h, w = x.shape
        (kh, kw), (dh, dw), (sh, sw) = self.conv.kernel_size, self.conv.dilation, self.conv.stride
        p = (h - dh * (kh - 1) - 1) // sh + 1
        q = (w - dw * (kw - 1) - 1) // sw + 1
        out = x.new_empty(c, kh, kw, n, p, q)
        for i in range(kh):
            for j in range(kw):
                window = x[:, :, i * dh :: sh, j * dw :: sw][:, :, :p, :q]
                out[:, i, j].copy_(window.permute(1, 0, 2, 3))
        return out.view(self.groups, -1, n * p * q)

    def g_moments(self, g: Tensor) -> Tensor:
        if g.dim() == 3:
            g = g.unsqueeze(0)

        def rows(chunk: Tensor) -> Tensor:  # (n, C, H, W) -> (groups, C/groups, n·H·W)
            per_group = chunk.reshape(chunk.shape[0], self.groups, self.n_g, -1)
            return per_group.permute(1, 2, 0, 3).reshape(self.groups, self.n_g, -1)

        return _moments(g, rows, False)[0]


# On CPUs the batch is processed in chunks whose column matrix is about this large: big enough
# for an efficient GEMM, small enough to stay in cache between the copy and the GEMM.
_CPU_CHUNK_BYTES = 4 << 20


def _block_edges(d: int) -> list[int]:
    """Column block boundaries for :func:`_gram_into`: up to 6 blocks of at least 64 columns
    (big enough for efficient GEMMs); one block below 128 columns."""
    blocks = 1 if d < 128 else min(6, -(-d // 64))
    return [d * i // blocks for i in range(blocks + 1)]


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
    data: Tensor, columns: Callable[[Tensor], Tensor], with_sum: bool
) -> tuple[Tensor, Tensor | None, int]:
    """Σ v vᵀ (groups, d, d), Σ v (groups, d) if ``with_sum`` and the count over the columns v
    of ``columns(data)`` (groups, d, K), batch chunk by batch chunk (one chunk on GPUs)."""
    probe = columns(data[:1])  # one sample: the shape, and the chunk size from its bytes
    groups, d, per_sample = probe.shape
    chunk = len(data) if data.is_cuda else max(1, _CPU_CHUNK_BYTES // probe.nbytes)
    edges = _block_edges(d)
    cov = torch.zeros(groups, d, d, dtype=data.dtype, device=data.device)
    col = torch.zeros(groups, d, dtype=data.dtype, device=data.device) if with_sum else None
    # Full chunks from sample 0 on (the probe is rebuilt): no GEMM on a single sample's columns.
    mats = [probe] if chunk == 1 else []
    left = data[len(mats) :]
    rest = (columns(part) for part in left.split(chunk)) if len(left) else ()
    for mat in itertools.chain(mats, rest):  # lazily: one chunk alive at a time
        _gram_into(cov, mat, edges)
        if col is not None:
            col += mat.sum(-1)
    _mirror(cov, edges)
    return cov, col, len(data) * per_sample


def make_layer(name: str, module: nn.Module) -> KFACLayer | None:
    """The K-FAC layer of a supported module with trainable weights, else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or not weight.requires_grad:
        return None
    if isinstance(module, nn.Linear):
        return LinearLayer(name, module)
    if isinstance(module, nn.Conv2d):
        return Conv2dLayer(name, module)
    return None
