"""Where do the ranks meet? The master address and port for torch.distributed.

Order: ``MASTER_ADDR``/``MASTER_PORT`` from the environment; under an ``srun`` step the first
host of the job's node list and a port derived from the job and step ids (so jobs sharing a
node do not collide); under an MPI launcher rank 0's address and a free port, broadcast over
MPI; for a single process, the loopback address and a free port.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from kfac_hpc.runtime.launch import LaunchError, LaunchInfo

__all__ = ["Rendezvous", "expand_nodelist", "free_port", "resolve_rendezvous", "slurm_port"]

_PORT_BASE = 20000
_PORT_SPAN = 40000


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int
    source: str


def free_port() -> int:
    """A TCP port that was free on this host a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """A port in [20000, 60000) that differs between jobs and steps sharing a node."""
    return _PORT_BASE + (job_id * 97 + step_id) % _PORT_SPAN


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list, e.g. ``gpu[01-03,7],login1`` (as
    ``scontrol show hostnames`` does, without calling it)."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = match.groups()
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not high:
                hosts.append(f"{prefix}{low}{suffix}")
                continue
            width = len(low)
            hosts.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(low), int(high) + 1))
    return hosts


def _address_of_slurm_node(host: str) -> str:
    """The host's IP; falls back to the node's ``NodeAddr`` for names DNS does not know
    (emulated nodes in a test cluster)."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        pass
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", host], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot resolve Slurm node {host!r}: {exc}; set MASTER_ADDR") from exc
    found = re.search(r"NodeAddr=(\S+)", out)
    if not found:
        raise LaunchError(f"cannot resolve Slurm node {host!r}; set MASTER_ADDR")
    return socket.gethostbyname(found.group(1))


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _broadcast_from_rank0(info: LaunchInfo) -> Rendezvous:
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        raise LaunchError(
            f"launched by {info.source} with {info.world_size} ranks but mpi4py cannot load an "
            f"MPI library ({exc}); set MASTER_ADDR and MASTER_PORT, or install the 'mpich' extra"
        ) from exc
    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size:
        raise LaunchError(
            f"{info.source} says {info.world_size} ranks but mpi4py's COMM_WORLD has "
            f"{comm.Get_size()}: mpi4py loaded another MPI than the launcher's; "
            "use the mpiexec of the MPI mpi4py was built for"
        )
    offer = (_own_address(), free_port()) if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(offer, root=0)
    return Rendezvous(addr, int(port), "mpi-broadcast")


def resolve_rendezvous(info: LaunchInfo, env: Mapping[str, str]) -> Rendezvous:
    """Decide the master address and port for this launch."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        try:
            return Rendezvous(addr, int(port), "env")
        except ValueError:
            raise LaunchError(f"MASTER_PORT={port!r} is not a port number") from None
    if info.world_size == 1:
        return Rendezvous("127.0.0.1", free_port(), "local")
    if info.source == "slurm" and env.get("SLURM_JOB_NODELIST") and env.get("SLURM_JOB_ID"):
        first = expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
        step = int(env.get("SLURM_STEP_ID", "0") or 0)
        return Rendezvous(
            _address_of_slurm_node(first), slurm_port(int(env["SLURM_JOB_ID"]), step), "slurm"
        )
    if info.source == "env":
        raise LaunchError("RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; set both")
    return _broadcast_from_rank0(info)
