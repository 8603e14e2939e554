"""The click command ``plan``: parse, call the planner, print the table (and plot, sweep)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.model import ALL_METHODS, METHODS

__all__ = ["plan"]

_DEFAULT_RANKS = "1,2,4,8,16,32,64,128,256,512,1024"


def _int_list(field: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise PlanInputError(field, f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 1 for v in values):
        raise PlanInputError(field, f"{text!r}: every value must be >= 1")
    return sorted(set(values))


def _positive(field: str, value: float) -> None:
    if not value > 0:
        raise PlanInputError(field, f"{value} must be > 0")


@click.command("plan")
@click.option("--model", default="resnet32", show_default=True, help="Model of kfac-hpc train.")
@click.option("--dataset", default="cifar10", show_default=True, help="Dataset (input shape).")
@click.option("--batch-size", type=int, default=1024, show_default=True, help="Batch size.")
@click.option(
    "--scaling", type=click.Choice(["strong", "weak"]), default="strong", show_default=True
)
@click.option("--ranks", default=_DEFAULT_RANKS, show_default=True, help="Rank counts P.")
@click.option(
    "--methods", default=",".join(METHODS), show_default=True, help="Also: fosi (FOSI / DHO2)."
)
@click.option("--fosi-k", type=int, default=10, show_default=True, help="FOSI: eigenpairs k.")
@click.option("--ese-every", type=int, default=100, show_default=True, help="FOSI: ESE interval.")
@click.option("--factor-update-steps", type=int, default=10, show_default=True)
@click.option("--inv-update-steps", type=int, default=100, show_default=True)
@click.option("--bucket-mb", type=float, default=25.0, show_default=True, help="Bucket cap (MiB).")
@click.option(
    "--profile",
    default=None,
    help="Machine+network profile: shipped name (a100-hdr200) or PATH.toml "
    "[default: measure this machine].",
)
@click.option("--calibration-ranks", default="2,4", show_default=True, help="Local gloo ranks.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG of the curves.")
@click.option("--write-sweep", type=click.Path(dir_okay=False), default=None, help="Sweep TOML.")
@click.option("--ranks-per-node", type=int, default=1, show_default=True, help="For --write-sweep.")
@click.option("--steps", type=int, default=100, show_default=True, help="For --write-sweep.")
@click.option(
    "--explain",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="SWEEP_DIR",
    help="Predict every finished run of SWEEP_DIR (its own settings) into "
    "SWEEP_DIR/predicted.json, which kfac-hpc report shows beside the measurements.",
)
def plan(**options: Any) -> None:
    """Predict step time per phase and memory per rank for each method and K-FAC strategy."""
    try:
        _plan(**options)
    except PlanInputError as exc:
        click.echo(f"kfac-hpc plan: error: {exc}", err=True)
        sys.exit(2)


def _plan(**o: Any) -> None:
    from kfac_hpc.plan.output import best_by_ranks, plot_scaling, sweep_toml, table_lines
    from kfac_hpc.plan.planner import build_cost_model, predict_all

    ranks = _int_list("ranks", o["ranks"])
    methods = [m.strip() for m in o["methods"].split(",") if m.strip()]
    for method in methods:  # checked here too: before a calibration spends seconds
        if method not in ALL_METHODS:
            raise PlanInputError("methods", f"{method!r} is not one of {', '.join(ALL_METHODS)}")
    for name in (
        "batch_size",
        "factor_update_steps",
        "inv_update_steps",
        "ranks_per_node",
        "steps",
        "ese_every",
    ):
        _positive(name, o[name])
    _positive("bucket_mb", o["bucket_mb"])
    if o["fosi_k"] < 1:
        raise PlanInputError("fosi_k", f"{o['fosi_k']} must be >= 1")
    calibration = _int_list("calibration_ranks", o["calibration_ranks"])
    if min(calibration) < 2:
        raise PlanInputError("calibration_ranks", "collectives need at least 2 ranks each")
    if o["explain"] is not None:
        from kfac_hpc.plan.explain import explain_sweep

        if not o["explain"].is_dir():
            raise PlanInputError("explain", f"{o['explain']} is not a directory")
        path, count = explain_sweep(o["explain"], o["profile"], calibration)
        click.echo(f"predictions of {count} run(s): {path} (kfac-hpc report {o['explain']})")
        return
    planned = build_cost_model(o["model"], o["dataset"], o["profile"], calibration, o["batch_size"])
    predictions = predict_all(
        planned,
        methods,
        ranks,
        o["batch_size"],
        o["scaling"],
        o["factor_update_steps"],
        o["inv_update_steps"],
        o["bucket_mb"],
        o["fosi_k"],
        o["ese_every"],
    )
    click.echo(
        f"{o['model']} on {o['dataset']}, batch {o['batch_size']} ({o['scaling']}); "
        f"{planned.source}"
    )
    click.echo(
        "milliseconds per step (K-FAC work amortized over its interval); * = best K-FAC strategy"
    )
    for line in table_lines(predictions, planned.memory_limit):
        click.echo(line)
    if o["plot"]:
        path = plot_scaling(predictions, Path(o["plot"]), f"{o['model']}: {planned.source}")
        click.echo(f"plot: {path}")
    if o["write_sweep"]:
        best = best_by_ranks(predictions, planned.memory_limit)
        try:
            text = sweep_toml(best, o["model"], o["dataset"], o["ranks_per_node"], o["steps"])
        except ValueError as exc:
            raise PlanInputError("ranks_per_node", str(exc)) from None
        Path(o["write_sweep"]).write_text(text)
        click.echo(f"sweep file: {o['write_sweep']} (run: kfac-hpc sweep -f {o['write_sweep']})")
