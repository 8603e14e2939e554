"""A hidden test hook: make one rank fail, or wait for a preemption signal, at one step.

``KFAC_HPC_FAULT_INJECT="rank=1,step=5"`` raises :class:`InjectedFault` on rank 1 when it is
about to run step 5 (0-based optimizer steps), to test that failures end every rank.
``"rank=0,step=12,hold=preempt,world=2"`` instead holds rank 0 of a 2-rank run (any size
without ``world``) before step 12 until a preemption signal reaches it (at most ``hold_s``,
default 600 s, then it goes on); an attempt that resumed at or after step 12 does not hold.
So a test can preempt a run that is certainly still training, on an idle or a loaded machine.
``"rank=2,step=13,hold=ese,until=17,hold_s=120"`` holds the ESE that curvature rank 2 serves
for step 13 until training rank 0 has begun step 17 (it writes ``fault-release-17`` in the run
directory then); past ``hold_s`` it raises :class:`InjectedFault` instead: training ranks that
waited for that ESE never get to step 17, and the run fails rather than hangs.
Not a user feature; undocumented in ``--help``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["FaultPlan", "InjectedFault", "fault_plan"]

ENV = "KFAC_HPC_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised on purpose by the fault-injection hook."""


class _Signalled(Protocol):
    requested: bool


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int
    hold_for_preemption: bool = False
    hold_s: float = 600.0
    world_size: int | None = None
    ese_until: int | None = None  # hold=ese: the step whose start releases the held ESE

    def check(
        self, rank: int, world_size: int, step: int, start_step: int, preemption: _Signalled
    ) -> None:
        """Raise or hold if this is the planned rank and step (of this attempt)."""
        if rank != self.rank or step != self.step or self.ese_until is not None:
            return
        if self.world_size is not None and world_size != self.world_size:
            return
        if not self.hold_for_preemption:
            raise InjectedFault(f"injected fault on rank {rank} at step {step} ({ENV})")
        if start_step >= step > 0:  # this attempt resumed here: the hold was for the first
            return
        deadline = time.monotonic() + self.hold_s
        while not preemption.requested and time.monotonic() < deadline:
            time.sleep(0.05)

    def release(self, rank: int, step: int, run_dir: Path) -> None:
        """Training rank 0 about to run ``step``: release an ESE held until this step."""
        if self.ese_until is not None and rank == 0 and step == self.ese_until:
            (run_dir / f"fault-release-{step}").touch()

    def hold_ese(self, rank: int, step: int, run_dir: Path) -> None:
        """A curvature rank about to serve the ESE of ``step``: hold it if planned."""
        if self.ese_until is None or rank != self.rank or step != self.step:
            return
        release = run_dir / f"fault-release-{self.ese_until}"
        deadline = time.monotonic() + self.hold_s
        while not release.exists():
            if time.monotonic() > deadline:
                raise InjectedFault(
                    f"the ESE of step {step} was held {self.hold_s:g} s and training rank 0 "
                    f"never began step {self.ese_until}: it waited for the ESE ({ENV})"
                )
            time.sleep(0.02)


def fault_plan() -> FaultPlan | None:
    """The plan in ``KFAC_HPC_FAULT_INJECT``, or None when unset."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return None
    parts = dict(item.split("=", 1) for item in spec.split(","))
    return FaultPlan(
        int(parts.get("rank", "0")),
        int(parts.get("step", "0")),
        hold_for_preemption=parts.get("hold") == "preempt",
        hold_s=float(parts.get("hold_s", "600")),
        world_size=int(parts["world"]) if "world" in parts else None,
        ese_until=int(parts["until"]) if parts.get("hold") == "ese" else None,
    )
