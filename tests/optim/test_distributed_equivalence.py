"""Distributed K-FAC gives the same preconditioned gradients at world sizes 1, 2 and 4.

Real processes (mpiexec, gloo) run tests/helpers/rank_scripts/kfac_equivalence.py: the same
float64 model and
global batch of 16, split over the ranks, under COMM-OPT, MEM-OPT, HYBRID-OPT (and the float
fraction 0.5), eigen and inverse methods, colocated and split factors, triangle packing, tiny
buckets, factors outside hooks and stale second-order data. Three K-FAC + SGD steps each.

Tolerance (float64): every preconditioned gradient and factor of world size P agrees with world
size 1 to ``|Δ| ≤ 1e-10 · max|reference|`` per tensor (observed: ≈ 2e-14); ranks of one job
agree bitwise. MEM-OPT must really save memory: second-order data only on each layer's grad
workers, so the per-rank ``second_order_bytes`` of MEM-OPT add up to those of one COMM-OPT rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import run_mpi
from tests.helpers.launch import RANK_SCRIPTS

pytestmark = pytest.mark.mpi

SCRIPT = RANK_SCRIPTS / "kfac_equivalence.py"
RTOL = 1e-10
_runs: dict[int, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("equivalence")


def run(world_size: int, out_dir: Path) -> list[dict[str, Any]]:
    """Per-rank results of one job of ``world_size`` ranks (started once per module)."""
    if world_size not in _runs:
        proc = run_mpi(world_size, [sys.executable, str(SCRIPT), str(out_dir)], timeout=300)
        assert proc.returncode == 0, f"ranks failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        ranks = [
            torch.load(out_dir / f"p{world_size}_rank{r}.pt", weights_only=True)
            for r in range(world_size)
        ]
        assert [r["world_size"] for r in ranks] == [world_size] * world_size
        assert [r["rank"] for r in ranks] == list(range(world_size))
        _runs[world_size] = [r["results"] for r in ranks]
    return _runs[world_size]


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    bound = RTOL * max(want.abs().max().item(), 1e-300)
    err = (got - want).abs().max().item()
    assert err <= bound, f"{what}: max |Δ| {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_preconditioned_gradients_match_world_size_one(world_size: int, out_dir: Path) -> None:
    reference = run(1, out_dir)[0]
    ranks = run(world_size, out_dir)
    assert set(ranks[0]) == set(reference)
    for config, ref in reference.items():
        for rank, results in enumerate(ranks):
            mine = results[config]
            for step, (grads, ref_grads) in enumerate(
                zip(mine["grads"], ref["grads"], strict=True)
            ):
                for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
                    close(g, r, f"{config} P={world_size} rank {rank} step {step} param {i}")
            for step, (factors, ref_factors) in enumerate(
                zip(mine["factors"], ref["factors"], strict=True)
            ):
                assert set(factors) == set(ref_factors)
                for key, value in factors.items():
                    close(value, ref_factors[key], f"{config} P={world_size} step {step} {key}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_of_one_job_hold_identical_gradients(world_size: int, out_dir: Path) -> None:
    ranks = run(world_size, out_dir)
    for config in ranks[0]:
        for rank in range(1, world_size):
            for step, (a, b) in enumerate(
                zip(ranks[rank][config]["grads"], ranks[0][config]["grads"], strict=True)
            ):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (
                    f"{config}: rank {rank} differs from rank 0 at step {step}"
                )


@pytest.mark.parametrize("world_size", [2, 4])
def test_fractions_resolve_to_the_expected_grad_worker_counts(
    world_size: int, out_dir: Path
) -> None:
    results = run(world_size, out_dir)[0]
    assert results["comm_eigen"]["fraction"] == 1.0
    assert results["mem_eigen"]["fraction"] == 1 / world_size
    assert results["hybrid_eigen_split"]["fraction"] == 0.5
    assert results["half_eigen_stale_inverse"]["fraction"] == 0.5


@pytest.mark.parametrize("world_size", [2, 4])
def test_second_order_data_lives_only_on_grad_workers(world_size: int, out_dir: Path) -> None:
    ranks = run(world_size, out_dir)
    layers = len(ranks[0]["comm_eigen"]["grad_worker_layers"])
    assert layers == 5
    for config in ranks[0]:
        for results in ranks:
            held = results[config]
            assert held["second_order_layers"] == held["grad_worker_layers"], config
    mem_counts = [len(r["mem_eigen"]["second_order_layers"]) for r in ranks]
    assert sum(mem_counts) == layers  # each layer on exactly one rank


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(("mem", "comm"), [("mem_eigen", "comm_eigen"),
                                           ("mem_inverse_kl", None)])  # fmt: skip
def test_mem_opt_memory_usage_adds_up_to_one_comm_opt_rank(
    world_size: int, mem: str, comm: str | None, out_dir: Path
) -> None:
    """MEM-OPT: the second-order bytes of all ranks together equal those of ONE COMM-OPT rank
    (eigen; for the inverse method the COMM-OPT figure is that of the 1-rank run), so each
    rank holds ≈ 1/P; the factors too are kept only where they are decomposed, so their bytes
    over all ranks equal those of one COMM-OPT rank."""
    ranks = run(world_size, out_dir)
    if comm is None:
        full = run(1, out_dir)[0][mem]["memory"]["second_order_bytes"]
    else:
        full = ranks[0][comm]["memory"]["second_order_bytes"]
    per_rank = [r[mem]["memory"]["second_order_bytes"] for r in ranks]
    assert sum(per_rank) == full, (per_rank, full)
    assert all(0 < b < full for b in per_rank), per_rank
    factors = [r[mem]["memory"]["factors_bytes"] for r in ranks]
    assert sum(factors) == ranks[0]["comm_eigen"]["memory"]["factors_bytes"], factors


def test_mem_opt_non_owners_hold_no_factor_tensors(out_dir: Path) -> None:
    """MEM-OPT at 4 ranks: a rank holds exactly the running factors it decomposes (no
    pending sums, nothing for other layers), each factor on exactly one rank; COMM-OPT keeps
    every factor everywhere."""
    ranks = run(4, out_dir)
    assert len(ranks) == 4
    every = sorted(ranks[0]["comm_eigen"]["held_factors"])
    assert len(every) == 10  # 5 layers × (A, G)
    for results in ranks:
        assert results["comm_eigen"]["held_factors"] == every
    held = [r["mem_eigen"]["held_factors"] for r in ranks]
    for results, mine in zip(ranks, held, strict=True):
        assert mine == results["mem_eigen"]["inverse_worker_of"]
    assert sorted(f for mine in held for f in mine) == every
    assert sum(1 for mine in held if len(mine) < len(every)) == 4


def test_mem_opt_ranks_drop_statistics_during_backward(out_dir: Path) -> None:
    """MEM-OPT at 4 ranks: when ``backward()`` returns (before ``step()``), no rank holds a
    full statistic of this step (each was reduced to its owner and dropped from the hooks,
    on the owner too), and the reduced statistics that already arrived on a rank are of
    factors it decomposes; COMM-OPT holds every statistic on every rank."""
    ranks = run(4, out_dir)
    assert len(ranks) == 4
    every = sorted(ranks[0]["comm_eigen"]["held_factors"])
    for results in ranks:
        assert all(p == every for p in results["comm_eigen"]["pending_after_backward"])
        mine = set(results["mem_eigen"]["inverse_worker_of"])
        assert all(p == [] for p in results["mem_eigen"]["pending_after_backward"])
        arrived = results["mem_eigen"]["arrived_after_backward"]
        assert all(set(names) <= mine for names in arrived), (arrived, mine)


def test_hybrid_opt_holds_each_layer_on_one_row(out_dir: Path) -> None:
    """HYBRID-OPT at 4 ranks (rows of 2): second-order bytes over all ranks = 2 COMM-OPT ranks."""
    ranks = run(4, out_dir)
    full = ranks[0]["comm_eigen"]["memory"]["second_order_bytes"]
    per_rank = [r["hybrid_eigen_split"]["memory"]["second_order_bytes"] for r in ranks]
    assert sum(per_rank) == 2 * full, (per_rank, full)
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]  # a row holds the same


@pytest.mark.parametrize("world_size", [2, 4])
def test_factor_reduction_starts_during_the_backward_pass(world_size: int, out_dir: Path) -> None:
    """With factors updated in hooks and 1 KiB buckets, buckets are already in flight when
    ``backward()`` returns; without hooks nothing is launched before ``step()``."""
    results = run(world_size, out_dir)[0]
    assert all(n > 0 for n in results["comm_eigen_split_sym"]["buckets_in_flight_after_backward"])
    assert results["comm_no_hook_no_outer"]["buckets_in_flight_after_backward"] == [0, 0, 0]
