"""The click command ``plan``: parse, call the planner, print the table (and plot, sweep).

Bad input is one line on stderr naming the flag (``kfac-hpc plan: error: --flag: ...``), exit
code 2, nothing written (cli_errors.py); every check runs before the measurement or the
prediction. Options the job has too (``--batch-size``, ``--fosi-k``, ...) take their kind,
default, help and range from the job's option table (contracts/options.py; where plan's default
differs on purpose, the table's ``plan_default`` says why); profiles from their own table
(profiles.PROFILE_FIELDS).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kfac_hpc.cli_errors import guard
from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.option_values import check_value
from kfac_hpc.contracts.options import DATASETS, OPTIONS
from kfac_hpc.plan.errors import PlanInputError, check_planned, shown
from kfac_hpc.plan.model import ALL_METHODS, METHODS
from kfac_hpc.plan.profiles import PROFILE_FIELDS, builtin_profiles
from kfac_hpc.plan.site import EIGH_SIZES

__all__ = ["plan"]

_DEFAULT_RANKS = "1,2,4,8,16,32,64,128,256,512,1024"
MAX_RANKS = 2**20  # a rank count of --ranks
MAX_RANK_COUNTS = 64  # values in --ranks
MAX_CALIBRATION_RANKS = 64  # local processes per calibration
MAX_CALIBRATION_COUNTS = 8  # values in --calibration-ranks
MIN_BUCKET_MB = 2**-10  # --bucket-mb: 1 KiB
# plan's flags that are options of the job too (flag's name -> option): their kind, default,
# help and range are the table's
_JOB_OPTIONS = {
    "model": "model",
    "dataset": "dataset",
    "batch_size": "batch_size",
    "scaling": "scaling",
    "fosi_k": "fosi_k",
    "fosi_l": "fosi_l",
    "ese_every": "ese_every",
    "lanczos_iters": "lanczos_iters",
    "fosi_curvature_fraction": "fosi_curvature_fraction",
    "fosi_lanczos_dtype": "fosi_lanczos_dtype",
    "fosi_reorthogonalize": "fosi_reorthogonalize",
    "fosi_keep_basis": "fosi_keep_basis",
    "factor_update_steps": "factor_update_steps",
    "inv_update_steps": "inv_update_steps",
    "bucket_mb": "allreduce_bucket_cap_mb",
    "steps": "steps",
}
# the FOSI flags, PlanConfig's fields of the same names
_FOSI_FLAGS = (
    "fosi_k",
    "fosi_l",
    "ese_every",
    "lanczos_iters",
    "fosi_curvature_fraction",
    "fosi_lanczos_dtype",
    "fosi_reorthogonalize",
    "fosi_keep_basis",
)
_RANKS_PER_NODE = next(f for f in PROFILE_FIELDS if f.name == "network.ranks_per_node")
_PLOT_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}
# plan's hardware profile was --profile, the word the sweep uses for its site profile
_OLD_PROFILE = (
    "is the sweep's site profile (kfac-hpc sweep --profile); plan's hardware profile is "
    "--hardware NAME|PATH.toml"
)


def plan_default(field: str) -> Any:
    """The default of plan's flag ``field`` (a job option): the table's ``plan_default`` where
    plan's differs on purpose, else the job's."""
    option = OPTIONS[_JOB_OPTIONS[field]]
    return option.default if option.plan_default is None else option.plan_default.value


def _job_flag(field: str, note: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """plan's flag ``--FIELD`` of a job option, made from the option table."""
    option = OPTIONS[_JOB_OPTIONS[field]]
    text = f"As kfac-hpc train's {option.flag}: {option.describe()}{note}."
    if option.plan_default is not None:
        train = "none" if option.default is None else option.default
        text += f" kfac-hpc train's default: {train}."
    flag = "--" + field.replace("_", "-")
    if option.kind == "bool":  # as kfac-hpc train spells it
        decls = f"{flag}/--no-{flag[2:]}"
        return click.option(decls, default=plan_default(field), show_default=True, help=text)
    kind = {"int": int, "float": float}.get(option.kind, str)
    return click.option(flag, type=kind, default=plan_default(field), show_default=True, help=text)


