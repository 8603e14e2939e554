"""Measure this machine's collectives: real gloo ranks on this host, timed, fitted to α-β.

Starts ``ranks`` local processes (torch.multiprocessing, TCP rendezvous on 127.0.0.1) that
time allreduce, broadcast and reduce of a few message sizes; rank 0 reports the medians.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Sequence
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kfac_hpc.plan.alphabeta import COLLECTIVES, AlphaBeta, fit_alpha_beta
from kfac_hpc.plan.profiles import NetworkProfile

__all__ = ["SIZES_BYTES", "local_network", "measure_collectives"]

SIZES_BYTES = (4 * 2**10, 64 * 2**10, 1 * 2**20, 4 * 2**20)
_ROUNDS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, ranks: int, port: int, sizes: Sequence[int], out: mp.Queue) -> None:
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
            # the slowest rank finishes the collective: take the max over ranks of the median
            local = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            rows.append((kind, ranks, float(nbytes), float(local.item())))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def measure_collectives(
    ranks: int, sizes: Sequence[int] = SIZES_BYTES
) -> list[tuple[str, int, float, float]]:
    """``(collective, ranks, nbytes, seconds)`` medians from ``ranks`` real gloo processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks, as in a real job
    try:
        procs = [
            ctx.Process(target=_worker, args=(r, ranks, port, tuple(sizes), queue))
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


def _collect(
    queue: Any, procs: list[Any], timeout_s: float = 300
) -> list[tuple[str, int, float, float]]:
    """Rank 0's rows; fails as soon as a rank dies instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            rows: list[tuple[str, int, float, float]] = queue.get(timeout=0.5)
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


def local_network(
    ranks: Sequence[int] = (2, 4),
) -> tuple[NetworkProfile, list[tuple[str, int, float, float]]]:
    """This host as a network profile: one α-β fitted to gloo collectives at ``ranks``."""
    samples = [row for p in ranks for row in measure_collectives(p)]
    link: AlphaBeta = fit_alpha_beta(samples)
    return NetworkProfile("local-gloo", 1 << 20, link, link), samples
