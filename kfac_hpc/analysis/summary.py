"""The report's opening paragraph: what the sweep found, in 3 to 6 sentences made from the
tables' numbers (best configuration per node count, K-FAC vs first-order time to target, where
parallel efficiency falls below 50 %, stragglers, failed or requeued points)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kfac_hpc.analysis import schema
from kfac_hpc.analysis.humanize import sig3

Row = dict[str, Any]
EFFICIENCY_FLOOR = 0.5  # below this, adding nodes costs more than half of their capacity
STRAGGLER_SPREAD = 0.05  # ranks' mean step times further apart than this count as stragglers


def short_labels(groups: Sequence[str]) -> dict[str, str]:
    """Each group label without the words every label shares (``sgd+kfac`` vs ``sgd`` rather
    than two long lines that differ in one word); the full label when all words are shared."""
    words = [g.split() for g in groups]
    common = set.intersection(*(set(w) for w in words)) if words else set()
    return {
        g: " ".join(x for x in w if x not in common) or g
        for g, w in zip(groups, words, strict=True)
    }


def _nodes(n: Any) -> str:
    return f"{n:g} node" + ("" if n == 1 else "s")


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
            f"{winners.pop()} has the highest throughput at every node count, from "
            f"{sig3(low['samples_per_s_median'])} samples/s at {_nodes(n0)} to "
            f"{sig3(high['samples_per_s_median'])} at {_nodes(n1)}."
        )
    parts = [
        f"{label[r['group']]} at {_nodes(n)} ({sig3(r['samples_per_s_median'])} samples/s)"
        for n, r in ordered
    ]
    return "Highest throughput: " + "; ".join(parts) + "."


_METHOD_NAMES = {"kfac": "K-FAC", "fosi": "FOSI"}


def _methods_vs_first_order(scaling: list[Row], runs: list[Row]) -> list[str | None]:
    """One sentence per method (K-FAC, FOSI) found: its time to target over first order."""
    methods = sorted({str(r["optimizer_label"]).split("+", 1)[1] for r in scaling
                      if "+" in str(r["optimizer_label"])})  # fmt: skip
    return [_method_vs_first_order(m, scaling, runs) for m in methods]


def _method_vs_first_order(method: str, scaling: list[Row], runs: list[Row]) -> str | None:
    name = _METHOD_NAMES.get(method, method)
    rows = [r for r in scaling if str(r["optimizer_label"]).endswith(f"+{method}")]
    if not rows:
        return None
    if all(r.get("target_accuracy") is None for r in runs):
        return (
            f"{name} and first-order time to target are not compared: no target accuracy was "
            "set (pass --target-accuracy)."
        )
    ratios = sorted(
        (r for r in rows if r.get("kfac_vs_first_order_tts_ratio")), key=lambda r: r["nodes"]
    )
    if not ratios:
        return (
            f"{name} and first-order time to target are not compared: at no node count did "
            "both reach the target accuracy."
        )
    first = str(ratios[0]["optimizer_label"]).split("+")[0].upper()
    faster = [r for r in ratios if r["kfac_vs_first_order_tts_ratio"] <= 1]
    slower = [r for r in ratios if r["kfac_vs_first_order_tts_ratio"] > 1]
    parts = [
        f"{word} at {_node_list(rows)} ({', '.join(_speedup(r) for r in rows)})"
        for word, rows in (("faster", faster), ("slower", slower))
        if rows
    ]
    return (
        f"{name} reaches the target accuracy {' and '.join(parts)} than {first} "
        f"(first-order time over {name} time)."
    )


def _speedup(row: Row) -> str:
    return f"{sig3(1 / row['kfac_vs_first_order_tts_ratio'])}×"


def _node_list(rows: list[Row]) -> str:
    counts = sorted({f"{r['nodes']:g}" for r in rows}, key=float)
    listed = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " and " + counts[-1]
    return listed + (" node" if counts == ["1"] else " nodes")


def _efficiency(scaling: list[Row], label: dict[str, str]) -> str | None:
    cells = [r for r in scaling if r.get("parallel_efficiency") is not None and r["nodes"]]
    multi = [r for r in cells if r.get("ideal_speedup") and r["ideal_speedup"] > 1]
    if not multi:
        return None
    low = [r for r in multi if r["parallel_efficiency"] < EFFICIENCY_FLOOR]
    if low:
        first = min(low, key=lambda r: (r["nodes"], r["parallel_efficiency"]))
        return (
            f"Parallel efficiency drops below 50 % at {_nodes(first['nodes'])} "
            f"({label[first['group']]}: {sig3(100 * first['parallel_efficiency'])} %)."
        )
    worst = min(multi, key=lambda r: r["parallel_efficiency"])
    top = max(r["nodes"] for r in multi)
    return (
        f"Parallel efficiency stays at or above 50 % up to {_nodes(top)} (lowest: "
        f"{sig3(100 * worst['parallel_efficiency'])} %, {label[worst['group']]} at "
        f"{_nodes(worst['nodes'])})."
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


def summary_sentences(scaling: list[Row], runs: list[Row]) -> list[str]:
    """The summary's sentences, in reading order."""
    label = short_labels(sorted({r["group"] for r in scaling}))
    found = [
        _best_per_node_count(scaling, label),
        *_methods_vs_first_order(scaling, runs),
        _efficiency(scaling, label),
        _stragglers(scaling, label),
    ]
    return [s for s in found if s] + [_points(runs)]
