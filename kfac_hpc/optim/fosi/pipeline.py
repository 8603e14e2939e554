"""Curvature pipelined with training (``curvature_ranks=N``): roles, groups and exchanges.

The last ``N`` ranks of the world are curvature ranks, the others training ranks. When an ESE
is due at step ``t``, training rank 0 sends the parameters θ_t to every curvature rank and the
training ranks post receives for the result, then keep training; the curvature ranks run the
sharded Lanczos (over their own group, each on its own curvature micro-batch) and send every
training rank its coordinates of the eigenvectors plus the eigenvalues. A training rank swaps
the new eigenvectors in at the first step boundary at which they have arrived on every training
rank (one allreduced flag per ESE in flight and step). With ``max_staleness = 0`` it waits for
them at step ``t`` (exactly the synchronous algorithm); with a bound ``S > 0`` it never waits:
from step ``t + S`` until they arrive the caller takes the base update alone (:meth:`late`).
Requests queue up while earlier ones are in flight; results arrive in the order requested.
A gloo receive says it has completed only once ``wait()`` has returned, so on gloo a daemon
thread waits for each request's receives and the step boundary reads its flag; other backends
report completion themselves (``is_completed``).

Messages are point-to-point (gloo and NCCL both have them): the eigenvalues ``(k + l,)`` padded
with NaN when Lanczos stopped early, followed by how many are of the largest and the seconds the
ESE took on curvature rank 0 (the training ranks' record of the curvature ranks' work), and for
every pair of a curvature and a training rank whose coordinate slices overlap, that
``(k + l) × overlap`` block (zero rows for missing pairs).
"""

from __future__ import annotations

import threading
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
    watcher: threading.Thread | None = None  # gloo: waits for ``works``, then sets ``done``
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def watch(self) -> None:
        """Wait for the receives in a daemon thread (gloo); :meth:`arrived` reads its flag."""

        def wait() -> None:
            try:
                for work in self.works:
                    work.wait()
            except BaseException as exc:  # re-raised by CurvaturePipeline.take
                self.error = exc
            self.done.set()

        self.watcher = threading.Thread(target=wait, name="fosi-curvature-receive", daemon=True)
        self.watcher.start()

    def arrived(self) -> bool:
        """Whether every receive of this request has completed on this rank."""
        if self.watcher is not None:
            return self.done.is_set()
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Block until every receive and send of this request has completed."""
        if self.watcher is not None:
            self.watcher.join()
            if self.error is not None:
                raise self.error
        else:
            for work in self.works:
                work.wait()
        for work in self.sends:
            work.wait()


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
        self.pending: list[_Pending] = []  # requested, not yet swapped in; oldest first

    # -- training ranks -----------------------------------------------------------------
    def request(self, step: int, flat_params: torch.Tensor) -> None:
        """Send the snapshot θ_step (training rank 0) and post the receives of its result."""
        sends = []
        if self.shard.rank == 0:
            snapshot = flat_params.detach().clone()
            sends = [_started(dist.isend(snapshot, self.trainers + j)) for j in range(self.curvers)]
        mine = (self.shard.start, self.shard.stop)
        eigenvalues = torch.empty(self.pairs + 2, dtype=torch.float64)  # and top, seconds
        works = [_started(dist.irecv(eigenvalues, self.trainers))]
        blocks = []
        for j in range(self.curvers):
            lo, hi = _overlap(mine, shard_bounds(self.n, self.curvers, j))
            if hi > lo:
                blocks.append(torch.empty(self.pairs, hi - lo, dtype=flat_params.dtype))
                works.append(_started(dist.irecv(blocks[-1], self.trainers + j)))
        pending = _Pending(step, works, eigenvalues, blocks, sends)
        if dist.get_backend() == "gloo":
            pending.watch()
        self.pending.append(pending)

    def arrived(self) -> int:
        """How many of the oldest requests have arrived on every training rank (one MIN
        allreduce of a flag per request in flight; none when nothing is in flight)."""
        if not self.pending:
            return 0
        flags = torch.tensor([float(p.arrived()) for p in self.pending])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.shard.group)
        done = flags.tolist()
        return done.index(0.0) if 0.0 in done else len(done)

    def late(self, step: int, max_staleness: int) -> bool:
        """Whether the oldest request in flight is ``max_staleness`` or more steps old at
        ``step``: the eigenpairs in use are older than the bound allows."""
        return bool(self.pending) and step - self.pending[0].step >= max_staleness

    def take(self) -> tuple[int, torch.Tensor, torch.Tensor, int, float]:
        """The oldest request's result, waited for: (snapshot step, eigenvalues ``(K,)``
        float64, this rank's eigenvector coordinates ``(K, n_r)``, how many of them are of the
        largest, the seconds the ESE took), ``K <= k + l``."""
        p = self.pending.pop(0)
        p.wait()
        values, top = p.eigenvalues[:-2], int(p.eigenvalues[-2])
        found = int((~torch.isnan(values)).sum())
        vectors = torch.cat(p.blocks, dim=1) if p.blocks else torch.empty(self.pairs, 0)
        seconds = float(p.eigenvalues[-1])
        return p.step, values[:found].clone(), vectors[:found].contiguous(), top, seconds

    def drain(self) -> None:
        """Wait for every request in flight (its receives, and training rank 0's snapshot
        sends) and drop the results. Gloo transmits a message only once its receiver has
        posted the receive: a training rank that left with a snapshot unsent would close the
        connection under a curvature rank still waiting for it."""
        while self.pending:
            self.pending.pop(0).wait()

    # -- curvature ranks ----------------------------------------------------------------
    def receive_snapshot(self, into: torch.Tensor) -> None:
        """θ_t from training rank 0, received in place into ``into`` (the curvature rank's
        parameter buffer); blocks until it is sent."""
        dist.recv(into, 0)

    def send(self, spectrum: ExtremeSpectrum, dtype: torch.dtype, seconds: float) -> None:
        """Every training rank's coordinates of the eigenvectors (and, from curvature rank 0,
        the eigenvalues and the ESE's ``seconds``); returns when sent."""
        found = spectrum.eigenvalues.numel()
        works = []
        if self.shard.rank == 0:
            values = torch.full((self.pairs + 2,), float("nan"), dtype=torch.float64)
            values[:found] = spectrum.eigenvalues
            values[-2], values[-1] = spectrum.top, seconds
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
