"""Start and stop the torch.distributed process group for this launch."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kfac_hpc.runtime.launch import LaunchError, LaunchInfo, discover_launch
from kfac_hpc.runtime.rendezvous import Rendezvous, resolve_rendezvous

__all__ = ["BACKENDS", "DistributedContext", "default_backend", "init_distributed", "shutdown"]

BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class DistributedContext:
    """A started process group and how it was found."""

    launch: LaunchInfo
    rendezvous: Rendezvous
    backend: str
    device: torch.device
    timeout_s: float

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (local {self.launch.local_rank}/"
            f"{self.launch.local_world_size}) via {self.launch.source}, {self.backend} on "
            f"{self.device}, master {self.rendezvous.addr}:{self.rendezvous.port} "
            f"({self.rendezvous.source})"
        )


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _pick_device(backend: str, info: LaunchInfo) -> torch.device:
    if backend == "nccl" or (torch.cuda.is_available() and backend != "gloo"):
        count = torch.cuda.device_count()
        if count == 0:
            raise LaunchError("backend 'nccl' needs CUDA but no GPU is visible; use --backend gloo")
        device = torch.device("cuda", info.local_rank % count)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> DistributedContext:
    """Discover the launch, agree on a rendezvous and start the process group.

    ``backend`` defaults to :func:`default_backend`; ``timeout_s`` bounds every collective, so
    a rank that died ends the others instead of hanging them.
    """
    env = os.environ if env is None else env
    chosen = backend or env.get("KFAC_HPC_BACKEND") or default_backend()
    if chosen not in BACKENDS:
        raise LaunchError(f"backend {chosen!r} is not one of {', '.join(BACKENDS)}")
    if chosen == "nccl" and not dist.is_nccl_available():
        raise LaunchError("backend 'nccl' is not built into this torch; use gloo")
    info = discover_launch(env)
    rendezvous = resolve_rendezvous(info, env)
    device = _pick_device(chosen, info)
    if not dist.is_initialized():
        # atexit handlers run while the interpreter is still whole: groups are destroyed
        # there even when the program forgot to, or kept them in a global.
        atexit.unregister(shutdown)  # once per process, however many runs it starts
        atexit.register(shutdown)
        dist.init_process_group(
            backend=chosen,
            init_method=f"tcp://{rendezvous.addr}:{rendezvous.port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            # binds NCCL's communicator to this rank's GPU at once, so the first collective
            # cannot land on GPU 0 (and no rank guesses its device from the rank number)
            device_id=device if chosen == "nccl" else None,
        )
    return DistributedContext(info, rendezvous, chosen, device, timeout_s)


def shutdown() -> None:
    """Destroy every process group if one is running; safe to call twice, and called at exit.

    Unreachable objects that still hold subgroups or in-flight async work (a preconditioner
    whose hooks form a reference cycle with its model, say) are collected first: if they were
    left for the interpreter's final teardown, gloo would destroy their worker threads after
    Python is gone and abort the process ("terminate called without an active exception").
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
