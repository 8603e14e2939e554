"""Machine and network profiles: the hardware rates the cost model turns work into time with.

A profile is a TOML file with a ``[machine]`` and a ``[network]`` table (and free-text
``[sources]``). ``--profile NAME`` loads one shipped in ``kfac_hpc/plan/profiles/``; a path
ending in ``.toml`` loads a user's file. Unknown or missing keys are errors.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.errors import PlanInputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["MachineProfile", "NetworkProfile", "builtin_profiles", "load_profile"]


@dataclass(frozen=True)
class MachineProfile:
    """One device's rates. FLOP rates are sustained (not peak) FP32 rates.

    ``eigh_flops_per_s`` counts a symmetric eigendecomposition with eigenvectors as 9·n³
    FLOPs (Golub & Van Loan); ``kernel_overhead_s`` is charged once per kernel launched.
    ``cores_per_node`` (0: as many as ranks need) and ``threads_per_rank``: ranks on a node
    that need more cores than it has share them, and their compute slows down by the ratio.
    ``step_overhead_s``: the job's time per step outside every phase (its bookkeeping).
    """

    name: str
    gemm_flops_per_s: float
    eigh_flops_per_s: float
    memory_bytes_per_s: float
    memory_bytes: float
    kernel_overhead_s: float = 0.0
    cores_per_node: int = 0
    threads_per_rank: int = 1
    step_overhead_s: float = 0.0


@dataclass(frozen=True)
class NetworkProfile:
    """Links inside a node (``intra``) and between nodes (``inter``, per rank's NIC).

    ``measured``: ``(ranks, collective, α-β)`` fitted to one collective at one rank count on
    this machine; it gives the time of that collective over exactly that many ranks of one
    node (instead of ``intra`` and the algorithm's step counts).
    """

    name: str
    ranks_per_node: int
    intra: AlphaBeta
    inter: AlphaBeta
    measured: tuple[tuple[int, str, AlphaBeta], ...] = ()

    def measured_link(self, ranks: int, collective: str) -> AlphaBeta | None:
        return next((ab for p, c, ab in self.measured if (p, c) == (ranks, collective)), None)


def builtin_profiles() -> list[str]:
    root = resources.files("kfac_hpc.plan") / "profiles"
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def _number(table: dict[str, Any], section: str, key: str) -> float:
    if key not in table:
        raise PlanInputError(f"{section}.{key}", "missing; every profile must set it")
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanInputError(f"{section}.{key}", f"{value!r} is not a number")
    if not math.isfinite(value) or value < 0:
        raise PlanInputError(f"{section}.{key}", f"{value!r} must be a finite number >= 0")
    return float(value)


def _check_keys(table: dict[str, Any], section: str, allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise PlanInputError(
                f"{section}.{key}", f"unknown key; valid: {', '.join(sorted(allowed))}"
            )


_OPTIONAL = {"kernel_overhead_s", "cores_per_node", "threads_per_rank", "step_overhead_s"}
_COUNTS = ("cores_per_node", "threads_per_rank")


def _machine(name: str, table: dict[str, Any]) -> MachineProfile:
    keys = {f.name for f in fields(MachineProfile)} - {"name"}
    _check_keys(table, "machine", keys | {"device"})
    values: dict[str, Any] = {
        k: _number(table, "machine", k) for k in keys if k not in _OPTIONAL or k in table
    }
    for key in ("gemm_flops_per_s", "eigh_flops_per_s", "memory_bytes_per_s"):
        if values[key] == 0:
            raise PlanInputError(f"machine.{key}", "must be > 0")
    for key in _COUNTS:
        if key in values:
            low = 1 if key == "threads_per_rank" else 0
            if not isinstance(table[key], int) or table[key] < low:
                raise PlanInputError(
                    f"machine.{key}", f"{table[key]!r} must be an integer >= {low}"
                )
            values[key] = int(table[key])
    return MachineProfile(str(table.get("device", name)), **values)


def _link(table: dict[str, Any], section: str) -> AlphaBeta:
    _check_keys(table, section, {"latency_s", "bandwidth_bytes_per_s"})
    bandwidth = _number(table, section, "bandwidth_bytes_per_s")
    if bandwidth == 0:
        raise PlanInputError(f"{section}.bandwidth_bytes_per_s", "must be > 0")
    return AlphaBeta(_number(table, section, "latency_s"), 1.0 / bandwidth)


def _network(name: str, table: dict[str, Any]) -> NetworkProfile:
    _check_keys(table, "network", {"ranks_per_node", "intra", "inter"})
    ranks = table.get("ranks_per_node")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlanInputError("network.ranks_per_node", f"{ranks!r} must be an integer >= 1")
    for sub in ("intra", "inter"):
        if not isinstance(table.get(sub), dict):
            raise PlanInputError(
                f"network.{sub}", "missing table (latency_s, bandwidth_bytes_per_s)"
            )
    return NetworkProfile(
        name, ranks, _link(table["intra"], "network.intra"), _link(table["inter"], "network.inter")
    )


def load_profile(name_or_path: str) -> tuple[MachineProfile, NetworkProfile]:
    """A shipped profile by name or a TOML file by path."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlanInputError("profile", f"cannot read {path}: {exc.strerror}") from None
    else:
        if name_or_path not in builtin_profiles():
            raise PlanInputError(
                "profile",
                f"{name_or_path!r} is not a shipped profile ({', '.join(builtin_profiles())}) "
                "nor a .toml path",
            )
        text = (resources.files("kfac_hpc.plan") / "profiles" / f"{name_or_path}.toml").read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlanInputError("profile", f"{name_or_path} is not valid TOML: {exc}") from None
    _check_keys(data, "profile", {"machine", "network", "sources"})
    for section in ("machine", "network"):
        if not isinstance(data.get(section), dict):
            raise PlanInputError(section, f"missing [{section}] table in {name_or_path}")
    name = Path(name_or_path).stem
    return _machine(name, data["machine"]), _network(name, data["network"])
