"""Coordinate sharding of one flat parameter vector over the ranks of a process group.

The parameters of all groups are laid end to end (group by group, in the base optimizer's
order) into one flat vector of ``n`` coordinates. Rank ``r`` of ``P`` owns the contiguous
coordinates ``[start_r, stop_r)``; the first ``n mod P`` ranks own one coordinate more, so any
``n`` works. Unlike ``ZeroRedundancyOptimizer`` (which gives whole parameters to ranks, greedily
by size), every rank gets the same number of coordinates ±1, whatever the parameter shapes: the
Lanczos basis and the eigenvectors are sharded exactly like the base optimizer state.

Every collective here is the identity with one rank (or without a process group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["CoordinateShard", "shard_bounds"]


def shard_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the coordinates rank ``rank`` of ``world`` owns out of ``n``."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class CoordinateShard:
    """This rank's slice ``[start, stop)`` of ``n`` coordinates, and the collectives over
    ``group`` (``world`` ranks, this one is ``rank``) that move vectors between full and
    sharded form."""

    n: int
    world: int
    rank: int
    group: ProcessGroup | None = None

    @property
    def start(self) -> int:
        return shard_bounds(self.n, self.world, self.rank)[0]

    @property
    def stop(self) -> int:
        return shard_bounds(self.n, self.world, self.rank)[1]

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def padded(self) -> int:
        """The largest shard (all collectives move equal-sized, padded pieces)."""
        return -(-self.n // self.world)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the last dimension of ``full`` (a view)."""
        return full[..., self.start : self.stop]

    def allreduce(self, values: torch.Tensor) -> torch.Tensor:
        """Sum of ``values`` over the group, in place (a few numbers: dot products)."""
        if self.world > 1:
            dist.all_reduce(values, group=self.group)
        return values

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full vector(s): the shards of all ranks along the last dimension, ``(..., n)``."""
        if self.world == 1:
            return local
        pad = self.padded - self.size
        piece = torch.nn.functional.pad(local, (0, pad)).contiguous()
        pieces = [torch.empty_like(piece) for _ in range(self.world)]
        dist.all_gather(pieces, piece, group=self.group)
        sizes = [shard_bounds(self.n, self.world, r) for r in range(self.world)]
        return torch.cat([p[..., : b - a] for p, (a, b) in zip(pieces, sizes, strict=True)], -1)

    def reduce_scatter_mean(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the mean of ``full`` (``(n,)``) over the group: a rank sends
        every other rank that rank's piece and receives only its own coordinates, ``(P-1)/P``
        of ``n`` each way, not the whole sum as an allreduce would.

        NCCL reduce-scatters. torch's gloo reduce-scatter is an allreduce of a copy, so on
        gloo it is an all-to-all of the ``P`` slices (uneven, no padding), summed here in rank
        order.
        """
        if self.world == 1:
            return full
        if dist.get_backend(self.group) == "gloo":
            sizes = [b - a for a, b in (shard_bounds(self.n, self.world, r)
                                        for r in range(self.world))]  # fmt: skip
            received = full.new_empty(self.world * self.size)
            dist.all_to_all_single(received, full.contiguous(), [self.size] * self.world, sizes,
                                   group=self.group)  # fmt: skip
            return received.view(self.world, self.size).sum(0).div_(self.world)
        out = torch.empty(self.padded, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_single(out, self._pieces(full), group=self.group)
        return out[: self.size].div_(self.world)

    def _pieces(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (``(n,)``) as ``P`` pieces of ``padded`` elements, rank ``r``'s slice first
        in piece ``r``: the first ``n mod P`` slices fill their piece, the others get one zero."""
        base, extra = divmod(self.n, self.world)
        if extra == 0:
            return full.contiguous()
        pieces = full.new_zeros(self.world, self.padded)
        head = extra * self.padded
        pieces.view(-1)[:head] = full[:head]
        pieces[extra:, :base] = full[head:].view(self.world - extra, base)
        return pieces.view(-1)
