"""Curvature pipelined with training (``curvature_ranks=N``): roles, groups and exchanges.

The last ``N`` ranks of the world are curvature ranks, the others training ranks. When an ESE
is due at step ``t``, training rank 0 sends the parameters θ_t to every curvature rank and the
training ranks post receives for the result, then keep training; the curvature ranks run the
sharded Lanczos (over their own group, each on its own curvature micro-batch) and send every
training rank its coordinates of the eigenvectors plus the eigenvalues. A training rank swaps
the new eigenvectors in at the first step boundary at which they have arrived on every training
rank (one allreduced flag per step while an ESE is in flight), and waits for them at step
``t + max_staleness`` at the latest; ``max_staleness = 0`` gives exactly the synchronous
algorithm.

Messages are point-to-point (gloo and NCCL both have them): the eigenvalues ``(k + l,)`` padded
with NaN when Lanczos stopped early, and for every pair of a curvature and a training rank whose
coordinate slices overlap, that ``(k + l) × overlap`` block (zero rows for missing pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kfac_hpc.optim.fosi.lanczos import ExtremeSpectrum
from kfac_hpc.optim.fosi.sharding import CoordinateShard, shard_bounds

__all__ = ["CurvaturePipeline"]


def _started(work: dist.Work | None) -> dist.Work:
    """The handle of a point-to-point operation (None only for ranks outside the group)."""
    assert work is not None
    return work


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


@dataclass
class _Pending:
    """A requested ESE: the step of its snapshot, the open receives and their buffers."""

    step: int
    works: list[dist.Work]
    eigenvalues: torch.Tensor
    blocks: list[torch.Tensor]
    sends: list[dist.Work] = field(default_factory=list)


class CurvaturePipeline:
    """Splits ``world`` ranks into ``world - curvature_ranks`` training and ``curvature_ranks``
    curvature ranks (collective: every rank builds it) for a flat vector of ``n`` coordinates
    and ``pairs = k + l`` eigenpairs."""

    def __init__(self, n: int, pairs: int, curvature_ranks: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if not 0 < curvature_ranks < world:
            raise ValueError(
                f"FOSI option curvature_ranks={curvature_ranks} is invalid: use 1 .. {world - 1}"
                f" (world size {world}; 0 runs ESE on every rank)"
            )
        self.n, self.pairs = n, pairs
        self.trainers = world - curvature_ranks
        self.curvers = curvature_ranks
        train_group = dist.new_group(list(range(self.trainers)))
        curv_group = dist.new_group(list(range(self.trainers, world)))
        self.is_curvature = rank >= self.trainers
        if self.is_curvature:
            self.shard = CoordinateShard(n, curvature_ranks, rank - self.trainers, curv_group)
        else:
            self.shard = CoordinateShard(n, self.trainers, rank, train_group)
        self.pending: _Pending | None = None

    # -- training ranks -----------------------------------------------------------------
    def request(self, step: int, flat_params: torch.Tensor) -> None:
        """Send the snapshot θ_step (training rank 0) and post the receives of its result."""
        sends = []
        if self.shard.rank == 0:
            snapshot = flat_params.detach().clone()
            sends = [_started(dist.isend(snapshot, self.trainers + j)) for j in range(self.curvers)]
        mine = (self.shard.start, self.shard.stop)
        eigenvalues = torch.empty(self.pairs + 1, dtype=torch.float64)  # and the top count
        works = [_started(dist.irecv(eigenvalues, self.trainers))]
        blocks = []
        for j in range(self.curvers):
            lo, hi = _overlap(mine, shard_bounds(self.n, self.curvers, j))
            if hi > lo:
                blocks.append(torch.empty(self.pairs, hi - lo, dtype=flat_params.dtype))
                works.append(_started(dist.irecv(blocks[-1], self.trainers + j)))
        self.pending = _Pending(step, works, eigenvalues, blocks, sends)

    def due(self, step: int, max_staleness: int) -> bool:
        """Whether a requested result is to be swapped in at ``step`` (it has arrived, or the
        staleness bound is reached and the caller must wait for it)."""
        p = self.pending
        if p is None:
            return False
        if step - p.step >= max_staleness:
            return True
        # all training ranks must swap at the same step: arrived everywhere (a MIN of flags)
        arrived = torch.tensor([float(all(w.is_completed() for w in p.works))])
        dist.all_reduce(arrived, op=dist.ReduceOp.MIN, group=self.shard.group)
        return bool(arrived.item())

    def take(self) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """Wait for the pending result: (snapshot step, eigenvalues ``(K,)`` float64,
        this rank's eigenvector coordinates ``(K, n_r)``, how many of them are of the largest),
        ``K <= k + l``."""
        p = self.pending
        assert p is not None
        for work in [*p.works, *p.sends]:
            work.wait()
        self.pending = None
        values, top = p.eigenvalues[:-1], int(p.eigenvalues[-1])
        found = int((~torch.isnan(values)).sum())
        vectors = torch.cat(p.blocks, dim=1) if p.blocks else torch.empty(self.pairs, 0)
        return p.step, values[:found].clone(), vectors[:found].contiguous(), top

    # -- curvature ranks ----------------------------------------------------------------
    def receive_snapshot(self, like: torch.Tensor) -> torch.Tensor:
        """θ_t from training rank 0 (blocks until it is sent)."""
        snapshot = torch.empty_like(like)
        dist.recv(snapshot, 0)
        return snapshot

    def send(self, spectrum: ExtremeSpectrum, dtype: torch.dtype) -> None:
        """Every training rank's coordinates of the eigenvectors (and, from curvature rank 0,
        the eigenvalues); returns when sent."""
        found = spectrum.eigenvalues.numel()
        works = []
        if self.shard.rank == 0:
            values = torch.full((self.pairs + 1,), float("nan"), dtype=torch.float64)
            values[:found] = spectrum.eigenvalues
            values[-1] = spectrum.top
            works += [_started(dist.isend(values, r)) for r in range(self.trainers)]
        mine = (self.shard.start, self.shard.stop)
        blocks = []
        for r in range(self.trainers):
            lo, hi = _overlap(mine, shard_bounds(self.n, self.trainers, r))
            if hi > lo:
                block = torch.zeros(self.pairs, hi - lo, dtype=dtype)
                block[:found] = spectrum.vectors[:, lo - mine[0] : hi - mine[0]]
                blocks.append(block)
                works.append(_started(dist.isend(block, r)))
        for work in works:
            work.wait()
