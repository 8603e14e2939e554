"""Who am I? Rank, world size and local rank from the launcher's environment.

Sources are tried in a fixed order and the first that applies wins:

1. ``env``      explicit ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (torchrun style);
2. ``slurm``    an ``srun`` step (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``);
3. ``openmpi``  Open MPI's ``mpirun`` (``OMPI_COMM_WORLD_*``);
4. ``pmi``      MPICH/Hydra or Intel MPI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``);
5. ``mpi4py``   ``MPI.COMM_WORLD`` (any other MPI launcher);
6. ``single``   none of the above: one process.

A Slurm *batch* script is not a step: its ``SLURM_PROCID=0`` says nothing about how many
processes were started, so Slurm variables count only inside ``srun``. When ``mpiexec`` runs
inside an allocation, the ranks inherit the Slurm variables of Hydra's proxy step; the MPI
launcher's own variables then disagree with them and win.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kfac_hpc.contracts.environment import EMULATED_NODES

__all__ = [
    "LaunchError",
    "LaunchInfo",
    "MpiWorld",
    "discover_launch",
    "probe_mpi4py",
]


class LaunchError(RuntimeError):
    """The launch environment is inconsistent; the message says what to fix."""


@dataclass(frozen=True)
class MpiWorld:
    """What mpi4py's ``COMM_WORLD`` reports."""

    rank: int
    size: int
    local_rank: int
    local_size: int


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str
    # Nodes a launcher emulates on one host (``KFAC_HPC_EMULATED_NODES``: the local sweep
    # backend runs an N-node point's ranks on this machine); None for a real placement.
    emulated_nodes: int | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        """Nodes in the job, assuming the same number of ranks on each (the emulated count
        when the launcher emulates nodes on one host)."""
        if self.emulated_nodes is not None:
            return self.emulated_nodes
        return max(1, self.world_size // max(1, self.local_world_size))


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchError(
            f"{name}={value!r} is not an integer; unset it or fix the launcher"
        ) from None


def _from_env(env: Mapping[str, str]) -> LaunchInfo | None:
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise LaunchError(f"{missing} is not set but its partner is; set both RANK and WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK")
    local_size = _int(env, "LOCAL_WORLD_SIZE")
    return LaunchInfo(
        rank,
        size,
        rank if local_rank is None else local_rank,
        (size if local_rank is None else 1) if local_size is None else local_size,
        "env",
    )


def _tasks_per_node(spec: str | None, node_id: int | None) -> int | None:
    """Parse ``SLURM_TASKS_PER_NODE`` (e.g. ``2(x3),1``) for node ``node_id``."""
    if not spec:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        if "(x" in part:
            count, repeat = part.rstrip(")").split("(x")
            counts.extend([int(count)] * int(repeat))
        else:
            counts.append(int(part))
    index = node_id or 0
    return counts[index] if index < len(counts) else counts[-1]


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    if "SLURM_STEP_ID" not in env and "SLURM_STEP_NUM_TASKS" not in env:
        return None  # the batch script itself, or not under Slurm at all
    rank = _int(env, "SLURM_PROCID")
    size = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "SLURM_LOCALID") or 0
    local_size = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE"), _int(env, "SLURM_NODEID"))
    if local_size is None:
        local_size = _tasks_per_node(env.get("SLURM_TASKS_PER_NODE"), _int(env, "SLURM_NODEID"))
    return LaunchInfo(rank, size, local_rank, local_size or 1, "slurm")


def _from_openmpi(env: Mapping[str, str]) -> LaunchInfo | None:
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    return LaunchInfo(rank, size, local_rank or 0, local_size or 1, "openmpi")


def _from_pmi(env: Mapping[str, str]) -> LaunchInfo | None:
    rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "MPI_LOCALRANKID")
    local_size = _int(env, "MPI_LOCALNRANKS")
    return LaunchInfo(rank, size, local_rank or 0, local_size or 1, "pmi")


def probe_mpi4py() -> MpiWorld | None:
    """Ask mpi4py for ``COMM_WORLD``; ``None`` when mpi4py or its MPI library is missing."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError):
        return None
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return MpiWorld(world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size())
    finally:
        node.Free()


def _check_singleton_trap(env: Mapping[str, str], info: LaunchInfo) -> None:
    slurm_tasks = _int(env, "SLURM_NTASKS")
    if info.world_size == 1 and slurm_tasks is not None and slurm_tasks > 1:
        raise LaunchError(
            f"SLURM_NTASKS={slurm_tasks} but this process sees a world of 1 "
            f"(source: {info.source}): "
            "it was started as a singleton, e.g. by a plain command in the batch script or by "
            "an mpiexec of another MPI than the one mpi4py loaded; start it with "
            "`srun --mpi=pmi2 ...` or the matching mpiexec"
        )


def discover_launch(
    env: Mapping[str, str] | None = None,
    mpi_probe: Callable[[], MpiWorld | None] = probe_mpi4py,
) -> LaunchInfo:
    """Work out rank, world size and local rank, and check that they are consistent.

    ``mpi_probe`` is called only when no environment variable names the launch.
    """
    env = os.environ if env is None else env
    info = _from_env(env)
    if info is None:
        slurm = _from_slurm(env)
        mpi = _from_openmpi(env) or _from_pmi(env)
        if (
            slurm is not None
            and mpi is not None
            and ((mpi.rank, mpi.world_size) != (slurm.rank, slurm.world_size))
        ):
            info = mpi  # mpiexec inside an allocation: ranks carry the proxy step's variables
        else:
            info = slurm or mpi
    if info is None:
        world = mpi_probe()
        if world is not None:
            info = LaunchInfo(world.rank, world.size, world.local_rank, world.local_size, "mpi4py")
    if info is None:
        info = LaunchInfo(0, 1, 0, 1, "single")
    _validate(info)
    _check_singleton_trap(env, info)
    return _with_emulated_nodes(env, info)


def _with_emulated_nodes(env: Mapping[str, str], info: LaunchInfo) -> LaunchInfo:
    """``info`` with ``KFAC_HPC_EMULATED_NODES`` applied: a count that divides the world size,
    for ranks that all run on this host."""
    nodes = _int(env, EMULATED_NODES)
    if nodes is None:
        return info
    if nodes < 1 or info.world_size % nodes or info.local_world_size != info.world_size:
        raise LaunchError(
            f"{EMULATED_NODES}={nodes} needs all {info.world_size} rank(s) on one host and a "
            "count that divides them; unset it"
        )
    return dataclasses.replace(info, emulated_nodes=nodes)


def _validate(info: LaunchInfo) -> None:
    if info.world_size < 1:
        raise LaunchError(f"world size {info.world_size} from {info.source} must be >= 1")
    if not 0 <= info.rank < info.world_size:
        raise LaunchError(
            f"rank {info.rank} from {info.source} is outside [0, {info.world_size}); "
            "check the launcher's variables"
        )
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise LaunchError(
            f"local rank {info.local_rank} from {info.source} is outside "
            f"[0, {info.local_world_size}); check the launcher's variables"
        )
