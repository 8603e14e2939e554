"""Phase timers for the training step: one ``perf_counter`` per phase boundary.

``lap(phase)`` charges the time since the previous boundary to ``phase``; CUDA is synchronized
first only when asked (``cuda_sync``), since a sync per phase stalls the GPU's queue.
Per-step sums accumulate into a window that :mod:`kfac_hpc.train.records` drains.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from kfac_hpc.contracts import PHASES

__all__ = ["PHASES", "NullTimer", "PhaseTimer"]


class PhaseTimer:
    """Accumulates seconds per phase and per step over a logging window.

    ``phases`` are the names recorded: the contract's by default; the job adds the phases of
    its training method that the contract lacks.
    """

    def __init__(self, cuda_sync: bool = False, phases: Sequence[str] = PHASES) -> None:
        self._sync = cuda_sync and torch.cuda.is_available()
        self.phases = tuple(phases)
        self._index = {name: i for i, name in enumerate(self.phases)}
        self.window_phases = [0.0] * len(self.phases)
        self.window_step_s: list[float] = []
        self._last = 0.0
        self._step_start = 0.0

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin_step(self) -> None:
        self._step_start = self._last = self._now()

    def lap(self, phase: str) -> None:
        """Charge the time since the last boundary to ``phase``."""
        now = self._now()
        self.window_phases[self._index[phase]] += now - self._last
        self._last = now

    def add(self, timings: Mapping[str, float]) -> None:
        """Add phases measured elsewhere (the preconditioner's ``last_timings``)."""
        for name, seconds in timings.items():
            self.window_phases[self._index[name]] += seconds

    def skip(self) -> None:
        """Restart the clock without charging anyone (time already counted via ``add``)."""
        self._last = self._now()

    def end_step(self) -> float:
        """Close the step; returns its duration in seconds."""
        step_s = self._now() - self._step_start
        self.window_step_s.append(step_s)
        return step_s

    def drain(self) -> tuple[list[float], list[float]]:
        """(phase sums, step durations) of the window, and start a new window."""
        out = self.window_phases, self.window_step_s
        self.window_phases = [0.0] * len(self.phases)
        self.window_step_s = []
        return out


class NullTimer(PhaseTimer):
    """Instrumentation off: every call does nothing (the benchmark's baseline)."""

    def begin_step(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def add(self, timings: Mapping[str, float]) -> None:
        pass

    def skip(self) -> None:
        pass

    def end_step(self) -> float:
        return 0.0
