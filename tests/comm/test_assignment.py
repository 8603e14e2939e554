"""The KAISA plan without processes: LPT balance against brute force, cost models, colocation,
grid shapes of COMM/HYBRID/MEM-OPT, fraction validation."""

from __future__ import annotations

import itertools
import random

import pytest

from kfac_hpc.comm import (
    AssignmentStrategy,
    DistributionStrategy,
    KAISAAssignment,
    KAISAGroups,
    lpt_schedule,
    parse_grad_worker_fraction,
    valid_grad_worker_fractions,
)


def makespan(costs: list[float], placement: list[int], bins: int) -> float:
    loads = [0.0] * bins
    for cost, b in zip(costs, placement, strict=True):
        loads[b] += cost
    return max(loads)


def optimal_makespan(costs: list[float], bins: int) -> float:
    """Brute force over every placement (small cases only)."""
    return min(
        makespan(costs, list(p), bins) for p in itertools.product(range(bins), repeat=len(costs))
    )


def graham_bound(bins: int) -> float:
    return 4 / 3 - 1 / (3 * bins)


@pytest.mark.parametrize("seed", range(30))
def test_lpt_is_within_grahams_bound_of_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    bins = rng.choice([2, 3])
    costs = [float(rng.randint(1, 40) ** 3) for _ in range(rng.randint(bins, 7))]
    placement = lpt_schedule(costs, bins)
    assert makespan(costs, placement, bins) <= graham_bound(bins) * optimal_makespan(costs, bins)


def test_lpt_follows_the_hand_trace_of_a_classic_case() -> None:
    # largest first to the least loaded bin: 7->0, 5->1, 4->1 (9), 3->0 (10), 3->1 (12);
    # the optimum is 11 (7+4 | 5+3+3): LPT is a heuristic, within 7/6 here
    costs = [3.0, 7.0, 4.0, 5.0, 3.0]
    placement = lpt_schedule(costs, 2)
    assert placement == [0, 0, 1, 1, 1]
    assert makespan(costs, placement, 2) == 12.0
    assert optimal_makespan(costs, 2) == 11.0


def test_lpt_updates_given_loads() -> None:
    loads = [10.0, 0.0]
    assert lpt_schedule([4.0, 4.0], 2, loads) == [1, 1]
    assert loads == [10.0, 8.0]


def layer_dims(seed: int, count: int) -> dict[str, tuple[int, int]]:
    rng = random.Random(seed)
    return {f"l{i}": (rng.randint(2, 60), rng.randint(2, 60)) for i in range(count)}


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("strategy", ["compute", "memory"])
def test_comm_opt_balances_single_factors_like_brute_force(seed: int, strategy: str) -> None:
    """COMM-OPT without colocation: every A and G is one item on the P ranks."""
    layers = layer_dims(seed, 3)
    plan = KAISAAssignment(layers, 2, "comm-opt", strategy, colocate_factors=False)
    cost = AssignmentStrategy(strategy).cost
    items = [cost(n) for dims in layers.values() for n in dims]
    best = optimal_makespan(items, 2)
    assert max(plan.loads()) <= graham_bound(2) * best
    assert sum(plan.loads()) == pytest.approx(sum(items))


@pytest.mark.parametrize("seed", range(10))
def test_mem_opt_balances_whole_layers_like_brute_force(seed: int) -> None:
    layers = layer_dims(100 + seed, 6)
    plan = KAISAAssignment(layers, 3, "mem-opt", "compute", colocate_factors=False)
    items = [float(a**3 + g**3) for a, g in layers.values()]
    assert max(plan.loads()) <= graham_bound(3) * optimal_makespan(items, 3)
    for layer in plan.layers.values():  # rows of one rank force colocation
        assert layer.a_worker == layer.g_worker
        assert layer.grad_workers == (layer.a_worker,)


def test_cost_models_differ_as_n_cubed_and_n_squared() -> None:
    # one layer of n=10 against ten layers of n=4 (A and G colocated, 2 ranks):
    # n³: big costs 2000 > all small ones together (1280): big is alone on its rank;
    # n²: big costs 200, a small one 32: LPT puts two small ones beside big (264 | 256)
    layers = {"big": (10, 10)} | {f"s{i}": (4, 4) for i in range(10)}
    compute = KAISAAssignment(layers, 2, 1.0, "compute")
    memory = KAISAAssignment(layers, 2, 1.0, "memory")
    assert sorted(compute.loads()) == [1280.0, 2000.0]
    assert sorted(memory.loads()) == [256.0, 264.0]
    big = compute.plan("big").a_worker
    assert sum(compute.plan(f"s{i}").a_worker == big for i in range(10)) == 0
    big_memory = memory.plan("big").a_worker
    assert sum(memory.plan(f"s{i}").a_worker == big_memory for i in range(10)) == 2
    assert AssignmentStrategy.COMPUTE.cost(5) == 125.0
    assert AssignmentStrategy.MEMORY.cost(5) == 25.0


def test_colocate_puts_a_and_g_on_one_rank_and_off_splits_them() -> None:
    layers = {"a": (50, 50), "b": (50, 50)}
    on = KAISAAssignment(layers, 4, "comm-opt", colocate_factors=True)
    off = KAISAAssignment(layers, 4, "comm-opt", colocate_factors=False)
    assert all(p.a_worker == p.g_worker for p in on.layers.values())
    workers_off = {w for p in off.layers.values() for w in (p.a_worker, p.g_worker)}
    assert workers_off == {0, 1, 2, 3}  # four equal factors on four ranks
    assert sorted(off.loads()) == [125000.0] * 4


