"""Collectives priced by algorithm and by where their members sit (nodes, NICs, links).

Ranks are placed in blocks, ``ranks_per_node`` consecutive ranks to a node (what ``srun`` and
``mpiexec`` do by default). A group's members give its *span*: ``k`` nodes, at most ``L``
members on one node. Each link class is an α-β pair: ``intra`` (NVLink, PCIe or shared memory:
one rank's link inside its node) and ``inter`` (one NIC). A node has ``nics`` NICs; when
``s`` groups that cross nodes run at once with members on the same node, they share its NICs,
so one group uses ``min(L, nics / s)`` of them (a fraction when ``s > nics``) and one stream
that crosses a node boundary gets ``min(1, nics / s)`` of a NIC.

With ``n`` bytes, ``P`` members, ``h = α_inter`` when the group crosses nodes (``α_intra``
otherwise), ``b_node = max(β_intra, β_inter / nics_used)`` and
``b_flow = max(β_intra, β_inter / min(1, nics / s))`` (``β_intra`` inside one node):

- ring allreduce:        ``2(P−1)·h + 2(P−1)/P · n · b_node``
- tree allreduce (NCCL's pipelined double binary tree across nodes, chain inside; NCCL's
  model gives it 0.9 of the ring's bus bandwidth): ``2(⌈log₂k⌉·α_inter + (L−1)·α_intra) +
  2·n·b_node / 0.9``
- hierarchical allreduce (reduce-scatter in the node, allreduce of 1/L across nodes on the
  node's NICs, all-gather in the node):
  ``2(L−1)·α_intra + 2(L−1)/L·n·β_intra + 2(k−1)·α_inter + 2(k−1)/k·n·β_inter/nics_used``
- binomial allreduce: a binomial reduce then a binomial broadcast
- binomial broadcast / reduce (across nodes, then inside):
  ``⌈log₂k⌉·(α_inter + n·b_flow) + ⌈log₂L⌉·(α_intra + n·β_intra)``
- pipelined broadcast / reduce (a chain of P−1 hops, the message cut in ``c`` chunks):
  ``(P−1+c−1)·(h + n·b_flow/c)``, ``c`` the best chunk count (``√((P−2)·n·b_flow / h)``, at
  least 1)

Which algorithm runs: NCCL's tuner predicts each of its algorithms' time from its own latency
and bandwidth table for every call and takes the fastest (``src/graph/tuning.cc``,
``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime``; ``NCCL_ALGO`` forces one), between ring and
tree for allreduce (the tree's latency ``2((L−1)·intra + log₂k·inter)`` and 0.9 of the ring's
bus bandwidth, as above); its broadcast and reduce are pipelined rings only.
gloo (``ProcessGroupGloo``) runs ring allreduce for large messages and binomial trees for
broadcast and reduce. So ``nccl`` takes the faster of ring and tree and pipelined broadcasts;
``gloo`` the faster of ring and binomial and binomial broadcasts; a profile's
``network.allreduce`` can fix one allreduce algorithm (e.g. ``hierarchical`` for a stack that
runs it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kfac_hpc.plan.profiles import NetworkProfile

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "TREE_BANDWIDTH",
    "Span",
    "algorithm_s",
    "nic_sharing",
    "price_s",
    "span",
]

TREE_BANDWIDTH = 0.9  # NCCL's tree bus bandwidth against the ring's (tuning.cc)
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("ring", "tree", "hierarchical", "binomial"),
    "broadcast": ("pipelined", "binomial"),
    "reduce": ("pipelined", "binomial"),
}
# backend -> collective -> the algorithms it chooses among (the fastest is taken)
BACKENDS: dict[str, dict[str, tuple[str, ...]]] = {
    "nccl": {"allreduce": ("ring", "tree"), "broadcast": ("pipelined",), "reduce": ("pipelined",)},
    "gloo": {
        "allreduce": ("ring", "binomial"),
        "broadcast": ("binomial",),
        "reduce": ("binomial",),
    },
}


@dataclass(frozen=True)
class Span:
    """Where a group sits: ``ranks`` members on ``nodes`` nodes, at most ``per_node`` on one;
    ``nics``: NICs of a node the group uses at once; ``flow_nics``: the share of one NIC a
    single stream across a node boundary gets."""

    ranks: int
    nodes: int
    per_node: int
    nics: float
    flow_nics: float


def span(net: NetworkProfile, members: Iterable[int], sharing: int = 1) -> Span:
    """The span of ``members`` on ``net``'s nodes, ``sharing`` groups using each node's NICs."""
    counts = Counter(rank // net.ranks_per_node for rank in members)
    per_node = max(counts.values(), default=0)
    share = net.nics / max(1, sharing)
    return Span(sum(counts.values()), len(counts), per_node, min(per_node, share), min(1.0, share))


def nic_sharing(net: NetworkProfile, groups: Sequence[Sequence[int]]) -> int:
    """How many of ``groups`` (run at once) that cross nodes have members on the busiest
    node: they share that node's NICs (at least 1)."""
    on_node: Counter[int] = Counter()
    for group in groups:
        nodes = {rank // net.ranks_per_node for rank in group}
        if len(nodes) > 1:
            on_node.update(nodes)
    return max(on_node.values(), default=1)


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _binomial_one_way(net: NetworkProfile, nbytes: float, where: Span) -> float:
    intra, inter = net.intra, net.inter
    across = _log2(where.nodes) * (inter.alpha_s + nbytes * inter.beta_s_per_byte / where.flow_nics)
    inside = _log2(where.per_node) * (intra.alpha_s + nbytes * intra.beta_s_per_byte)
    return across + inside


def algorithm_s(
    net: NetworkProfile, kind: str, algorithm: str, nbytes: float, where: Span
) -> float:
    """Seconds of one ``kind`` collective of ``nbytes`` run with ``algorithm`` over ``where``
    (the module's formulas); 0 for one member."""
    p = where.ranks
    if p <= 1:
        return 0.0
    if algorithm not in ALGORITHMS.get(kind, ()):
        raise ValueError(f"{kind} has no algorithm {algorithm!r}; valid: {ALGORITHMS.get(kind)}")
    intra, inter = net.intra, net.inter
    across = where.nodes > 1
    hop = inter.alpha_s if across else intra.alpha_s
    b_node = max(intra.beta_s_per_byte, inter.beta_s_per_byte / where.nics if across else 0.0)
    b_flow = max(intra.beta_s_per_byte, inter.beta_s_per_byte / where.flow_nics if across else 0.0)
    if algorithm == "ring":
        return 2 * (p - 1) * hop + 2 * (p - 1) / p * nbytes * b_node
    if algorithm == "tree":
        latency = _log2(where.nodes) * inter.alpha_s + (where.per_node - 1) * intra.alpha_s
        return 2 * latency + 2 * nbytes * b_node / TREE_BANDWIDTH
    if algorithm == "hierarchical":
        local, k = where.per_node, where.nodes
        inside = 2 * (local - 1) * intra.alpha_s + 2 * (local - 1) / local * nbytes * (
            intra.beta_s_per_byte
        )
        between = 2 * (k - 1) * inter.alpha_s + 2 * (k - 1) / k * nbytes * (
            inter.beta_s_per_byte / where.nics
        )
        return inside + between
    if algorithm == "binomial":
        one_way = _binomial_one_way(net, nbytes, where)
        return 2 * one_way if kind == "allreduce" else one_way
    # pipelined chain: P-1 hops, c chunks; the best c
    hops = p - 1
    chunks = math.sqrt((hops - 1) * nbytes * b_flow / hop) if hop > 0 else math.inf
    if math.isinf(chunks):
        return nbytes * b_flow
    chunks = max(1.0, chunks)
    return (hops + chunks - 1) * (hop + nbytes * b_flow / chunks)


def price_s(
    net: NetworkProfile, kind: str, nbytes: float, members: Iterable[int], sharing: int = 1
) -> float:
    """Seconds of one ``kind`` collective of ``nbytes`` over ``members`` (``sharing`` groups
    at once on a node's NICs): the measured fit at exactly that many ranks of one node if the
    profile has one, else the fastest of the algorithms the backend chooses among (or the
    profile's ``allreduce``)."""
    where = span(net, members, sharing)
    if where.ranks <= 1:
        return 0.0
    if where.nodes == 1:
        measured = net.measured_link(where.ranks, kind)
        if measured is not None:
            return measured.time_s(kind, nbytes, where.ranks)
    choices = BACKENDS[net.backend][kind]
    if kind == "allreduce" and net.allreduce != "auto":
        choices = (net.allreduce,)
    return min(algorithm_s(net, kind, algorithm, nbytes, where) for algorithm in choices)
