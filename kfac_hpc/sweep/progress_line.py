"""One progress line for a sweep being followed (``sweep --wait``, ``sweep status --watch``):
``done / running / pending / failed`` points and the elapsed time.

On a terminal the line is rewritten in place (carriage return) at every update; elsewhere (a
log file, a pipe) a line is printed only when the counts change.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TextIO

from kfac_hpc.contracts.states import PointState
from kfac_hpc.sweep.manifest import read_manifest

__all__ = ["ProgressLine", "count_states", "progress_text", "watching"]

_RUNNING = {PointState.RUNNING}
_PENDING = {PointState.PENDING, PointState.SUBMITTED, PointState.REQUEUED}


def count_states(states: Iterable[str]) -> tuple[int, int, int, int]:
    """(done, running, pending, failed) of point states; failed counts every end other than
    done (failed, timeout, cancelled, preempted)."""
    done = running = pending = failed = 0
    for raw in states:
        state = PointState(raw)
        if state is PointState.DONE:
            done += 1
        elif state in _RUNNING:
            running += 1
        elif state in _PENDING:
            pending += 1
        else:
            failed += 1
    return done, running, pending, failed


def _clock(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def progress_text(counts: tuple[int, int, int, int], elapsed_s: float) -> str:
    """``sweep: 3/8 done, 2 running, 3 pending, 0 failed, 0:01:05 elapsed``."""
    done, running, pending, failed = counts
    total = done + running + pending + failed
    return (
        f"sweep: {done}/{total} done, {running} running, {pending} pending, {failed} failed, "
        f"{_clock(elapsed_s)} elapsed"
    )


class ProgressLine:
    """The line on ``stream``; ``tty`` (default: ``stream.isatty()``) rewrites it in place."""

    def __init__(
        self,
        stream: TextIO,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream, self._clock, self._start = stream, clock, clock()
        self._tty = stream.isatty() if tty is None else tty
        self._last: tuple[int, int, int, int] | None = None
        self._width = 0

    def update(self, counts: tuple[int, int, int, int]) -> None:
        """Show ``counts``: in place on a terminal, as a new line when they changed otherwise."""
        text = progress_text(counts, self._clock() - self._start)
        if self._tty:
            self._stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        elif counts != self._last:
            self._stream.write(text + "\n")
        self._last = counts
        self._stream.flush()

    def close(self) -> None:
        """End the in-place line (a terminal keeps it, followed by a newline)."""
        if self._tty and self._last is not None:
            self._stream.write("\n")
            self._stream.flush()


@contextlib.contextmanager
def watching(sweep_dir: Path, stream: TextIO, interval_s: float = 1.0) -> Iterator[None]:
    """Show the progress of the sweep in ``sweep_dir`` (its manifest, read every
    ``interval_s``) while the body runs; the manifest's writers keep it current."""
    line = ProgressLine(stream)
    stop = threading.Event()

    def poll() -> None:
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                line.update(count_states(p.state for p in read_manifest(sweep_dir).points))
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=poll, name="sweep-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(OSError, ValueError, KeyError):
            line.update(count_states(p.state for p in read_manifest(sweep_dir).points))
        line.close()