@pytest.mark.parametrize("seed", range(5))
def test_hybrid_keeps_a_and_g_workers_in_the_layer_row(seed: int) -> None:
    plan = KAISAAssignment(layer_dims(seed, 12), 8, 0.25, "compute", colocate_factors=False)
    assert plan.distribution is DistributionStrategy.HYBRID_OPT
    for layer in plan.layers.values():
        assert layer.grad_workers == plan.rows[layer.row]
        assert layer.a_worker in layer.grad_workers and layer.g_worker in layer.grad_workers


@pytest.mark.parametrize(
    ("fraction", "distribution", "rows", "columns"),
    [
        ("comm-opt", DistributionStrategy.COMM_OPT, [tuple(range(8))], [(i,) for i in range(8)]),
        ("mem-opt", DistributionStrategy.MEM_OPT, [(i,) for i in range(8)], [tuple(range(8))]),
        ("hybrid-opt", DistributionStrategy.HYBRID_OPT, [(0, 1, 2, 3), (4, 5, 6, 7)],
         [(0, 4), (1, 5), (2, 6), (3, 7)]),
        (0.25, DistributionStrategy.HYBRID_OPT, [(0, 1), (2, 3), (4, 5), (6, 7)],
         [(0, 2, 4, 6), (1, 3, 5, 7)]),
    ],
)  # fmt: skip
def test_grid_shapes(
    fraction: str | float, distribution: DistributionStrategy, rows, columns
) -> None:
    plan = KAISAAssignment(layer_dims(1, 10), 8, fraction)
    assert plan.distribution is distribution
    assert [tuple(r) for r in plan.rows] == rows
    assert [tuple(c) for c in plan.columns] == columns
    for name, layer in plan.layers.items():
        for rank in range(8):
            source = plan.grad_source(name, rank)
            assert source in layer.grad_workers
            assert plan.column_of(source) == plan.column_of(rank)  # gradients go down columns
            assert (source == rank) == plan.is_grad_worker(name, rank)


def test_world_size_one_is_comm_opt() -> None:
    plan = KAISAAssignment({"x": (3, 2)}, 1, "mem-opt")
    assert plan.grad_worker_fraction == 1.0
    assert plan.distribution is DistributionStrategy.COMM_OPT
    assert plan.plan("x").a_worker == 0


@pytest.mark.parametrize(
    ("value", "world_size", "expected"),
    [("comm-opt", 4, 1.0), ("mem-opt", 4, 0.25), ("hybrid-opt", 4, 0.5), ("HYBRID_OPT", 8, 0.5),
     (0.5, 4, 0.5), (0.25, 8, 0.25), ("0.5", 2, 0.5), (1, 6, 1.0), (1 / 3, 6, 1 / 3)],
)  # fmt: skip
def test_valid_fractions(value: str | float, world_size: int, expected: float) -> None:
    assert parse_grad_worker_fraction(value, world_size) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "world_size"),
    [(0.3, 4), (0.0, 4), (1.5, 4), (-0.5, 4), ("fast", 4), (3 / 8, 8), ("hybrid-opt", 3),
     (True, 4), (0.4, 5)],
)  # fmt: skip
def test_invalid_fractions_name_the_option_and_the_valid_values(
    value: object, world_size: int
) -> None:
    with pytest.raises(ValueError, match="grad_worker_fraction") as info:
        KAISAAssignment({"x": (2, 2)}, world_size, value)  # type: ignore[arg-type]
    valid = ", ".join(f"{f:g}" for f in valid_grad_worker_fractions(world_size))
    assert valid in str(info.value)


def test_invalid_strategy_names_assignment_strategy() -> None:
    with pytest.raises(ValueError, match=r"assignment_strategy='fast'.*compute.*memory"):
        KAISAAssignment({"x": (2, 2)}, 2, 1.0, "fast")


def test_plan_is_deterministic_and_unknown_layers_are_named() -> None:
    layers = layer_dims(7, 20)
    first = KAISAAssignment(layers, 8, 0.5, "compute", colocate_factors=False)
    second = KAISAAssignment(dict(layers), 8, 0.5, "compute", colocate_factors=False)
    assert first.layers == second.layers
    with pytest.raises(KeyError, match="nope"):
        first.plan("nope")
    assert "hybrid-opt" in repr(first) and "world_size=8" in repr(first)


def test_groups_without_a_process_group_communicate_nothing() -> None:
    plan = KAISAAssignment(layer_dims(3, 4), 4, "hybrid-opt")
    groups = KAISAGroups.create(plan, rank=1)
    for name in plan.layers:
        assert groups.second_order_broadcasts(name) == []
        assert groups.grad_broadcast(name) is None


def test_grouped_layers_cost_groups_times_blocks() -> None:
    plan = KAISAAssignment({"grouped": (5, 4, 3), "plain": (5, 4)}, 2, 1.0, "compute")
    assert plan.plan("grouped").groups == 3 and plan.plan("plain").groups == 1
    assert sorted(plan.loads()) == [125.0 + 64.0, 3 * (125.0 + 64.0)]


@pytest.mark.parametrize("dims", [(0, 3), (3,), (2, 2, 2, 2), (2.5, 3)])
def test_invalid_layer_sizes_are_named(dims: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="layer 'bad'"):
        KAISAAssignment({"bad": dims}, 2)
