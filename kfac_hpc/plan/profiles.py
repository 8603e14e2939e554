"""Machine and network profiles: the hardware rates the cost model turns work into time with.

A profile is a TOML file with a ``[machine]`` and a ``[network]`` table (and free-text
``[sources]``). ``--hardware NAME`` loads one shipped in ``kfac_hpc/plan/profiles/``; a path
ending in ``.toml`` (or holding a ``/``) loads a user's file. Every key has a kind and a
range in one table, ``PROFILE_FIELDS``; an unknown, missing (where required), mistyped or
out-of-range key is an error naming the file and the key.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kfac_hpc.contracts.textfile import read_user_text
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.errors import PlanInputError, shown
from kfac_hpc.plan.module_fits import MODULE_KINDS, ModuleFit
from kfac_hpc.plan.placement import ALGORITHMS, BACKENDS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "PROFILE_FIELDS",
    "MachineProfile",
    "NetworkProfile",
    "ProfileField",
    "builtin_profiles",
    "load_profile",
]


def loglog(points: tuple[tuple[float, float], ...], x: float) -> float:
    """``y`` at ``x`` on the log-log interpolation of ``points`` (x ascending, y > 0), its end
    segments' power laws beyond them."""
    index = next((i for i, (px, _) in enumerate(points[1:-1], 1) if x <= px), len(points) - 1)
    (x0, y0), (x1, y1) = points[index - 1], points[index]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * (x / x0) ** slope


def eigh_flops(n: int) -> float:
    """A symmetric eigendecomposition with eigenvectors: ≈ 9 n³ FLOPs (Golub & Van Loan)."""
    return 9.0 * n**3