def _output_file(
    flag: str, what: str, required: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A flag naming a file plan writes (atomically, into an existing folder)."""
    text = f"{what}; its folder must exist; replaced atomically."
    return click.option(flag, default=None, required=required, metavar="FILE", help=text)


def _int_list(field: str, text: str, low: int, high: int, most: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise PlanInputError(
            field, f"{shown(text)!r} is not a comma-separated list of integers"
        ) from None
    if any(not low <= v <= high for v in values):
        raise PlanInputError(field, f"{shown(text)!r}: every value must be in [{low}, {high}]")
    if len(set(values)) > most:
        raise PlanInputError(field, f"{len(set(values))} values; give at most {most}")
    return sorted(set(values))


def _methods(text: str) -> list[str]:
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not methods:
        raise PlanInputError("methods", f"empty; give one or more of {', '.join(ALL_METHODS)}")
    for method in methods:  # checked here too: before a calibration spends seconds
        if method not in ALL_METHODS:
            raise PlanInputError(
                "methods", f"{shown(method)!r} is not one of {', '.join(ALL_METHODS)}"
            )
    return methods


def _check_options(o: dict[str, Any]) -> None:
    """Every value against the job's option table (kind, range, choices) and plan's own."""
    for field, name in _JOB_OPTIONS.items():
        try:
            check_value(OPTIONS[name], o[field])
        except InputError as exc:
            raise PlanInputError(field, exc.reason) from None
    check_planned(o["model"], o["dataset"])
    if o["bucket_mb"] < MIN_BUCKET_MB:  # the table's "> 0" lets 1e-300 MiB give 1e300 buckets
        raise PlanInputError(
            "bucket_mb", f"{o['bucket_mb']!r} must be >= {MIN_BUCKET_MB} (1 KiB per bucket)"
        )
    if o["fosi_k"] < 1:
        raise PlanInputError("fosi_k", f"{o['fosi_k']} must be >= 1 (the eigenpairs FOSI uses)")
    pairs = o["fosi_k"] + o["fosi_l"]
    if o["lanczos_iters"] is not None and o["lanczos_iters"] < pairs:  # as the job checks it
        raise PlanInputError(
            "lanczos_iters", f"{o['lanczos_iters']} must be >= k + l = {pairs}, or left out"
        )
    low, high = int(_RANKS_PER_NODE.low), int(_RANKS_PER_NODE.high)
    if not low <= o["ranks_per_node"] <= high:
        raise PlanInputError("ranks_per_node", f"{o['ranks_per_node']} must be in [{low}, {high}]")


def _outputs(o: dict[str, Any]) -> tuple[Path | None, Path | None]:
    """The checked paths of --plot and --write-sweep (None: not asked for)."""
    from kfac_hpc.plan.files import check_output

    plot = sweep = None
    if o["plot"] is not None:
        plot = check_output("plot", o["plot"])
        if plot.suffix.lower() not in _PLOT_FORMATS:
            raise PlanInputError(
                "plot", f"{shown(plot.name)!r} must end in {', '.join(_PLOT_FORMATS)}"
            )
        if importlib.util.find_spec("matplotlib") is None:
            raise PlanInputError("plot", "needs matplotlib (pip install matplotlib)")
    if o["write_sweep"] is not None:
        sweep = check_output("write_sweep", o["write_sweep"])
    if plot is not None and plot == sweep:
        raise PlanInputError("write_sweep", "is the --plot file too; give two different files")
    return plot, sweep


@click.group("plan", invoke_without_command=True)
@_job_flag("model", " (cnn1d takes --dataset mnist1d)")
@_job_flag("dataset", " (its input shape: no data files needed)")
@_job_flag("batch_size")
@_job_flag("scaling")
@click.option(
    "--ranks",
    default=_DEFAULT_RANKS,
    show_default=True,
    help=f"Rank counts P (at most {MAX_RANK_COUNTS} values, each <= {MAX_RANKS}).",
)
@click.option(
    "--methods", default=",".join(METHODS), show_default=True, help="Also: fosi (FOSI / DHO2)."
)
@_job_flag("fosi_k", " (--methods fosi)")
@_job_flag("fosi_l", " (--methods fosi)")
@_job_flag("ese_every", " (--methods fosi)")
@_job_flag("lanczos_iters", " (--methods fosi)")
@_job_flag("fosi_curvature_fraction", " (--methods fosi)")
@_job_flag("fosi_lanczos_dtype", " (--methods fosi)")
@_job_flag("fosi_reorthogonalize", " (--methods fosi)")
@_job_flag("fosi_keep_basis", " (--methods fosi)")
@_job_flag("factor_update_steps")
@_job_flag("inv_update_steps")
@_job_flag("bucket_mb")
@click.option(
    "--hardware",
    default=None,
    help="Hardware profile (devices, nodes, NICs, links): shipped name ("
    + ", ".join(builtin_profiles())
    + ") or PATH.toml, e.g. one written by kfac-hpc plan calibrate "
    "[default: measure this machine, on synthetic input of the dataset's shape].",
)
@click.option("--profile", "old_profile", default=None, hidden=True)
@click.option(
    "--calibration-ranks",
    default="2,4",
    show_default=True,
    help=f"Local gloo ranks (each 2..{MAX_CALIBRATION_RANKS}).",
)
@_output_file("--plot", "Image of the curves (.png, .pdf or .svg)")
@_output_file("--write-sweep", "Sweep TOML of the recommendation")
@click.option(
    "--ranks-per-node",
    type=int,
    default=1,
    show_default=True,
    help=f"For --write-sweep (1..{int(_RANKS_PER_NODE.high)}).",
)
@_job_flag("steps", " (of the sweep --write-sweep writes)")
@click.option(
    "--explain",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="SWEEP_DIR",
    help="Predict every finished run of SWEEP_DIR (its own settings) into "
    "SWEEP_DIR/predicted.json, which kfac-hpc report shows beside the measurements.",
)
@guard("plan", failures=((RuntimeError, "error: measuring this machine failed"),))
def plan(**options: Any) -> None:
    """Predict step time per phase and memory per rank for each method and K-FAC strategy.

    Bad input is one line on stderr naming the flag, exit code 2, and nothing written.
    ``kfac-hpc plan calibrate --out site.toml`` (inside an allocation) measures a hardware
    profile for --hardware.
    """
    if click.get_current_context().invoked_subcommand is not None:
        return
    try:
        _plan(**options)
    except InputError as exc:
        flag = "--" + exc.field.replace("_", "-") if exc.field in options else exc.field
        raise InputError(flag, " ".join(str(exc.reason).split())) from None


def _plan(**o: Any) -> None:
    from kfac_hpc.plan.files import write_atomic
    from kfac_hpc.plan.output import best_by_ranks, plot_bytes, sweep_toml, table_lines
    from kfac_hpc.plan.planner import build_cost_model, predict_all

    if o["old_profile"] is not None:
        raise PlanInputError("--profile", _OLD_PROFILE)

    ranks = _int_list("ranks", o["ranks"], 1, MAX_RANKS, MAX_RANK_COUNTS)
    methods = _methods(o["methods"])
    _check_options(o)
    calibration = _int_list(
        "calibration_ranks",
        o["calibration_ranks"],
        2,
        MAX_CALIBRATION_RANKS,
        MAX_CALIBRATION_COUNTS,
    )
    if o["explain"] is not None:
        from kfac_hpc.plan.explain import explain_sweep

        for field in ("plot", "write_sweep"):
            if o[field] is not None:
                raise PlanInputError(field, "does not apply with --explain; leave it out")
        if not o["explain"].is_dir():
            raise PlanInputError("explain", f"{shown(str(o['explain']))} is not a directory")
        path, count = explain_sweep(o["explain"], o["hardware"], calibration)
        click.echo(f"predictions of {count} run(s): {path} (kfac-hpc report {o['explain']})")
        return
    plot_path, sweep_path = _outputs(o)
    planned = build_cost_model(
        o["model"], o["dataset"], o["hardware"], calibration, o["batch_size"]
    )
    predictions = predict_all(
        planned,
        methods,
        ranks,
        o["batch_size"],
        o["scaling"],
        o["factor_update_steps"],
        o["inv_update_steps"],
        o["bucket_mb"],
        **{field: o[field] for field in _FOSI_FLAGS},
    )
    for pred in predictions:
        if not all(math.isfinite(v) for v in (pred.step_s, pred.memory_bytes)):
            raise PlanInputError(
                "batch_size",
                f"the prediction of {pred.config.method} at {pred.config.ranks} ranks is not a "
                "finite number; plan a smaller batch, rank count or --fosi-k",
            )
    files: list[tuple[str, Path, bytes]] = []
    if sweep_path is not None:
        best = best_by_ranks(predictions, planned.memory_limit)
        try:
            text = sweep_toml(best, o["model"], o["dataset"], o["ranks_per_node"], o["steps"])
        except ValueError:
            raise PlanInputError(
                "ranks_per_node",
                f"{o['ranks_per_node']}: no recommended rank count is a multiple of it; give a "
                "divisor of one of --ranks",
            ) from None
        files.append(("write_sweep", sweep_path, text.encode("utf-8")))
    if plot_path is not None:
        title = f"{o['model']}: {planned.source}"
        image = plot_bytes(predictions, title, _PLOT_FORMATS[plot_path.suffix.lower()])
        files.append(("plot", plot_path, image))
    write_atomic(files)
    click.echo(
        f"{o['model']} on {o['dataset']}, batch {o['batch_size']} ({o['scaling']}); "
        f"{planned.source}"
    )
    click.echo(
        "milliseconds per step (K-FAC work amortized over its interval); * = best K-FAC strategy"
    )
    for line in table_lines(predictions, planned.memory_limit):
        click.echo(line)
    if plot_path is not None:
        click.echo(f"plot: {plot_path}")
    if sweep_path is not None:
        click.echo(f"sweep file: {sweep_path} (run: kfac-hpc sweep -f {sweep_path})")


@plan.command("calibrate")
@_output_file("--out", "The hardware profile to write (TOML)", required=True)
@click.option(
    "--backend",
    type=click.Choice(list(OPTIONS["backend"].choices or ())),
    default=OPTIONS["backend"].default,
    show_default=True,
    help=f"As kfac-hpc train's --backend: {OPTIONS['backend'].help}.",
)
@click.option(
    "--eigh-sizes",
    default=",".join(map(str, EIGH_SIZES)),
    show_default=True,
    help=f"Eigendecomposition sizes n to time (2 to {MAX_CALIBRATION_COUNTS}, each <= 16384).",
)
@click.option(
    "--dataset",
    type=click.Choice(list(DATASETS)),
    default="digits",
    show_default=True,
    help="The input pipeline the job's data phase and step overhead are measured on (a "
    "1-rank run; a dataset read from files: the synthetic one of its shape).",
)
@click.option(
    "--model",
    default=None,
    help="A model (as plan's --model) whose own modules, on --dataset's input, are timed "
    "too for the module kinds' fits [default: the generic shapes only].",
)
@guard("plan calibrate", failures=((RuntimeError, "error: calibrating failed"),))
def calibrate(out: str, backend: str, eigh_sizes: str, dataset: str, model: str | None) -> None:
    """Measure this allocation's links (inside and between nodes), eigendecomposition, GEMM
    and real-layer rates, the compute slowdown and the waits by ranks at once and the job's
    own overhead, and write a hardware profile: run on every rank, e.g. ``srun -N 2
    --ntasks-per-node 4 kfac-hpc plan calibrate --out site.toml``."""
    from kfac_hpc.plan.files import check_output
    from kfac_hpc.plan.site import calibrate_site

    sizes = _int_list("--eigh-sizes", eigh_sizes, 2, 16384, MAX_CALIBRATION_COUNTS)
    if len(sizes) < 2:
        raise PlanInputError("--eigh-sizes", "give at least 2 sizes (the curve's two ends)")
    path = check_output("--out", out)
    if model is not None:
        from kfac_hpc.plan.layers import build_network

        try:  # a bad --model fails here, before any measurement
            build_network(model, dataset)
        except PlanInputError as exc:
            raise PlanInputError("--model", exc.reason) from None
    chosen = None if backend == "auto" else backend
    text = calibrate_site(path, chosen, tuple(sizes), dataset, model)
    if text is not None:
        click.echo(f"hardware profile: {path} (use: kfac-hpc plan --hardware {path})")
