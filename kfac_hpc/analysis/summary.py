"""The report's opening paragraph: what the sweep found, in 3 to 6 sentences made from the
tables' numbers (each method's time to target against its first-order configuration, the best
configuration per node count, where parallel efficiency falls below 0.5, stragglers, failed or
requeued points).

Every sentence starts with a capital letter and gives its numbers with their units; a ratio
has one direction throughout: a method's time over its first-order configuration's
(``K-FAC reaches the target in 0.55× SGD's time``), never the inverse.
"""

from __future__ import annotations

from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.humanize import sig3
from kfac_hpc.analysis.labels import method_name, optimizer_name, people_labels

Row = dict[str, Any]
EFFICIENCY_FLOOR = 0.5  # below this, adding nodes costs more than half of their capacity
STRAGGLER_SPREAD = 0.05  # ranks' mean step times further apart than this count as stragglers


def _nodes(n: Any) -> str:
    return f"{n:g} node" + ("" if n == 1 else "s")


def _rate(value: float) -> str:
    return f"{sig3(value)} samples/s"


def _best_per_node_count(scaling: list[Row], label: dict[str, str]) -> str | None:
    best: dict[Any, Row] = {}
    for row in scaling:
        rate = row.get("samples_per_s_median")
        if rate is not None and (
            row["nodes"] not in best or rate > best[row["nodes"]]["samples_per_s_median"]
        ):
            best[row["nodes"]] = row
    if not best:
        return None
    ordered = sorted(best.items())
    winners = {label[r["group"]] for _, r in ordered}
    if len(winners) == 1 and len(ordered) > 1:
        (n0, low), (n1, high) = ordered[0], ordered[-1]
        return (
            f"Highest throughput: {winners.pop()} at every node count, from "
            f"{_rate(low['samples_per_s_median'])} at {_nodes(n0)} to "
            f"{_rate(high['samples_per_s_median'])} at {_nodes(n1)}."
        )
    parts = [
        f"{label[r['group']]} at {_nodes(n)} ({_rate(r['samples_per_s_median'])})"
        for n, r in ordered
    ]
    return "Highest throughput: " + "; ".join(parts) + "."


def _method_of(row: Row) -> str | None:
    """``kfac`` of an ``sgd+kfac`` cell; None for a first-order one."""
    return str(row["optimizer_label"]).partition("+")[2] or None


def _methods_vs_first_order(
    scaling: list[Row], runs: list[Row], label: dict[str, str]
) -> list[str]:
    """One sentence per method (K-FAC, FOSI) found: its time to target over first order's."""
    methods = sorted({m for r in scaling if (m := _method_of(r))})
    return [_method_vs_first_order(m, scaling, runs, label) for m in methods]


def _target(runs: list[Row]) -> str:
    targets = {r["target_accuracy"] for r in runs if r.get("target_accuracy") is not None}
    losses = {r["target_loss"] for r in runs if r.get("target_loss") is not None}
    if len(targets) == 1 and not losses:
        return f"the target accuracy of {100 * targets.pop():.3g} %"
    if len(losses) == 1 and not targets:
        return f"the target test loss of {losses.pop():.4g}"
    return "the target"


def _method_vs_first_order(
    method: str, scaling: list[Row], runs: list[Row], label: dict[str, str]
) -> str:
    name = method_name(method)
    rows = sorted(
        (r for r in scaling if _method_of(r) == method), key=lambda r: (r["nodes"], r["group"])
    )
    if all(r.get("target_accuracy") is None and r.get("target_loss") is None for r in runs):
        return (
            f"{name} and first-order time to target are not compared: no target was set "
            "(pass --target-accuracy or --target-loss)."
        )
    baselines = {(r["group"], r["nodes"]): r for r in scaling if _method_of(r) is None}
    firsts = {optimizer_name(str(r["optimizer_label"]).split("+")[0]) for r in rows}
    first = firsts.pop() if len(firsts) == 1 else "first order"
    several = len({r["group"] for r in rows}) > 1
    compared, alone = [], []
    for row in rows:
        base = baselines.get((row["first_order_group"], row["nodes"]))
        mine = row.get("time_to_target_s_median")
        theirs = None if base is None else base.get("time_to_target_s_median")
        where = _nodes(row["nodes"]) + (f", {label[row['group']]}" if several else "")
        if row.get("kfac_vs_first_order_tts_ratio") and mine and theirs:
            ratio = row["kfac_vs_first_order_tts_ratio"]
            compared.append(f"{sig3(ratio)}× at {where} ({sig3(mine)} s against {sig3(theirs)} s)")
        elif mine:
            alone.append(f"only {name} reached it at {where}")
        elif theirs:
            alone.append(f"only {first} reached it at {where}")
    if not compared:
        reason = "; ".join(alone) or "at no node count did either reach it"
        return f"{name} and {first} are not compared at {_target(runs)}: {reason}."
    first_part = compared[0].replace("× at", f"× {_possessive(first)} time at", 1)
    listed = ", ".join([first_part, *compared[1:-1]])
    if len(compared) > 1:
        listed += f" and {compared[-1]}"
    extra = f"; {'; '.join(alone)}" if alone else ""
    return f"{name} reaches {_target(runs)} in {listed}{extra}."


