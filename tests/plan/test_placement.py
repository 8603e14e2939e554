"""Collectives priced by algorithm and placement (placement.py) against the formulas written out
here for 2 nodes of 2 GPUs, receivers inside and across nodes; and the groups the cost model
prices equal the preconditioner's KAISA assignment at P = 8 … 1,024 for every fraction."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kfac_hpc import KFACPreconditioner
from kfac_hpc.comm import collectives
from kfac_hpc.comm.assignment import KAISAAssignment, valid_grad_worker_fractions
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.layers import INPUTS, model_shape
from kfac_hpc.plan.model import CostModel, PlanConfig, bucket_bytes, kfac_assignment
from kfac_hpc.plan.placement import algorithm_s, nic_sharing, price_s, span
from kfac_hpc.plan.profiles import MachineProfile, NetworkProfile
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.workloads import build_model
from tests.plan.rank_work import rank_work, spread

A1, B1 = 2e-6, 1 / 100e9  # intra: NVLink-like
A2, B2 = 8e-6, 1 / 12.5e9  # inter: one EDR NIC
INTRA, INTER = AlphaBeta(A1, B1), AlphaBeta(A2, B2)
N = 8e6  # bytes


def _net(nics: int = 1, backend: str = "nccl", allreduce: str = "auto") -> NetworkProfile:
    """2 GPUs a node, ``nics`` NICs a node."""
    return NetworkProfile("t", 2, INTRA, INTER, (), nics, backend, allreduce)


@pytest.mark.parametrize("nics", [1, 2])
def test_allreduce_algorithms_over_two_nodes_of_two(nics: int) -> None:
    net, where = _net(nics), span(_net(nics), range(4))
    assert (where.nodes, where.per_node, where.nics) == (2, 2, min(2, nics))
    b_node = max(B1, B2 / nics)
    assert algorithm_s(net, "allreduce", "ring", N, where) == pytest.approx(
        6 * A2 + 1.5 * N * b_node
    )
    # tree: one level across the 2 nodes, a chain of 2 inside, 0.9 of the ring's bandwidth
    assert algorithm_s(net, "allreduce", "tree", N, where) == pytest.approx(
        2 * (A2 + A1) + 2 * N * b_node / 0.9
    )
    # reduce-scatter / all-gather in the node, allreduce of N/2 per rank across on its NICs
    assert algorithm_s(net, "allreduce", "hierarchical", N, where) == pytest.approx(
        2 * A1 + N * B1 + 2 * A2 + N * B2 / nics
    )
    one_way = (A2 + N * B2) + (A1 + N * B1)  # a single stream gets at most one NIC
    assert algorithm_s(net, "allreduce", "binomial", N, where) == pytest.approx(2 * one_way)


def test_nccl_takes_the_faster_of_ring_and_tree_by_size() -> None:
    net = NetworkProfile("t", 2, INTRA, INTER, (), 1)
    members = range(256)  # 128 nodes: the ring's 510 latencies against the tree's log
    for nbytes, fastest in ((1e3, "tree"), (1e9, "ring")):
        where = span(net, members)
        times = {a: algorithm_s(net, "allreduce", a, nbytes, where) for a in ("ring", "tree")}
        assert min(times, key=times.__getitem__) == fastest
        assert price_s(net, "allreduce", nbytes, members) == pytest.approx(min(times.values()))


def test_a_profile_can_fix_the_allreduce_algorithm() -> None:
    net = _net(2, allreduce="hierarchical")
    assert price_s(net, "allreduce", N, range(4)) == pytest.approx(
        2 * A1 + N * B1 + 2 * A2 + N * B2 / 2
    )


def _best_pipelined(hops: int, alpha: float, beta: float) -> float:
    """The chain with the best whole number of chunks, searched (the oracle of the closed form)."""
    return min((hops + c - 1) * (alpha + N * beta / c) for c in range(1, 20000))


@pytest.mark.parametrize(
    ("members", "sharing", "expected"),
    [
        ((0, 1), 1, A1 + N * B1),  # receiver inside the node
        ((0, 2), 1, A2 + N * B2),  # receiver on the other node
        ((0, 2), 2, A2 + N * B2 * 2),  # two such broadcasts at once share the node's NIC
    ],
)
def test_broadcast_and_reduce_between_two_ranks(members, sharing, expected) -> None:
    for kind in ("broadcast", "reduce"):
        assert price_s(_net(1), kind, N, members, sharing) == pytest.approx(expected)


def test_pipelined_broadcast_over_four_ranks_is_the_best_chunking() -> None:
    net = _net(1)
    got = algorithm_s(net, "broadcast", "pipelined", N, span(net, range(4)))
    oracle = _best_pipelined(3, A2, max(B1, B2))
    assert got == pytest.approx(oracle, rel=1e-3)
    assert got <= oracle * (1 + 1e-12)  # the continuous optimum is a lower bound


def test_gloo_broadcasts_on_a_binomial_tree_across_then_inside() -> None:
    net = _net(1, backend="gloo")
    expected = (A2 + N * B2) + (A1 + N * B1)
    assert price_s(net, "broadcast", N, range(4)) == pytest.approx(expected)


def test_a_measured_fit_prices_its_own_rank_count_inside_one_node() -> None:
    fit = AlphaBeta(1e-3, 1e-8)
    net = NetworkProfile("t", 4, INTRA, INTER, ((2, "broadcast", fit),))
    assert price_s(net, "broadcast", N, (0, 1)) == pytest.approx(fit.time_s("broadcast", N, 2))
    # across nodes the fit (of one node) does not apply
    net2 = NetworkProfile("t", 1, INTRA, INTER, ((2, "broadcast", fit),))
    assert price_s(net2, "broadcast", N, (0, 1)) == pytest.approx(A2 + N * B2)


def test_nic_sharing_counts_the_groups_crossing_nodes_on_the_busiest_node() -> None:
    net = NetworkProfile("t", 4, INTRA, INTER)
    columns = [(c, c + 4) for c in range(4)]  # KAISA columns at P = 8, W = 4
    assert nic_sharing(net, columns) == 4
    rows = [(0, 1, 2, 3), (4, 5, 6, 7)]  # inside their nodes: no NIC shared
    assert nic_sharing(net, rows) == 1


def test_hybrid_broadcasts_on_two_nodes_of_two() -> None:
    """P = 4, W = 2: rows {0,1}, {2,3} inside the nodes; columns {0,2}, {1,3} across them,
    both leaving each node through its one NIC at once. Each source's tensors in a group go
    as one broadcast (the preconditioner's AsyncBroadcaster: one bucket under 25 MiB)."""
    shape = model_shape("small_cnn", "digits")
    machine = MachineProfile("gpu", 1e12, 1e11, 1e12, 1e10)
    model = CostModel(shape, RatedCompute(machine, shape), _net(1))
    cfg = PlanConfig("kfac-hybrid-opt", 4, 64, "weak", 1, 1)
    pred = model.predict(cfg)
    assignment = kfac_assignment(shape, cfg)
    # + each phase's busiest rank's lead over the mean: the others wait in the broadcasts
    eigh, precondition = rank_work(model, cfg)
    columns: dict[tuple[int, ...], dict[int, int]] = {}  # column -> source -> bytes
    for n, layer in enumerate(shape.layers):
        for column in assignment.columns:
            source = assignment.grad_source(f"{n}", column[0])
            sent = columns.setdefault(tuple(column), {})
            sent[source] = sent.get(source, 0) + layer.grad_elements * 4
    grads = max(sum(A2 + b * B2 * 2 for b in sent.values()) for sent in columns.values())
    assert pred.phases_s["grad_broadcast"] == pytest.approx(grads + spread(precondition))
    # second-order data: A's eigenvectors and eigenvalues from its worker, G's from its
    # worker, one broadcast a source in each row; no eigenvalue outer product is sent
    rows: dict[tuple[int, ...], dict[int, int]] = {}  # row -> source -> bytes
    for n, layer in enumerate(shape.layers):
        plan = assignment.plan(f"{n}")
        sent = rows.setdefault(plan.grad_workers, {})
        for worker, size in ((plan.a_worker, layer.n_a), (plan.g_worker, layer.n_g)):
            sent[worker] = sent.get(worker, 0) + (size * size + size) * 4
    assert set(rows) == {(0, 1), (2, 3)}
    inverse = max(sum(A1 + b * B1 for b in sent.values()) for sent in rows.values())
    assert pred.phases_s["inverse_comm"] == pytest.approx(inverse + spread(eigh))


def _preconditioner_layers() -> tuple[KFACPreconditioner, list[str]]:
    in_shape, classes = INPUTS["digits"]
    torch.manual_seed(0)
    pre = KFACPreconditioner(build_model(TrainConfig(model="small_cnn"), in_shape, classes))
    return pre, list(pre.states)


@pytest.mark.parametrize("ranks", [8, 16, 32, 64, 128, 256, 512, 1024])
def test_priced_groups_are_the_preconditioners_assignment(ranks: int) -> None:
    shape = model_shape("small_cnn", "digits")
    machine = MachineProfile("gpu", 1e12, 1e11, 1e12, 1e10)
    model = CostModel(shape, RatedCompute(machine, shape), NetworkProfile("t", 4, INTRA, INTER))
    pre, names = _preconditioner_layers()
    assert len(names) == len(shape.layers)
    for fraction in valid_grad_worker_fractions(ranks):
        real = KAISAAssignment(
            {n: (s.layer.n_a, s.layer.n_g, s.layer.groups) for n, s in pre.states.items()},
            ranks,
            fraction,
            pre.options.assignment_strategy,
            pre.options.colocate_factors,
        )
        cfg = PlanConfig("kfac-comm-opt", ranks, 64, "weak", grad_worker_fraction=fraction)
        priced = model.kfac_collectives(cfg)
        # one broadcast per source and group (every source's tensors fit one bucket)
        expect_inverse = sorted(
            {
                (real.plan(name).grad_workers, root)
                for name in names
                for root in (real.plan(name).a_worker, real.plan(name).g_worker)
                if len(real.plan(name).grad_workers) > 1
            }
        )
        got_inverse = sorted((c.members, c.root) for c in priced if c.phase == "inverse_comm")
        assert got_inverse == expect_inverse
        expect_grads = sorted(
            {
                (column, real.grad_source(name, column[0]))
                for column in real.columns
                if len(column) > 1
                for name in names
            }
        )
        got_grads = sorted((c.members, c.root) for c in priced if c.phase == "grad_broadcast")
        assert got_grads == expect_grads
        sent = sum(c.nbytes for c in priced if c.phase == "grad_broadcast")
        workers = round(fraction * ranks)  # the columns: each gets every layer's gradient
        columns = workers if workers < ranks else 0
        assert sent == columns * sum(layer.grad_elements * 4 for layer in shape.layers)
        assert math.isfinite(model.predict(cfg).step_s)


@pytest.mark.parametrize("cap_mb", [25.0, 1.0, 0.0])
def test_broadcast_buckets_are_the_broadcasters(
    cap_mb: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bucket_bytes against the preconditioner's AsyncBroadcaster queueing the same tensors
    (its launches recorded instead of sent)."""
    monkeypatch.setattr(collectives, "group_size", lambda group=None: 2)
    launched: list[int] = []

    class Recording(collectives.AsyncBroadcaster):
        def _launch(self, bucket: Any) -> None:
            launched.append(bucket.nbytes)

    sizes = [4 * n for n in (513 * 513, 513, 64 * 64, 64, 300_000, 10, 10, 400_000, 7)]
    broadcaster = Recording(bucket_cap_mb=cap_mb)
    for size in sizes:
        broadcaster.broadcast(torch.empty(size // 4), src=0, group=None)
    broadcaster.flush()
    assert bucket_bytes(sizes, cap_mb * 2**20) == launched
    assert sum(launched) == sum(sizes)
