"""Started as P real ranks (P = 1 .. 4) by tests/optim/fosi/test_lanczos_partial.py.

Every rank builds the same symmetric 200 × 200 matrix (the known spectrum of
test_lanczos_early_stop) and runs the sharded Lanczos on its coordinate slice, with full and
with partial reorthogonalization. Rank 0 saves, per mode, the Ritz values, the full Ritz vectors
(gathered), the Lanczos steps and the reorthogonalized steps to ``OUT_DIR/p{P}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kfac_hpc.optim.fosi.lanczos import lanczos_extremes
from kfac_hpc.optim.fosi.sharding import CoordinateShard
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.rank_checks import main_or_leave
from tests.optim.fosi.test_lanczos_early_stop import N, matrix_and_spectrum

K, L, STEPS = 5, 2, 60


def main() -> None:
    ctx = init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    world = dist.get_world_size()
    shard = CoordinateShard(N, world, ctx.rank)
    matrix, _ = matrix_and_spectrum()
    rows = matrix[shard.start : shard.stop]

    def hvp(q: torch.Tensor) -> torch.Tensor:
        return rows @ shard.gather(q)

    found = {}
    for mode in ("full", "partial"):
        spectrum = lanczos_extremes(hvp, shard, K, L, STEPS, 0, reorthogonalize=mode)
        vectors = torch.stack([shard.gather(v) for v in spectrum.vectors])
        found[mode] = {
            "eigenvalues": spectrum.eigenvalues,
            "vectors": vectors,
            "iterations": spectrum.iterations,
            "reorthogonalized": spectrum.reorthogonalized,
        }
    if ctx.rank == 0:
        torch.save({"world_size": world, "found": found}, Path(sys.argv[1]) / f"p{world}.pt")
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