def _possessive(name: str) -> str:
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def _efficiency(scaling: list[Row], label: dict[str, str]) -> str | None:
    cells = [r for r in scaling if r.get("parallel_efficiency") is not None and r["nodes"]]
    multi = [r for r in cells if r.get("ideal_speedup") and r["ideal_speedup"] > 1]
    if not multi:
        return None
    low = [r for r in multi if r["parallel_efficiency"] < EFFICIENCY_FLOOR]
    if low:
        first = min(low, key=lambda r: (r["nodes"], r["parallel_efficiency"]))
        return (
            f"Parallel efficiency drops below {EFFICIENCY_FLOOR:g} at {_nodes(first['nodes'])} "
            f"({_gain(first, label[first['group']])})."
        )
    worst = min(multi, key=lambda r: r["parallel_efficiency"])
    top = max(r["nodes"] for r in multi)
    where = f"{label[worst['group']]} at {_nodes(worst['nodes'])}"
    return (
        f"Parallel efficiency stays at or above {EFFICIENCY_FLOOR:g} up to {_nodes(top)} "
        f"(lowest {_gain(worst, where)})."
    )


def _gain(row: Row, where: str) -> str:
    """``0.89 for SGD: 1.78× the throughput on 2× the nodes``: a cell's efficiency and
    speedup."""
    return (
        f"{sig3(row['parallel_efficiency'])} for {where}: {sig3(row['speedup'])}× the "
        f"throughput on {row['ideal_speedup']:g}× the nodes"
    )


def _stragglers(scaling: list[Row], label: dict[str, str]) -> str | None:
    spreads = [r for r in scaling if r.get("straggler_spread_fraction_median") is not None]
    if not spreads:
        return None
    worst = max(spreads, key=lambda r: r["straggler_spread_fraction_median"])
    spread = worst["straggler_spread_fraction_median"]
    if spread <= STRAGGLER_SPREAD:
        return f"No stragglers: the ranks' mean step times lie within {sig3(100 * spread)} %."
    return (
        f"Stragglers: the ranks' mean step times spread by up to {sig3(100 * spread)} % "
        f"({label[worst['group']]} at {_nodes(worst['nodes'])})."
    )


def _points(runs: list[Row]) -> str:
    requeued = [r["run_id"] for r in runs if (r.get("segments") or 0) > 1]
    not_done = [r for r in runs if r["state"] != schema.DONE]
    if not not_done:
        sentence = f"All {len(runs)} points finished"
    else:
        counts: dict[str, list[str]] = {}
        for r in not_done:
            counts.setdefault(r["state"], []).append(str(r["run_id"]))
        listed = "; ".join(
            f"{len(ids)} {state} ({', '.join(ids[:3])}{', …' if len(ids) > 3 else ''})"
            for state, ids in counts.items()
        )
        sentence = f"{len(runs) - len(not_done)} of {len(runs)} points finished; {listed}"
    if requeued:
        shown = ", ".join(requeued[:3]) + (", …" if len(requeued) > 3 else "")
        sentence += f"; {len(requeued)} requeued ({shown})"
    return sentence + "."


def _capital(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def summary_sentences(scaling: list[Row], runs: list[Row]) -> list[str]:
    """The summary's sentences, in reading order, each starting with a capital letter."""
    label = people_labels(sorted({r["group"] for r in scaling}))
    found = [
        *_methods_vs_first_order(scaling, runs, label),
        _best_per_node_count(scaling, label),
        _efficiency(scaling, label),
        _stragglers(scaling, label),
    ]
    return [_capital(s) for s in found if s] + [_points(runs)]
