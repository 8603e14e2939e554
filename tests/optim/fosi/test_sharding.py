"""The coordinate partition, and the layout NCCL's reduce-scatter gets (no process group: the
reduce-scatter is emulated as its definition, the sum of every rank's input, chunk r to rank r)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kfac_hpc.optim.fosi.sharding import CoordinateShard, shard_bounds


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_slices_cover_every_coordinate_once_with_sizes_within_one(world: int) -> None:
    bounds = [shard_bounds(53, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 53
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = {b - a for a, b in bounds}
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_reduce_scatter_layout_gives_each_rank_the_sum_of_its_own_slice(world: int) -> None:
    n = 53  # 53 mod P = 1, 2, 1, 3: the short slices sit at the end, in the middle, ...
    gen = torch.Generator().manual_seed(world)
    inputs = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(world)]
    shards = [CoordinateShard(n, world, r) for r in range(world)]
    laid_out = [shard._pieces(x) for shard, x in zip(shards, inputs, strict=True)]
    assert all(p.numel() == shards[0].padded * world for p in laid_out)
    chunks = torch.stack(laid_out).sum(0).view(world, shards[0].padded)  # reduce-scatter
    total = torch.stack(inputs).sum(0)
    for r, shard in enumerate(shards):
        torch.testing.assert_close(chunks[r, : shard.size], total[shard.start : shard.stop])
        assert torch.all(chunks[r, shard.size :] == 0)
