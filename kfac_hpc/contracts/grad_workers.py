"""The K-FAC grad-worker fraction: a strategy name or a number, parsed in one place.

``comm-opt``: every rank preconditions every layer (fraction 1); ``mem-opt``: one rank per
layer (1/P); ``hybrid-opt``: half of the ranks (1/2; P must be even, or 1); a number f in
(0, 1] with f·P a whole number of ranks dividing P.
"""

from __future__ import annotations

import contextlib
import math

from kfac_hpc.contracts.choices import DistributionStrategy, values

__all__ = [
    "GRAD_WORKER_NAMES",
    "check_grad_worker_fraction",
    "parse_grad_worker_fraction",
    "valid_grad_worker_fractions",
]

GRAD_WORKER_NAMES = values(DistributionStrategy)  # comm-opt, mem-opt, hybrid-opt


def check_grad_worker_fraction(value: object) -> str | float:
    """The value as given when it can be valid at some world size: a strategy name (str) or a
    number in (0, 1] (float); ValueError otherwise."""
    if isinstance(value, str) and value.strip().lower().replace("_", "-") in GRAD_WORKER_NAMES:
        return value.strip().lower().replace("_", "-")
    fraction = -1.0
    if not isinstance(value, bool) and isinstance(value, str | int | float):
        with contextlib.suppress(ValueError):
            fraction = float(value)
    if not 0 < fraction <= 1:
        raise ValueError(
            f"{value!r} must be one of {', '.join(GRAD_WORKER_NAMES)} or a number in (0, 1]"
        )
    return fraction


def valid_grad_worker_fractions(world_size: int) -> list[float]:
    """The fractions g/P for every divisor g of P, smallest first."""
    return [g / world_size for g in range(1, world_size + 1) if world_size % g == 0]


def _fraction_error(value: object, world_size: int, why: str) -> ValueError:
    valid = ", ".join(f"{f:g}" for f in valid_grad_worker_fractions(world_size))
    return ValueError(
        f"grad_worker_fraction={value!r} {why}; at world size {world_size} use comm-opt, "
        f"mem-opt, hybrid-opt (0.5, even world sizes) or one of: {valid}"
    )


def parse_grad_worker_fraction(value: str | float, world_size: int) -> float:
    """Resolve ``comm-opt`` (1), ``mem-opt`` (1/P), ``hybrid-opt`` (1/2) or a number ``f``
    with f·P an integer dividing P; anything else is a ``ValueError`` listing the valid values.
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size} must be >= 1")
    if isinstance(value, str):
        name = value.strip().lower().replace("_", "-")
        if name == "comm-opt":
            return 1.0
        if name == "mem-opt":
            return 1.0 / world_size
        if name == "hybrid-opt":
            if world_size == 1:
                return 1.0
            if world_size % 2:
                raise _fraction_error(value, world_size, "needs an even world size")
            return 0.5
        try:
            value = float(name)
        except ValueError:
            raise _fraction_error(value, world_size, "is not a strategy name or number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fraction_error(value, world_size, "is not a strategy name or number")
    workers = value * world_size
    count = round(workers)
    if not (0 < value <= 1) or not math.isclose(workers, count, abs_tol=1e-9):
        raise _fraction_error(value, world_size, "times the world size is not a whole rank count")
    if world_size % count:
        raise _fraction_error(value, world_size, f"gives {count} grad workers, not a divisor")
    return count / world_size
