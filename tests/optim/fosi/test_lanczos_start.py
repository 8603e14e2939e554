"""The random Lanczos start vector is drawn per chunk of coordinates, in the basis' dtype: every
rank draws only the chunks its slice meets, and the vector is the same for every world size.

Oracles: the concatenation of the ranks' slices against the one-rank draw (bitwise: the same
generator states and the same draws); ``torch.randn`` of the seed for a vector of one chunk;
for the Lanczos run over several chunks, the diagonal operator's own entries (its eigenvalues),
within 1e-6 of the largest (the tolerance of test_lanczos_dtype, float32 rounding).
"""

from __future__ import annotations

import pytest
import torch

from kfac_hpc.optim.fosi.lanczos import _CHUNK, _random_slice, _start_vector, lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard

N_CHUNKS = 3 * _CHUNK + 12_345  # four chunks, the last one short


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ranks_slices_make_the_one_rank_vector(world: int, dtype: torch.dtype) -> None:
    whole = _random_slice(CoordinateShard(N_CHUNKS, 1, 0), 7, dtype)
    slices = [_random_slice(CoordinateShard(N_CHUNKS, world, r), 7, dtype) for r in range(world)]
    assert [s.numel() for s in slices] == [CoordinateShard(N_CHUNKS, world, r).size
                                           for r in range(world)]  # fmt: skip
    assert whole.dtype == dtype and torch.equal(torch.cat(slices), whole)


def test_a_one_chunk_vector_is_the_seeds_randn() -> None:
    shard = CoordinateShard(200, 1, 0)
    want = torch.randn(200, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(_start_vector(shard, 3, torch.float64), want / want.norm(),
                               rtol=1e-15, atol=0)  # fmt: skip


def test_chunks_and_seeds_draw_different_numbers() -> None:
    """Each chunk has its own generator: no chunk repeats another, nor the next seed's."""
    shard = CoordinateShard(N_CHUNKS, 1, 0)
    drawn = _random_slice(shard, 0, torch.float64)
    chunks = drawn[: 3 * _CHUNK].view(3, _CHUNK)
    following = _random_slice(shard, 1, torch.float64)[: 3 * _CHUNK].view(3, _CHUNK)
    both = torch.cat([chunks, following])
    correlation = torch.corrcoef(both) - torch.eye(6, dtype=torch.float64)
    # independent standard normals: correlations about 1 / sqrt(65536) = 0.004
    assert float(correlation.abs().max()) < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lanczos_over_several_chunks_finds_the_extremes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    diagonal = torch.rand(N_CHUNKS, generator=gen, dtype=torch.float64) * 10  # the bulk
    top = torch.tensor([50.0, 40.0, 30.0, 25.0, 20.0], dtype=torch.float64)
    diagonal[torch.randperm(N_CHUNKS, generator=gen)[:5]] = top
    weights = diagonal.to(dtype)
    spectrum = lanczos_extremes(lambda v: weights * v, CoordinateShard(N_CHUNKS, 1, 0), 5, 0,
                                60, 0, dtype=dtype)  # fmt: skip
    torch.testing.assert_close(spectrum.eigenvalues, top, rtol=0, atol=1e-6 * 50)
