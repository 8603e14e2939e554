"""What a person watching the job sees: one line per evaluation (every epoch end) on rank 0; a
live step counter when stderr is a terminal.

A line's loss and samples/s are those of the metrics windows (``--log-every`` steps each) that
closed since the line before, weighted by their steps and their seconds; ``-`` when none closed
(windows longer than an epoch), never the figures of a window an earlier line already showed.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Protocol

__all__ = ["Progress"]


class _Run(Protocol):
    rank: int
    steps_per_epoch: int
    total_steps: int


class Progress:
    """One line per evaluation on rank 0; a live step counter when stderr is a terminal."""

    def __init__(self, job: _Run, enabled: bool) -> None:
        self.job = job
        self.enabled = enabled and job.rank == 0
        self.tty = self.enabled and sys.stderr.isatty()
        self._new_windows()

    def _new_windows(self) -> None:
        """Forget the windows a line has shown."""
        self._loss_sum = 0.0  # sum of loss * window steps
        self._steps = 0
        self._samples = 0.0  # sum of samples/s * window seconds
        self._seconds = 0.0

    def window(self, step: int, record: dict[str, Any]) -> None:
        if record:
            steps = int(record.get("window_steps") or 1)
            self._loss_sum += float(record["loss"]) * steps
            self._steps += steps
            seconds = float(record.get("step_s") or 0.0) * steps
            rate = record.get("samples_per_s")
            if rate is not None and seconds > 0 and math.isfinite(rate):
                self._samples += float(rate) * seconds
                self._seconds += seconds
        if self.tty:
            job = self.job
            done = step % job.steps_per_epoch or job.steps_per_epoch
            width = 30
            bar = "#" * (width * done // job.steps_per_epoch)
            sys.stderr.write(f"\r  [{bar:<{width}}] {done}/{job.steps_per_epoch}")
            sys.stderr.flush()

    def epoch(self, step: int, accuracy: float, wall_s: float) -> None:
        if not self.enabled:
            return
        job = self.job
        epochs = -(-job.total_steps // job.steps_per_epoch)
        loss = f"{self._loss_sum / self._steps:.4f}" if self._steps else "-"
        rate = f"{self._samples / self._seconds:.0f}" if self._seconds > 0 else "-"
        self._new_windows()
        if self.tty:
            sys.stderr.write("\r" + " " * 50 + "\r")
        print(
            f"epoch {-(-step // job.steps_per_epoch)}/{epochs} step {step}/{job.total_steps} "
            f"loss {loss} acc {accuracy:.4f} {rate} samples/s {wall_s:.1f}s",
            flush=True,
        )
