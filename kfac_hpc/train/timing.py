"""Phase timers for the training step: one clock reading per phase boundary.

``lap(phase)`` charges the time since the previous boundary to ``phase``. Three clocks:

- CPU (``perf_counter``) when the step runs on the CPU;
- on a GPU, by default, CUDA events recorded at every boundary on the current stream and
  resolved once per window (``drain``): exact GPU time per phase without a sync per phase;
- ``cuda_sync``: synchronize CUDA at every boundary, then ``perf_counter`` (exact, but each
  sync stalls the GPU's queue).

Per-step sums accumulate into a window that :mod:`kfac_hpc.train.records` drains. Phases
measured elsewhere (``add``: the preconditioner's ``last_timings``) are added as given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from kfac_hpc.contracts import PHASES

__all__ = ["PHASES", "CudaEventTimer", "NullTimer", "PhaseTimer", "phase_timer"]


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


class CudaEventTimer(PhaseTimer):
    """GPU phase times from CUDA events, resolved once per window (one sync per window)."""

    def __init__(self, device: torch.device, phases: Sequence[str] = PHASES) -> None:
        super().__init__(False, phases)
        self._device = device
        self._last_event: torch.cuda.Event | None = None
        self._step_event: torch.cuda.Event | None = None
        # (phase index or -1 for a whole step, start event, end event)
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def begin_step(self) -> None:
        self._step_event = self._last_event = self._record()

    def lap(self, phase: str) -> None:
        event = self._record()
        assert self._last_event is not None, "lap() before begin_step()"
        self._pending.append((self._index[phase], self._last_event, event))
        self._last_event = event

    def skip(self) -> None:
        self._last_event = self._record()

    def end_step(self) -> float:
        """Close the step; its GPU duration is known only at ``drain`` (returns 0 here)."""
        event = self._record()
        assert self._step_event is not None, "end_step() before begin_step()"
        self._pending.append((-1, self._step_event, event))
        self._last_event = event
        return 0.0

    def drain(self) -> tuple[list[float], list[float]]:
        if self._pending:
            self._pending[-1][2].synchronize()  # the window's only host-device sync
        for index, start, end in self._pending:
            seconds = start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
            if index < 0:
                self.window_step_s.append(seconds)
            else:
                self.window_phases[index] += seconds
        self._pending = []
        return super().drain()


def phase_timer(
    cuda_sync: bool, device: torch.device, phases: Sequence[str] = PHASES
) -> PhaseTimer:
    """The timer of a step on ``device``: CUDA events on a GPU unless ``cuda_sync``."""
    if device.type == "cuda" and not cuda_sync:
        return CudaEventTimer(device, phases)
    return PhaseTimer(cuda_sync, phases)


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
