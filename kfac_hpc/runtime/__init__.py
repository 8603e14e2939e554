"""Rank discovery, rendezvous and process groups: the bottom of the stack.

The job and the optimizer ask this package who they are (`discover_launch`) and get a
ready process group from `init_distributed`.
"""

from kfac_hpc.runtime.host_memory import keep_freed_host_memory
from kfac_hpc.runtime.launch import LaunchError, LaunchInfo, discover_launch
from kfac_hpc.runtime.process_group import DistributedContext, init_distributed, shutdown

__all__ = [
    "DistributedContext",
    "LaunchError",
    "LaunchInfo",
    "discover_launch",
    "init_distributed",
    "keep_freed_host_memory",
    "shutdown",
]