@dataclass(frozen=True)
class MachineProfile:
    """One device's rates. FLOP rates are sustained (not peak) FP32 rates.

    ``eigh_flops_per_s`` counts a symmetric eigendecomposition with eigenvectors as 9·n³
    FLOPs (Golub & Van Loan); ``kernel_overhead_s`` is charged once per kernel launched.
    ``cores_per_node`` (0: as many as ranks need) and ``threads_per_rank``: ranks on a node
    that need more cores than it has share them, and their compute slows down by the ratio.
    ``step_overhead_s``: the job's time per step outside every phase (its bookkeeping).
    ``eigh_curve``: measured seconds of one eigendecomposition at sizes n, ascending (when
    given, it replaces ``eigh_flops_per_s``: see :meth:`eigh_s`). ``data_s_per_sample``: the
    data phase per sample of the local batch. ``compute_cv``: the straggler model, each rank's
    compute between two collectives varying with this coefficient of variation.
    ``conv_curve`` / ``linear_curve``: measured ``(forward FLOPs, forward s, backward s,
    factor s)`` of real layers, FLOPs ascending (when given, they replace the GEMM rate for
    that kind of layer). ``slowdown_curve``: measured ``(ranks, slowdown)`` of compute when
    that many ranks of the allocation compute at once (when given, it replaces the
    ``cores_per_node`` ratio). ``optimizer_tensor_s``: the job's optimizer update's cost per
    parameter tensor beyond its traffic (a CPU's per-tensor loop). ``kfac_forward_layer_s``:
    what the K-FAC preconditioner's forward hook adds per layer to a factor step's forward
    (keeping the input, registering the output-gradient hook). ``kfac_step_overhead_s``: the
    preconditioner's ``step()`` per step outside the phases it times (its bookkeeping: the
    job's ``other``). ``factor_average_element_s`` / ``finite_check_element_s``: seconds per
    element of the factors' running-average update (``lerp`` into a new tensor) and of the
    finiteness check's summing pass, as the preconditioner runs them after the factor
    reduction (0: not measured; priced as the elements' traffic at ``memory_bytes_per_s``);
    ``factor_average_tensor_s`` / ``finite_check_tensor_s``: their seconds per tensor (0: not
    measured; one kernel launch, ``kernel_overhead_s``).
    ``modules``: ``(kind,
    fit)`` of module kinds priced by their own shape (module_fits.py; ``[machine.modules]``
    in the file): when given, every module of a kind it holds is priced by its fit.
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
    data_s_per_sample: float = 0.0
    compute_cv: float = 0.0
    eigh_curve: tuple[tuple[int, float], ...] = ()
    conv_curve: tuple[tuple[float, float, float, float], ...] = ()
    linear_curve: tuple[tuple[float, float, float, float], ...] = ()
    slowdown_curve: tuple[tuple[int, float], ...] = ()
    optimizer_tensor_s: float = 0.0
    kfac_forward_layer_s: float = 0.0
    kfac_step_overhead_s: float = 0.0
    factor_average_element_s: float = 0.0
    factor_average_tensor_s: float = 0.0
    finite_check_element_s: float = 0.0
    finite_check_tensor_s: float = 0.0
    modules: tuple[tuple[str, ModuleFit], ...] = ()

    def module_fit(self, kind: str) -> ModuleFit | None:
        """The fit that prices modules of ``kind``; None when the profile has none."""
        return next((fit for k, fit in self.modules if k == kind), None)

    def eigh_s(self, n: int) -> float:
        """Seconds of one eigendecomposition of size ``n``: log-log interpolation of
        ``eigh_curve`` (its end segments' power laws beyond it), else 9 n³ FLOPs at
        ``eigh_flops_per_s`` plus one kernel launch."""
        if not self.eigh_curve:
            return eigh_flops(n) / self.eigh_flops_per_s + self.kernel_overhead_s
        return loglog(self.eigh_curve, n)

    def layer_s(self, kind: str, flops: float) -> tuple[float, float, float] | None:
        """Seconds of one ``kind`` layer (``conv``, ``linear``) whose forward is ``flops``:
        its forward, its backward and its factor update (K-FAC's hooks), log-log
        interpolated on the measured ``conv_curve`` / ``linear_curve``; None without one."""
        curve = self.conv_curve if kind == "conv" else self.linear_curve
        if not curve:
            return None
        forward, backward, factor = (
            loglog(tuple((p[0], p[column]) for p in curve), flops) for column in (1, 2, 3)
        )
        return forward, backward, factor


@dataclass(frozen=True)
class NetworkProfile:
    """Ranks (GPUs) per node, their link inside a node (``intra``, of kind ``intra_link``)
    and one NIC between nodes (``inter``); ``nics_per_node`` (0: one per rank) NICs a node's
    ranks share; ``backend`` (``nccl``, ``gloo``) decides which algorithm each collective
    runs, ``allreduce`` fixes one (``auto``: the backend's choice); see placement.py.

    ``measured``: ``(ranks, collective, α-β)`` fitted to one collective at one rank count on
    this machine; it gives the time of that collective over exactly that many ranks of one
    node (instead of ``intra`` and the algorithm's step counts).

    ``sync``: ``(ranks, a, b)``: a collective over that many ranks (or more, up to the next
    count) after ``T`` seconds of compute waits ``max(0, a + b·T)`` for the other ranks
    beyond its own time (measured by ``plan calibrate``; see docs/plan.md).
    """

    name: str
    ranks_per_node: int
    intra: AlphaBeta
    inter: AlphaBeta
    measured: tuple[tuple[int, str, AlphaBeta], ...] = ()
    nics_per_node: int = 0
    backend: str = "nccl"
    allreduce: str = "auto"
    intra_link: str = "nvlink"
    sync: tuple[tuple[int, float, float], ...] = ()

    @property
    def nics(self) -> int:
        """NICs per node (one per rank when ``nics_per_node`` is 0)."""
        return self.nics_per_node or self.ranks_per_node

    def measured_link(self, ranks: int, collective: str) -> AlphaBeta | None:
        return next((ab for p, c, ab in self.measured if (p, c) == (ranks, collective)), None)


def builtin_profiles() -> list[str]:
    root = resources.files("kfac_hpc.plan") / "profiles"
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


@dataclass(frozen=True)
class ProfileField:
    """One key of a profile: its table, kind (``float`` or ``int``; TOML integers count as
    floats, floats never as integers), valid range ``[low, high]`` and default (``None``:
    every profile must set it)."""

    section: str
    key: str
    kind: str
    low: float
    high: float
    default: float | None = None
    unit: str = ""

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"


# Every key of a profile, with its range: far past any real machine, far from where the cost
# model's products overflow or its quotients blow up (a rate of 1e-300 gives inf seconds).
PROFILE_FIELDS: tuple[ProfileField, ...] = (
    ProfileField("machine", "gemm_flops_per_s", "float", 1e6, 1e18, unit="FLOP/s"),
    ProfileField("machine", "eigh_flops_per_s", "float", 1e6, 1e18, unit="FLOP/s"),
    ProfileField("machine", "memory_bytes_per_s", "float", 1e6, 1e16, unit="B/s"),
    ProfileField("machine", "memory_bytes", "float", 2**20, 1e15, unit="B"),
    ProfileField("machine", "kernel_overhead_s", "float", 0.0, 1.0, 0.0, "s"),
    ProfileField("machine", "cores_per_node", "int", 0, 65536, 0),
    ProfileField("machine", "threads_per_rank", "int", 1, 4096, 1),
    ProfileField("machine", "step_overhead_s", "float", 0.0, 60.0, 0.0, "s"),
    ProfileField("machine", "data_s_per_sample", "float", 0.0, 60.0, 0.0, "s"),
    ProfileField("machine", "compute_cv", "float", 0.0, 1.0, 0.0),
    ProfileField("machine", "optimizer_tensor_s", "float", 0.0, 1.0, 0.0, "s"),
    ProfileField("machine", "kfac_forward_layer_s", "float", 0.0, 1.0, 0.0, "s"),
    ProfileField("machine", "kfac_step_overhead_s", "float", 0.0, 60.0, 0.0, "s"),
    ProfileField("machine", "factor_average_element_s", "float", 0.0, 1e-3, 0.0, "s"),
    ProfileField("machine", "factor_average_tensor_s", "float", 0.0, 1.0, 0.0, "s"),
    ProfileField("machine", "finite_check_element_s", "float", 0.0, 1e-3, 0.0, "s"),
    ProfileField("machine", "finite_check_tensor_s", "float", 0.0, 1.0, 0.0, "s"),
    ProfileField("network", "ranks_per_node", "int", 1, 1024),
    ProfileField("network", "nics_per_node", "int", 0, 1024, 0),
    *(
        field
        for link in ("network.intra", "network.inter")
        for field in (
            ProfileField(link, "latency_s", "float", 0.0, 1.0, unit="s"),
            ProfileField(link, "bandwidth_bytes_per_s", "float", 1e3, 1e15, unit="B/s"),
        )
    ),
)
_DEVICE_CHARS = 100
# a profile's text keys with a fixed set of values (table.key -> (values, default))
PROFILE_CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "network.backend": (tuple(BACKENDS), "nccl"),
    "network.allreduce": (("auto", *ALGORITHMS["allreduce"]), "auto"),
    "network.intra.kind": (("nvlink", "pcie", "shm"), "nvlink"),
}


def _fmt(value: float) -> str:
    return f"{value:g}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _value(table: dict[str, Any], field: ProfileField) -> float:
    """The checked value of ``field`` in its ``table``; PlanInputError naming it if bad."""
    if field.key not in table:
        if field.default is None:
            raise PlanInputError(field.name, "missing; every profile must set it")
        return field.default
    value = table[field.key]
    is_int = isinstance(value, int) and not isinstance(value, bool)
    fits = is_int or (field.kind == "float" and isinstance(value, float))
    if not (fits and math.isfinite(value) and field.low <= value <= field.high):
        kind = "an integer" if field.kind == "int" else "a number"
        unit = f" {field.unit}" if field.unit else ""
        raise PlanInputError(
            field.name,
            f"{_short(value)} must be {kind} in [{_fmt(field.low)}, {_fmt(field.high)}]{unit}",
        )
    return int(value) if field.kind == "int" else float(value)


def _check_keys(table: dict[str, Any], section: str, allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise PlanInputError(
                f"{section}.{key}", f"unknown key; valid: {', '.join(sorted(allowed))}"
            )


def _values(
    table: dict[str, Any], section: str, extra: frozenset[str] = frozenset()
) -> dict[str, Any]:
    mine = [f for f in PROFILE_FIELDS if f.section == section]
    _check_keys(table, section, {f.key for f in mine} | extra)
    return {f.key: _value(table, f) for f in mine}


_MAX_CURVE = 64  # points of a curve (machine.eigh_curve, ...)
Column = tuple[str, float, float, bool]  # kind (int / float), low, high, low excluded


def _entry_ok(entry: Any, column: Column) -> bool:
    kind, low, high, open_low = column
    if isinstance(entry, bool) or not isinstance(entry, int | float):
        return False
    if kind == "int" and not isinstance(entry, int):
        return False
    above = entry > low if open_low else entry >= low
    return math.isfinite(entry) and above and entry <= high


def _curve(value: Any, name: str, columns: tuple[Column, ...], fix: str) -> tuple[Any, ...]:
    """The checked curve ``name``: 2 (1 for a table of values by rank count) to 64 rows of
    ``columns``, the first strictly ascending; PlanInputError naming it (with ``fix``)
    otherwise."""
    least = 1 if name in _BY_RANKS else 2
    fix = f"must be {least} to {_MAX_CURVE} {fix}"
    if not isinstance(value, list) or not least <= len(value) <= _MAX_CURVE:
        raise PlanInputError(name, fix)
    points = []
    for row in value:
        ok = isinstance(row, list) and len(row) == len(columns)
        if not (ok and all(_entry_ok(e, c) for e, c in zip(row, columns, strict=True))):
            raise PlanInputError(name, f"{_short(row)}: {fix}")
        pairs = zip(row, columns, strict=True)
        points.append(tuple(int(e) if c[0] == "int" else float(e) for e, c in pairs))
    if any(b[0] <= a[0] for a, b in itertools.pairwise(points)):
        raise PlanInputError(name, f"first entries are not ascending: {fix}")
    return tuple(points)


_BY_RANKS = ("machine.slowdown_curve", "network.sync")  # step functions of P: 1 row will do
_SECONDS: Column = ("float", 0.0, 1e6, True)
_LAYER = (("float", 0.0, 1e18, True), _SECONDS, _SECONDS, _SECONDS)
# the curves a profile may hold: table.key -> (columns, what they must be)
PROFILE_CURVES: dict[str, tuple[tuple[Column, ...], str]] = {
    "machine.eigh_curve": (
        (("int", 1, 2**20, False), _SECONDS),
        "[n, seconds] pairs, n ascending integers, seconds > 0",
    ),
    "machine.conv_curve": (
        _LAYER,
        "[forward_flops, forward_s, backward_s, factor_s] rows, FLOPs ascending, all > 0",
    ),
    "machine.linear_curve": (
        _LAYER,
        "[forward_flops, forward_s, backward_s, factor_s] rows, FLOPs ascending, all > 0",
    ),
    "machine.slowdown_curve": (
        (("int", 1, 2**20, False), ("float", 0.01, 1000.0, False)),
        "[ranks, slowdown] pairs, ranks ascending integers, slowdown in [0.01, 1000]",
    ),
    "network.sync": (
        (("int", 2, 2**20, False), ("float", -1.0, 1.0, False), ("float", -100.0, 100.0, False)),
        "[ranks, a_s, b] rows, ranks ascending integers >= 2, a_s in [-1, 1], b in [-100, 100]",
    ),
}


def _curves(table: dict[str, Any], section: str) -> dict[str, Any]:
    """The checked curves of ``section`` that ``table`` holds, by key."""
    out = {}
    for name, (columns, fix) in PROFILE_CURVES.items():
        table_name, key = name.rsplit(".", 1)
        if table_name == section and key in table:
            out[key] = _curve(table[key], name, columns, fix)
    return out


_MODULE_FIX = (
    "must be 6 numbers in [0, 1]: forward s per call, s per FLOP, s per element, then the "
    "backward's"
)


def _module_fits(table: Any) -> tuple[tuple[str, ModuleFit], ...]:
    """The checked ``[machine.modules]`` table: ``kind = [6 coefficients]``."""
    if not isinstance(table, dict):
        raise PlanInputError("machine.modules", "must be a table of kind = [6 numbers]")
    _check_keys(table, "machine.modules", set(MODULE_KINDS))
    fits = []
    for kind, row in table.items():
        column: Column = ("float", 0.0, 1.0, False)
        ok = isinstance(row, list) and len(row) == 6
        if not (ok and all(_entry_ok(e, column) for e in row)):
            raise PlanInputError(f"machine.modules.{kind}", f"{_short(row)}: {_MODULE_FIX}")
        values = [float(e) for e in row]
        forward = (values[0], values[1], values[2])
        fits.append((kind, ModuleFit(forward, (values[3], values[4], values[5]))))
    return tuple(fits)


def _machine(name: str, table: dict[str, Any]) -> MachineProfile:
    curves = _curves(table, "machine")
    modules = _module_fits(table["modules"]) if "modules" in table else ()
    extra = frozenset({"device", "modules", *_keys_of("machine")})
    values = _values(table, "machine", extra)
    device = table.get("device", shown(name))
    if not isinstance(device, str) or not device.isprintable() or len(device) > _DEVICE_CHARS:
        raise PlanInputError(
            "machine.device", f"must be a one-line string of at most {_DEVICE_CHARS} characters"
        )
    cores, threads = values["cores_per_node"], values["threads_per_rank"]
    if cores and threads > cores:
        raise PlanInputError(
            "machine.threads_per_rank",
            f"{threads} is more than cores_per_node ({cores}); at most the node's cores",
        )
    return MachineProfile(device, **values, **curves, modules=modules)


def _keys_of(section: str) -> set[str]:
    """The curve keys of ``section``."""
    return {n.rsplit(".", 1)[1] for n in PROFILE_CURVES if n.rsplit(".", 1)[0] == section}


def _choice(table: dict[str, Any], section: str, key: str) -> str:
    """The checked value of the text key ``section.key`` of PROFILE_CHOICES."""
    values, default = PROFILE_CHOICES[f"{section}.{key}"]
    value = table.get(key, default)
    if value not in values:
        raise PlanInputError(
            f"{section}.{key}", f"{_short(value)} must be one of {', '.join(values)}"
        )
    return str(value)


def _link(table: Any, section: str, extra: frozenset[str] = frozenset()) -> AlphaBeta:
    if not isinstance(table, dict):
        raise PlanInputError(section, "missing table (latency_s, bandwidth_bytes_per_s)")
    values = _values(table, section, extra)
    return AlphaBeta(values["latency_s"], 1.0 / values["bandwidth_bytes_per_s"])


def _network(name: str, table: dict[str, Any]) -> NetworkProfile:
    keys = {"intra", "inter", "backend", "allreduce", *_keys_of("network")}
    scalars = {k: v for k, v in table.items() if k not in keys}
    values = _values(scalars, "network", frozenset(keys))
    intra_table = table.get("intra")
    intra = _link(intra_table, "network.intra", frozenset({"kind"}))
    inter = _link(table.get("inter"), "network.inter")
    assert isinstance(intra_table, dict)
    return NetworkProfile(
        name,
        values["ranks_per_node"],
        intra,
        inter,
        nics_per_node=values["nics_per_node"],
        backend=_choice(table, "network", "backend"),
        allreduce=_choice(table, "network", "allreduce"),
        intra_link=_choice(intra_table, "network.intra", "kind"),
        **_curves(table, "network"),
    )


def load_profile(name_or_path: str) -> tuple[MachineProfile, NetworkProfile]:
    """A shipped profile by name or a TOML file by path (read up to 1 MiB). PlanInputError
    (field ``hardware``, plan's flag) naming the file, and the key when one is bad."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        text = read_user_text(Path(name_or_path), "hardware", error=PlanInputError)
    else:
        if name_or_path not in builtin_profiles():
            raise PlanInputError(
                "hardware",
                f"{name_or_path!r} is not a shipped profile "
                f"({', '.join(builtin_profiles())}) nor a .toml path",
            )
        text = (resources.files("kfac_hpc.plan") / "profiles" / f"{name_or_path}.toml").read_text()
    where = shown(name_or_path)
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise PlanInputError("hardware", f"{where} is not valid TOML: {reason}") from None
    try:
        _check_keys(data, "profile", {"machine", "network", "memory", "sources"})
        for section in ("machine", "network"):
            if not isinstance(data.get(section), dict):
                raise PlanInputError(section, f"missing [{section}] table")
        name = Path(name_or_path).stem
        return _machine(name, data["machine"]), _network(name, data["network"])
    except PlanInputError as exc:
        raise PlanInputError("hardware", f"{where}: {exc.field}: {exc.reason}") from None
