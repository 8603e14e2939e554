"""A hidden test hook: make one rank fail at one step, to test that failures end every rank.

``KFAC_HPC_FAULT_INJECT="rank=1,step=5"`` raises :class:`InjectedFault` on rank 1 when it is
about to run step 5 (0-based optimizer steps). Not a user feature; undocumented in ``--help``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["FaultPlan", "InjectedFault", "fault_plan"]

ENV = "KFAC_HPC_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection hook."""


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int

    def check(self, rank: int, step: int) -> None:
        if rank == self.rank and step == self.step:
            raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV})")


def fault_plan() -> FaultPlan | None:
    """The plan in ``KFAC_HPC_FAULT_INJECT``, or None when unset."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    parts = dict(item.split("=", 1) for item in spec.split(","))
    return FaultPlan(int(parts.get("rank", "0")), int(parts.get("step", "0")))
