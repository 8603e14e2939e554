"""Waiting until nothing of a sweep is live: the one wait loop, for ``kfac-hpc sweep --wait``
(the workflow's wait step, ``kfac_hpc.workflows.sweep_flow``) and ``kfac-hpc status --watch``.

Each poll asks the backend (``status``: the scheduler's queue and the run directories'
markers). Polls back off: 2 s after a change, then twice as long each time nothing changed,
at most 60 s; any change of a point's state starts again at 2 s. The sweep has ended when no
point is live on two polls in a row (one scheduler snapshot can miss a task that is changing
state, a requeue); after the change that ended it, that second poll comes 2 s later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

from kfac_hpc.contracts.states import LIVE, PointState
from kfac_hpc.sweep.follow import status
from kfac_hpc.sweep.manifest import Manifest

__all__ = ["FIRST_POLL_S", "MAX_POLL_S", "next_delay", "poll_until_settled", "wait_for_sweep"]

FIRST_POLL_S = 2.0
MAX_POLL_S = 60.0

S = TypeVar("S")


def next_delay(
    last_s: float | None, changed: bool, first_s: float = FIRST_POLL_S, max_s: float = MAX_POLL_S
) -> float:
    """The pause before the next poll: ``first_s`` at the start and after a change, else
    twice the last pause, at most ``max_s`` (never below ``first_s``)."""
    if changed or last_s is None:
        return first_s
    return max(first_s, min(2 * last_s, max_s))


def poll_until_settled(
    observe: Callable[[], S],
    live: Callable[[S], bool],
    key: Callable[[S], Hashable],
    *,
    first_s: float = FIRST_POLL_S,
    max_s: float = MAX_POLL_S,
    timeout_s: float | None = None,
    what: str = "the wait",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> S:
    """Call ``observe`` until ``live`` is false for two observations in a row; return the
    last. ``key`` of an observation is what counts as a change (it resets the pause to
    ``first_s``, see :func:`next_delay`). ``timeout_s``: TimeoutError naming ``what`` when it
    is still live then (the last poll is at the deadline, never after it). ``clock`` and
    ``sleep`` are injectable (tests)."""
    deadline = None if timeout_s is None else clock() + timeout_s
    last_key: Hashable = object()  # equal to no key: the first poll is a change
    delay: float | None = None
    settled = 0
    while True:
        seen = observe()
        settled = 0 if live(seen) else settled + 1
        if settled >= 2:
            return seen
        current = key(seen)
        delay = next_delay(delay, current != last_key, first_s, max_s)
        last_key = current
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise TimeoutError(f"{what} still running after {timeout_s:g} s")
            sleep(min(delay, left))
        else:
            sleep(delay)


def _states(manifest: Manifest) -> Hashable:
    return tuple((p.point_id, p.state, p.job_id, p.attempts) for p in manifest.points)


def _live(manifest: Manifest) -> bool:
    return any(PointState(p.state) in LIVE for p in manifest.points)


def wait_for_sweep(
    sweep_dir: Path,
    *,
    first_s: float = FIRST_POLL_S,
    max_s: float = MAX_POLL_S,
    timeout_s: float | None = None,
    on_poll: Callable[[Manifest], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Manifest:
    """Poll ``status`` (refreshing and persisting the manifest) until no point is pending,
    submitted, running or requeued, on two polls in a row; the last manifest. ``on_poll``
    sees every manifest polled (a progress line)."""

    def observe() -> Manifest:
        manifest, _ = status(sweep_dir)
        if on_poll is not None:
            on_poll(manifest)
        return manifest

    return poll_until_settled(
        observe,
        _live,
        _states,
        first_s=first_s,
        max_s=max(first_s, max_s),
        timeout_s=timeout_s,
        what=f"sweep {sweep_dir}",
        clock=clock,
        sleep=sleep,
    )
