"""What a person watching the job sees: one line per epoch on rank 0; a live step counter
when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import Any, Protocol

__all__ = ["Progress"]


class _Run(Protocol):
    rank: int
    steps_per_epoch: int
    total_steps: int


class Progress:
    """One line per epoch on rank 0; a live step counter when stderr is a terminal."""

    def __init__(self, job: _Run, enabled: bool) -> None:
        self.job = job
        self.enabled = enabled and job.rank == 0
        self.tty = self.enabled and sys.stderr.isatty()
        self.last_loss: float | None = None
        self.last_rate: float | None = None

    def window(self, step: int, record: dict[str, Any]) -> None:
        if record:
            self.last_loss, self.last_rate = record["loss"], record["samples_per_s"]
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
        loss = "-" if self.last_loss is None else f"{self.last_loss:.4f}"
        rate = "-" if self.last_rate is None else f"{self.last_rate:.0f}"
        if self.tty:
            sys.stderr.write("\r" + " " * 50 + "\r")
        print(
            f"epoch {-(-step // job.steps_per_epoch)}/{epochs} step {step}/{job.total_steps} "
            f"loss {loss} acc {accuracy:.4f} {rate} samples/s {wall_s:.1f}s",
            flush=True,
        )
