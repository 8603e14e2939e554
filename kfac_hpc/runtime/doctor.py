"""``kfac-hpc doctor``: what this environment can do, and what is broken."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import click

from kfac_hpc import __version__
from kfac_hpc.contracts import HostMemory
from kfac_hpc.contracts.workload_names import ENTRY_POINT_GROUP, installed
from kfac_hpc.runtime.host_memory import allocator_owner

__all__ = ["Check", "doctor", "run_checks"]


@dataclass(frozen=True)
class Check:
    """One line of the report. ``required`` checks that fail make doctor exit 1."""

    name: str
    ok: bool
    detail: str
    required: bool = True


def _torch() -> list[Check]:
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # any import failure is the finding
        return [Check("torch", False, f"cannot import: {exc}")]
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    checks = [
        Check("torch", True, f"{torch.__version__}"),
        Check(
            "cuda",
            True,
            f"{gpus} GPU(s), CUDA {torch.version.cuda}" if cuda else "not available (CPU only)",
            required=False,
        ),
        Check(
            "gloo",
            dist.is_gloo_available(),
            "available" if dist.is_gloo_available() else "not built into this torch",
        ),
        Check(
            "nccl",
            dist.is_nccl_available() or not cuda,
            "available" if dist.is_nccl_available() else "not built into this torch",
            required=cuda,
        ),
    ]
    return checks


def _host_memory() -> list[Check]:
    owner = allocator_owner()
    detail = {
        None: "glibc: kfac-hpc train keeps freed memory for reuse (--no-keep-freed-memory: not)",
        HostMemory.ENVIRONMENT: "set by MALLOC_*, GLIBC_TUNABLES or LD_PRELOAD: kfac-hpc train "
        "leaves it",
        HostMemory.UNSUPPORTED: "not glibc: kfac-hpc train leaves the allocator as it is",
    }[owner]
    return [Check("malloc", True, detail, required=False)]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _mpi() -> list[Check]:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return [Check("mpi4py", False, f"not installed ({exc}); pip install mpi4py")]
    except RuntimeError as exc:
        return [
            Check(
                "mpi",
                False,
                f"mpi4py cannot load an MPI library: {_one_line(exc)}; install the 'mpich' extra "
                "(pip install 'kfac-hpc[mpich]') or load your site's MPI module",
            )
        ]
    version = MPI.Get_library_version().strip().splitlines()[0]
    return [
        Check("mpi", True, f"mpi4py {importlib.import_module('mpi4py').__version__}, {version}")
    ]


def _launch() -> list[Check]:
    from kfac_hpc.runtime.launch import LaunchError, discover_launch

    try:
        info = discover_launch(mpi_probe=lambda: None)
    except LaunchError as exc:
        return [Check("launch", False, str(exc))]
    return [
        Check(
            "launch",
            True,
            f"rank {info.rank}/{info.world_size}, local {info.local_rank}/"
            f"{info.local_world_size}, source {info.source}",
        )
    ]


def _slurm() -> list[Check]:
    srun = shutil.which("srun")
    if srun is None:
        return [Check("slurm", True, "srun not on PATH (local runs only)", required=False)]
    try:
        out = subprocess.run([srun, "--mpi=list"], capture_output=True, text=True, timeout=30)
        listing = (out.stdout + out.stderr).splitlines()
        plugins = [line.strip() for line in listing if line.startswith("\t")]
        detail = f"{srun}; srun --mpi=list: {', '.join(plugins) or 'none'}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        detail = f"{srun}; srun --mpi=list failed: {exc}"
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        detail += f"; inside job {job}"
    return [Check("slurm", True, detail, required=False)]


def _package(module: str, hint: str) -> Callable[[], list[Check]]:
    def check() -> list[Check]:
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            return [Check(module, False, f"cannot import: {exc}; {hint}")]
        return [Check(module, True, str(getattr(mod, "__version__", "installed")))]

    return check


def _nccl_allreduce() -> list[Check]:
    """With CUDA: a 1-rank NCCL communicator on this rank's GPU and one allreduce (a
    missing driver, a broken NCCL or a mismatched CUDA shows here, not in the first job)."""
    import torch

    if not torch.cuda.is_available():
        return []
    import datetime
    import socket

    import torch.distributed as dist

    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
        # under a launcher every rank checks its own GPU with its own 1-rank communicator
        device = torch.device("cuda", _local_rank() % torch.cuda.device_count())
        dist.init_process_group(
            "nccl",
            store=store,
            rank=0,
            world_size=1,
            device_id=device,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            value = torch.full((1024,), 2.0, device=device)
            dist.all_reduce(value)
            torch.cuda.synchronize(device)
            ok = bool((value == 2.0).all().item())
        finally:
            dist.destroy_process_group()
    except Exception as exc:  # any failure is the finding
        return [Check("nccl-allreduce", False, f"1-rank NCCL allreduce failed: {_one_line(exc)}")]
    detail = f"1-rank communicator on {device} ({torch.cuda.get_device_name(device)}), 4 KiB"
    return [Check("nccl-allreduce", ok, detail if ok else "wrong allreduce result")]


def _local_rank() -> int:
    from kfac_hpc.runtime.launch import LaunchError, discover_launch

    try:
        return discover_launch(mpi_probe=lambda: None).local_rank
    except LaunchError:
        return 0


def _workloads() -> list[Check]:
    """The installed packages' workloads (entry points ``kfac_hpc.workloads``), by name."""
    try:
        found = installed()
    except Exception as exc:  # a broken package's metadata is the finding
        return [Check("workloads", False, f"cannot read entry points: {_one_line(exc)}", False)]
    names = [f"--{kind} {name}" for kind, named in found.items() for name in named]
    detail = ", ".join(names) if names else f"none installed (entry points {ENTRY_POINT_GROUP})"
    return [Check("workloads", True, detail, required=False)]


CHECKS: tuple[Callable[[], list[Check]], ...] = (
    _torch,
    _nccl_allreduce,
    _mpi,
    _launch,
    _slurm,
    _host_memory,
    _package("h5py", "pip install h5py"),
    _package("parsl", "pip install parsl"),
    _workloads,
)


def run_checks() -> list[Check]:
    """Run every check; none raises."""
    return [check for probe in CHECKS for check in probe()]


@click.command()
def doctor() -> None:
    """Check torch, CUDA/NCCL/gloo, MPI, the launch, Slurm, h5py and Parsl; list the installed
    workloads.

    Exits 1 naming each broken piece; optional pieces (GPU, Slurm) never fail it.
    """
    click.echo(f"kfac-hpc {__version__} on Python {sys.version.split()[0]} ({sys.executable})")
    checks = run_checks()
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        click.echo(f"  [{mark}] {c.name:<{width}}  {c.detail}")
    broken = [c.name for c in checks if c.required and not c.ok]
    if broken:
        click.echo(f"broken: {', '.join(broken)}", err=True)
        raise SystemExit(1)
    click.echo("all required pieces work")
