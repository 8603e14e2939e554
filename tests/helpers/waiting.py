"""Bounded waits on the event a test means, never on the machine being idle.

Every bound is generous and only turns a hang into a failure that says what never happened;
``KFAC_HPC_TEST_TIMEOUT_SCALE`` multiplies them all on a slow machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def bound_s(seconds: float) -> float:
    """``seconds`` times ``KFAC_HPC_TEST_TIMEOUT_SCALE`` (default 1)."""
    return seconds * float(os.environ.get("KFAC_HPC_TEST_TIMEOUT_SCALE", "1"))


def wait_until(
    condition: Callable[[], T | None],
    what: str,
    *,
    timeout_s: float = 300.0,
    poll_s: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``condition`` until it returns something truthy and return that; after
    ``bound_s(timeout_s)`` fail with ``what`` (and ``detail()``, the state seen last)."""
    deadline = time.monotonic() + bound_s(timeout_s)
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; last seen: {detail()}" if detail is not None else ""
            raise AssertionError(f"{what} not within {bound_s(timeout_s):g} s{seen}")
        time.sleep(poll_s)
