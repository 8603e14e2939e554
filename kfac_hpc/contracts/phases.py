"""The timing phases of docs/contracts.md: one definition for the optimizer, the job and the
collector (no imports, so every layer may use it)."""

from __future__ import annotations

__all__ = ["COMM_PHASES", "FOSI_PHASES", "KFAC_PHASES", "PHASES", "REPORTED_PHASES"]

# Every phase of a training step, in contract order (seconds per step).
PHASES: tuple[str, ...] = (
    "data",
    "forward",
    "backward",
    "factor_compute",
    "factor_comm",
    "inverse_compute",
    "inverse_comm",
    "precondition",
    "grad_broadcast",
    "grad_allreduce",
    "optimizer",
    "checkpoint",
)
# The phases the K-FAC preconditioner measures in `last_timings`.
KFAC_PHASES: tuple[str, ...] = PHASES[3:9]
# Phases that are communication; their share of a step is the communication fraction.
# ("grad_allreduce" is the gradient's reduction, whatever the collective: FOSI reduce-scatters.)
COMM_PHASES: tuple[str, ...] = (
    "factor_comm",
    "inverse_comm",
    "grad_broadcast",
    "grad_allreduce",
    "param_allgather",
)
# FOSI's own phases: the extreme-spectrum estimation (Lanczos on Hessian-vector products), and
# the all-gather of the parameter slices every rank updated (ZeRO-1).
FOSI_PHASES: tuple[str, ...] = ("ese", "param_allgather")
# The phases the collector and report show: the contract's and the methods' own.
REPORTED_PHASES: tuple[str, ...] = PHASES + FOSI_PHASES
