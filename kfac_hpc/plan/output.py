"""What ``kfac-hpc plan`` shows: the table, the scaling plot, the sweep file of its choice."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kfac_hpc.contracts.atomic import write_bytes_atomic
from kfac_hpc.plan.model import Prediction

__all__ = ["best_by_ranks", "plot_bytes", "plot_scaling", "sweep_toml", "table_lines"]

_MS = 1e3
_MIB = 2**20
# (column title, phases summed into it)
COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("fwd+bwd", ("forward", "backward")),
    ("factor", ("factor_compute", "factor_comm")),
    ("inverse", ("inverse_compute", "inverse_comm")),
    ("precond", ("precondition",)),
    ("grad comm", ("grad_allreduce", "grad_broadcast", "param_allgather")),
    ("optim", ("optimizer",)),
    ("ese", ("ese",)),
)
_FRACTIONS = {"kfac-comm-opt": 1.0, "kfac-hybrid-opt": 0.5}


def best_by_ranks(
    predictions: Sequence[Prediction], memory_limit: float | None
) -> dict[int, Prediction]:
    """The fastest K-FAC strategy at each rank count among those that fit in memory (SGD only
    when no K-FAC method is planned): step time alone cannot weigh K-FAC's fewer steps
    against SGD's cheaper ones, so SGD is the baseline, not a candidate."""
    kfac_planned = any(p.config.kfac for p in predictions)
    best: dict[int, Prediction] = {}
    for pred in predictions:
        if memory_limit is not None and pred.memory_bytes > memory_limit:
            continue
        if kfac_planned and not pred.config.kfac:
            continue
        seen = best.get(pred.config.ranks)
        if seen is None or pred.step_s < seen.step_s:
            best[pred.config.ranks] = pred
    return best


def _ms(seconds: float, width: int) -> str:
    """Milliseconds in ``width`` columns: two decimals, or three digits and an exponent when
    the fixed form would not fit."""
    ms = seconds * _MS
    return f"{ms:>{width}.2f}" if abs(ms) < 1e6 else f"{ms:>{width}.3g}"


def table_lines(predictions: Sequence[Prediction], memory_limit: float | None) -> list[str]:
    """A fixed-width table, milliseconds per step by phase group and the peak memory per GPU
    ("does not fit" above ``memory_limit``); ``*`` marks the best K-FAC strategy at each rank
    count (see :func:`best_by_ranks`)."""
    best = {id(p) for p in best_by_ranks(predictions, memory_limit).values()}
    head = f"{'ranks':>6}  {'method':<16}{'step ms':>10}"
    head += "".join(f"{title:>11}" for title, _ in COLUMNS) + f"{'MiB/GPU':>10}"
    lines = [head]
    for pred in predictions:
        mark = "*" if id(pred) in best else " "
        row = f"{pred.config.ranks:>6}{mark} {pred.config.method:<16}{_ms(pred.step_s, 10)}"
        row += "".join(
            _ms(sum(pred.phases_s.get(p, 0.0) for p in phases), 11) for _, phases in COLUMNS
        )
        memory = f"{pred.memory_bytes / _MIB:.0f}"
        if memory_limit is not None and pred.memory_bytes > memory_limit:
            memory += " does not fit"
        lines.append(row + f"{memory:>10}")
    return lines


def plot_scaling(predictions: Sequence[Prediction], path: Path, title: str) -> Path:
    """Predicted step time against ranks, one line per method, log-log, written to ``path``
    (its folder made if missing; replaced atomically; the format from its suffix)."""
    fmt = path.suffix.lower().lstrip(".") or "png"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, plot_bytes(predictions, title, fmt), durable=False)
    return path


def plot_bytes(predictions: Sequence[Prediction], title: str, fmt: str = "png") -> bytes:
    """The image (``fmt``: png, pdf, svg) of :func:`plot_scaling`."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    methods = sorted({p.config.method for p in predictions})
    for method in methods:
        rows = sorted(
            (p for p in predictions if p.config.method == method), key=lambda p: p.config.ranks
        )
        ranks = [p.config.ranks for p in rows]
        ax_t.plot(ranks, [p.step_s * _MS for p in rows], marker="o", label=method)
        comm = [
            sum(
                p.phases_s[k]
                for k in ("factor_comm", "inverse_comm", "grad_allreduce", "grad_broadcast")
            )
            / p.step_s
            for p in rows
        ]
        ax_e.plot(ranks, comm, marker="o", label=method)
    for ax in (ax_t, ax_e):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (GPUs)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("predicted step time (ms)")
    ax_e.set_ylabel("communication share of the step")
    ax_t.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=120)
    plt.close(fig)
    return buffer.getvalue()


def sweep_toml(
    best: dict[int, Prediction], model: str, dataset: str, ranks_per_node: int, steps: int
) -> str:
    """A sweep file (docs/sweep.md format) that measures the recommendation at every rank
    count, with SGD beside it as the baseline when K-FAC is recommended."""
    preds = [best[p] for p in sorted(best) if best[p].config.ranks % ranks_per_node == 0]
    if not preds:
        raise ValueError("no recommended rank count is a multiple of ranks_per_node")
    cfg = preds[0].config
    winners = sorted({p.config.method for p in preds})
    kfac = [m for m in winners if m != "sgd"]
    fractions = sorted({_FRACTIONS[m] for m in kfac if m in _FRACTIONS}, reverse=True)
    lines = [
        "# Written by `kfac-hpc plan`: measures its recommendation; predicted step ms per rank",
        "# count: "
        + ", ".join(f"{p.config.ranks}: {p.config.method} {p.step_s * _MS:.2f}" for p in preds),
    ]
    if "kfac-mem-opt" in kfac:
        lines.append("# mem-opt (grad_worker_fraction = 1/P) differs per node count: run it")
        lines.append("# with one sweep per node count and grad_worker_fraction = 1/P.")
    lines += [
        f'name = "plan-{model}"',
        f"nodes = {json.dumps([p.config.ranks // ranks_per_node for p in preds])}",
        f"ranks_per_node = {ranks_per_node}",
        "",
        "[train]",
        f'model = "{model}"',
        f'dataset = "{dataset}"',
        f"steps = {steps}",
        f'scaling = "{cfg.scaling}"',
        "",
        "[axes]",
        f"batch_size = [{cfg.batch_size}]",
    ]
    if kfac:
        lines.append("kfac = [true, false]")
        lines.append(f"factor_update_steps = [{cfg.factor_update_steps}]")
        lines.append(f"inv_update_steps = [{cfg.inv_update_steps}]")
        if fractions:
            lines.append(f"grad_worker_fraction = {json.dumps(fractions)}")
    else:
        lines.append("kfac = [false]")
    return "\n".join(lines) + "\n"
