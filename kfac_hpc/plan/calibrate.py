"""Measure this machine's collectives: real gloo ranks on this host, timed, fitted to α-β.

Starts ``ranks`` local processes (torch.multiprocessing, TCP rendezvous on 127.0.0.1) that
time allreduce, broadcast and reduce of a few message sizes (in lockstep, after a barrier);
rank 0 reports the means over rounds and ranks. Means, not medians, because the job's phases
are means over steps and ranks: here about one collective in five takes several times the
typical one (2-5 ms against 0.3 ms at 2 ranks), and those rounds are part of the step.
Then the *synchronization wait*: each rank runs a fixed amount of single-thread GEMM work
(what takes ``T`` seconds on one idle core), then a one-number allreduce of 64 KiB. The
round's mean time (over rounds and ranks, as the job averages its phases) minus the cost
model's compute for that work (``T`` times the slowdown of ranks sharing cores) and minus the
same allreduce in lockstep is what a collective costs beyond its α-β time when ranks arrive
at different moments: jitter, and ranks that share cores waiting to be scheduled. Fitted per
rank count as ``a + b·T`` with ``b ≥ 0``.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Sequence
from queue import Empty
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kfac_hpc.plan.alphabeta import COLLECTIVES, AlphaBeta, fit_alpha_beta
from kfac_hpc.plan.profiles import NetworkProfile

__all__ = [
    "SIZES_BYTES",
    "SYNC_BYTES",
    "SYNC_WORK_S",
    "fit_wait",
    "gemm_s",
    "local_network",
    "measure_collectives",
    "sync_reps",
    "sync_rounds",
    "synchronize",
]

SIZES_BYTES = (64, 4 * 2**10, 64 * 2**10, 1 * 2**20, 4 * 2**20)
SYNC_WORK_S = (0.5e-3, 4e-3, 16e-3)  # compute before each synchronization, one idle core
SYNC_BYTES = 64 * 2**10  # the allreduce after it (one of SIZES_BYTES)
# rounds per collective and size, and per amount of sync work: enough that the mean holds
# the slow tail (about one round in five, several times the typical one, on a shared host)
_ROUNDS = 100
_SYNC_ROUNDS = 100
_GEMM_N = 128
_CPU = torch.device("cpu")

Sample = tuple[str, int, float, float]  # (collective or "sync", ranks, bytes or T, seconds)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on a CPU), before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_s(device: torch.device = _CPU) -> float:
    """Seconds of one N×N GEMM on one idle thread or ``device`` (the unit of the sync
    test's work)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(_GEMM_N, _GEMM_N, device=device)
    try:
        for _ in range(20):
            a @ a
        synchronize(device)
        start = time.perf_counter()
        for _ in range(200):
            a @ a
        synchronize(device)
        return (time.perf_counter() - start) / 200
    finally:
        torch.set_num_threads(before)


def _mean_over_ranks(
    seconds: Sequence[float], ranks: int, group: Any = None, device: torch.device = _CPU
) -> float:
    """The mean of every rank's ``seconds`` (each rank's mean, averaged). Collective over
    ``group`` (None: the world)."""
    local = torch.tensor([statistics.fmean(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(local, group=group)
    return float(local.item()) / ranks


def sync_rounds(
    ranks: int, reps: Sequence[int], group: Any = None, device: torch.device = _CPU
) -> list[Sample]:
    """("sync", ranks, T, seconds of work + allreduce, mean over ranks) for each amount of
    work ``reps`` (GEMMs of :func:`gemm_s`), over ``group`` of ``ranks`` (None: the world)
    on ``device``. Collective over the group."""
    a = torch.randn(_GEMM_N, _GEMM_N, device=device)
    message = torch.zeros(SYNC_BYTES // 4, device=device)
    rows: list[Sample] = []
    for work_s, n in zip(SYNC_WORK_S, reps, strict=True):
        rounds = []
        for _ in range(_SYNC_ROUNDS + 1):
            start = time.perf_counter()
            for _ in range(n):
                a @ a
            dist.all_reduce(message, group=group)
            synchronize(device)
            rounds.append(time.perf_counter() - start)
        mean = _mean_over_ranks(rounds[1:], ranks, group, device)
        rows.append(("sync", ranks, work_s, mean))
    return rows


def _worker(
    rank: int, ranks: int, port: int, sizes: Sequence[int], reps: Sequence[int], out: mp.Queue
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks
    )
    warm = torch.ones(max(sizes) // 4)
    for _ in range(3):  # connections and buffers are set up on first use
        dist.all_reduce(warm)
    rows = []
    for kind in COLLECTIVES:
        for nbytes in sizes:
            buf = torch.ones(nbytes // 4)
            times = []
            for _ in range(_ROUNDS + 1):
                dist.barrier()
                start = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(buf)
                elif kind == "broadcast":
                    dist.broadcast(buf, 0)
                else:
                    dist.reduce(buf, 0)
                times.append(time.perf_counter() - start)
            rows.append((kind, ranks, float(nbytes), _mean_over_ranks(times[1:], ranks)))
    rows += sync_rounds(ranks, reps)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def sync_reps(gemm: float) -> tuple[int, ...]:
    """GEMMs of ``gemm`` seconds that make each amount of SYNC_WORK_S."""
    return tuple(max(1, round(t / gemm)) for t in SYNC_WORK_S)


def measure_collectives(ranks: int, sizes: Sequence[int] = SIZES_BYTES) -> list[Sample]:
    """``(collective, ranks, nbytes, seconds)`` means from ``ranks`` real gloo processes,
    then ``("sync", ranks, T, seconds)`` rows (see the module's docstring)."""
    gemm = gemm_s()
    reps = sync_reps(gemm)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks, as in a real job
    try:
        procs = [
            ctx.Process(target=_worker, args=(r, ranks, port, tuple(sizes), reps, queue))
            for r in range(ranks)
        ]
        for proc in procs:
            proc.start()
        rows = _collect(queue, procs)
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return rows


def _collect(queue: Any, procs: list[Any], timeout_s: float = 300) -> list[Sample]:
    """Rank 0's rows; fails as soon as a rank dies instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows: list[Sample] = queue.get(timeout=0.5)
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a calibration rank exited with code {dead[0]}") from None
            continue
        for proc in procs:
            proc.join(timeout=60)
        return rows
    for proc in procs:
        proc.kill()
    raise RuntimeError(f"the calibration ranks did not report within {timeout_s:.0f} s")


def fit_sync(rows: Sequence[Sample], slowdown: float) -> tuple[float, float]:
    """(a, b) of wait = round − slowdown·T − lockstep allreduce = a + b·T, least squares over
    one rank count's rows (``slowdown``: the cost model's compute slowdown there). The
    lockstep allreduce is the α-β fit to that count's allreduce rows at SYNC_BYTES, what the
    cost model adds for it, so model collective + wait = the measured round."""
    allreduce = [r for r in rows if r[0] == "allreduce"]
    ranks = allreduce[0][1]
    lockstep = fit_alpha_beta(allreduce).time_s("allreduce", SYNC_BYTES, ranks)
    return fit_wait([r for r in rows if r[0] == "sync"], slowdown, lockstep)


def fit_wait(sync: Sequence[Sample], slowdown: float, lockstep_s: float) -> tuple[float, float]:
    """(a, b) of wait = round − slowdown·T − ``lockstep_s`` = a + b·T, least squares with
    b ≥ 0 over the ``("sync", ranks, T, round)`` rows of one rank count (one row: b = 0).
    More work before a collective never shortens the wait for it: a negative slope, which a
    loaded host's noise fits (−0.2 to −0.9 seen), would price no wait at all after a long
    compute phase. The objective is convex, so when the free fit's slope is negative the
    constrained optimum lies on b = 0: the mean wait."""
    t = np.array([r[2] for r in sync])
    wait = np.array([r[3] for r in sync]) - slowdown * t - lockstep_s
    if len(sync) < 2:
        return float(wait.mean()), 0.0
    b, a = np.polyfit(t, wait, 1)
    if b < 0:
        return float(wait.mean()), 0.0
    return float(a), float(b)


def local_network(
    ranks: Sequence[int] = (2, 4), cores: int = 1
) -> tuple[NetworkProfile, tuple[tuple[int, float, float], ...], list[Sample]]:
    """This host as a network profile: one α-β fitted to gloo collectives at all ``ranks``,
    and one per collective at each rank count (used at exactly that count: gloo's algorithms
    differ from the step counts, and ranks that share cores make a message step's cost depend
    on how many there are); and the sync waits'
    fits ``(ranks, a, b)`` for a host of ``cores`` cores running one thread per rank."""
    measured = {p: measure_collectives(p) for p in ranks}
    by_ranks = {p: [r for r in rows if r[0] != "sync"] for p, rows in measured.items()}
    samples = [row for rows in by_ranks.values() for row in rows]
    link: AlphaBeta = fit_alpha_beta(samples)
    at = tuple(
        (p, kind, fit_alpha_beta([r for r in rows if r[0] == kind]))
        for p, rows in by_ranks.items()
        for kind in COLLECTIVES
    )
    sync = tuple((p, *fit_sync(rows, max(1.0, p / cores))) for p, rows in measured.items())
    network = NetworkProfile(
        "local-gloo", 1 << 20, link, link, at, backend="gloo", intra_link="shm"
    )
    return network, sync, [row for rows in measured.values() for row in rows]
