"""A GPT-style byte-level decoder: the job's transformer workload (``--model gpt``).

Pre-LayerNorm blocks (Radford et al. 2019): ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, causal
multi-head self-attention whose query, key, value and output projections are ``nn.Linear``
layers (so K-FAC preconditions them, on inputs of shape batch × sequence × features), an MLP of
4·d_model, learned positions and a final LayerNorm. Input: byte ids (N, T) int64; output:
logits (N, T, 256) over the next byte. The output projection is its own ``nn.Linear`` (the
``head``), or the byte embedding's weight when tied (then it is no Linear, and K-FAC leaves it
to the first-order optimizer with the embedding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kfac_hpc.train.config import TrainConfig

__all__ = ["GPT", "VOCAB", "GPTSizes"]

VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTSizes:
    """The decoder's sizes (the ``gpt_*`` options and ``context_length``)."""

    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    tied: bool = False

    @classmethod
    def of(cls, config: TrainConfig) -> GPTSizes:
        """The sizes a job's options give."""
        return cls(
            config.gpt_layers,
            config.gpt_d_model,
            config.gpt_heads,
            config.context_length,
            config.gpt_tied,
        )


class CausalSelfAttention(nn.Module):
    """Multi-head attention of each position over itself and the positions before it."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:  # (N, T, D) -> (N, heads, T, D/heads)
            return y.view(n, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        # Written out rather than F.scaled_dot_product_attention: its fused CPU kernel has no
        # second derivative, which FOSI's Hessian-vector products need.
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        out = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    """One pre-LayerNorm decoder block."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte embedding + positions, ``layers`` blocks, final LayerNorm, next-byte logits."""

    def __init__(self, sizes: GPTSizes) -> None:
        super().__init__()
        self.sizes = sizes
        self.embed = nn.Embedding(VOCAB, sizes.d_model)
        self.position = nn.Embedding(sizes.context, sizes.d_model)
        self.blocks = nn.ModuleList(Block(sizes.d_model, sizes.heads) for _ in range(sizes.layers))
        self.ln_f = nn.LayerNorm(sizes.d_model)
        self.head = None if sizes.tied else nn.Linear(sizes.d_model, VOCAB, bias=False)
        self.apply(self._init)
        # GPT-2's residual scaling: the projections into the residual stream shrink with depth.
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * sizes.layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.sizes.context:
            raise ValueError(f"sequence of {t} bytes exceeds the context {self.sizes.context}")
        x = self.embed(idx) + self.position(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.head(x) if self.head is not None else x @ self.embed.weight.T
