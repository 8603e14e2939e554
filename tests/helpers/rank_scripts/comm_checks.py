"""Started as N real ranks by tests/comm/test_collectives_mpi.py: runs every multi-rank check of
kfac_hpc.comm in one job (starting ranks is the slow part) through
:func:`tests.helpers.rank_checks.run_checks`: one JSON record per rank and check, and the first
failure on any rank ends the job at once."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from kfac_hpc.comm import (
    AsyncBroadcaster,
    FactorAllreducer,
    KAISAAssignment,
    KAISAGroups,
    any_rank,
    valid_grad_worker_fractions,
)
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.rank_checks import main_or_leave, run_checks

SHAPES = [(1,), (7,), (3, 5, 7), (64, 64), (1000,), (33, 17), (300, 300), (5,), (2, 2)]
CAPS_MB = [0.0, 0.0001, 0.004, 0.05, 1.0, 25.0]


def rank_tensor(shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Different random data on every rank, reproducible from (rank, salt)."""
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def plain_mean(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def check_bucketed_equals_plain() -> None:
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for cap in CAPS_MB:
            tensors = [rank_tensor(s, dtype, i) for i, s in enumerate(SHAPES)]
            expected = [plain_mean(t) for t in tensors]
            reducer = FactorAllreducer(bucket_cap_mb=cap)
            for i, t in enumerate(tensors):
                reducer.submit(f"t{i}", t)
            names = reducer.wait()
            assert names == [f"t{i}" for i in range(len(SHAPES))] or sorted(names) == sorted(
                f"t{i}" for i in range(len(SHAPES))
            ), names
            for i, (got, want) in enumerate(zip(tensors, expected, strict=True)):
                torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, msg=f"cap {cap} t{i}")


def check_bucketed_exact_on_integers() -> None:
    # integer-valued data sums exactly in any order: the packing itself must be lossless
    for cap in CAPS_MB:
        tensors = [rank_tensor(s, torch.float32, 7).mul(8).round() for s in SHAPES]
        expected = [plain_mean(t) for t in tensors]
        reducer = FactorAllreducer(bucket_cap_mb=cap)
        for i, t in enumerate(tensors):
            reducer.submit(f"t{i}", t)
        reducer.wait()
        for got, want in zip(tensors, expected, strict=True):
            assert torch.equal(got, want), f"cap {cap}: {got.flatten()[:4]} != {want.flatten()[:4]}"


def check_bucket_launches_when_full() -> None:
    cap_mb = 0.01  # 10486 bytes: a 40x40 float64 (12800 bytes) fills a bucket by itself
    reducer = FactorAllreducer(bucket_cap_mb=cap_mb)
    small = rank_tensor((10,), torch.float64, 1)
    reducer.submit("small", small)
    assert reducer.buckets_in_flight == 0, "a bucket below the cap was launched"
    big = rank_tensor((40, 40), torch.float64, 2)
    expected_small, expected_big = plain_mean(small), plain_mean(big)
    reducer.submit("big", big)
    # "small" could not take "big" without passing the cap: launched; "big" alone fills its own
    assert reducer.buckets_in_flight == 2, reducer.buckets_in_flight
    reducer.wait()
    assert reducer.buckets_in_flight == 0
    torch.testing.assert_close(small, expected_small, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(big, expected_big, rtol=1e-12, atol=1e-12)


def symmetric(n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    x = rank_tensor((n, n + 3), dtype, salt)
    return x @ x.T


def check_triangle_packing() -> None:
    for cap in (0.0, 0.002, 25.0):
        for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            stack = torch.stack([symmetric(6, dtype, 70 + g) for g in range(3)])  # grouped conv
            strided = symmetric(9, dtype, 80).T  # a non-contiguous view (still symmetric)
            # packed in parts (_Triangle.PACK_ELEMENTS): by rows of one wide matrix, by whole
            # matrices of a stack of many small ones, one matrix at a time of a stack
            wide = symmetric(200, dtype, 81)
            many = torch.stack([symmetric(9, dtype, 90 + g) for g in range(300)])
            mid = torch.stack([symmetric(100, dtype, 85 + g) for g in range(3)])
            mats = [symmetric(n, dtype, n) for n in (1, 2, 5, 16, 40)]
            mats += [stack, strided, wide, many, mid]
            plain = [rank_tensor((3, 4), dtype, 99)]
            expected = [plain_mean(t) for t in mats + plain]
            reducer = FactorAllreducer(bucket_cap_mb=cap, symmetric=True)
            for i, m in enumerate(mats):
                reducer.submit(f"m{i}", m)
            reducer.submit("plain", plain[0], symmetric=False)  # mixed into the same buckets
            reducer.wait()
            for got, want in zip(mats + plain, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
            for m in mats:
                assert torch.equal(m, m.mT), "rebuilt matrix is not exactly symmetric"


def check_reduce_to_owner() -> None:
    size = dist.get_world_size()
    tensors = {dst: rank_tensor((6, 6), torch.float64, 50 + dst) for dst in range(size)}
    before = {dst: t.clone() for dst, t in tensors.items()}
    expected = {dst: plain_mean(t) for dst, t in tensors.items()}
    reducer = FactorAllreducer(bucket_cap_mb=25.0, symmetric=False)
    for dst, t in tensors.items():
        reducer.submit(f"to{dst}", t, dst=dst)
    written = reducer.wait()
    me = dist.get_rank()
    assert written == [f"to{me}"], written
    for dst, t in tensors.items():
        want = expected[dst] if dst == me else before[dst]
        torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-12)


def check_reduce_to_owner_taken_whole() -> None:
    """``write_back=False``: no rank keeps the submitted tensor (the caller zeroes it at once);
    the owner takes the mean, rebuilt whole from the packed triangle; the others have none."""
    size, me = dist.get_world_size(), dist.get_rank()
    mats = {dst: symmetric(7, torch.float64, 60 + dst) for dst in range(size)}
    plain = rank_tensor((3, 4), torch.float64, 69)
    expected = {f"to{dst}": plain_mean(m) for dst, m in mats.items()} | {"v": plain_mean(plain)}
    reducer = FactorAllreducer(bucket_cap_mb=25.0, reduce_bucket_cap_mb=0.001)
    for dst, m in mats.items():
        reducer.submit(f"to{dst}", m, dst=dst, symmetric=True, write_back=False)
        m.zero_()
    reducer.submit("v", plain, dst=size - 1, write_back=False)
    plain.zero_()
    mine = [f"to{me}"] + (["v"] if me == size - 1 else [])
    assert sorted(reducer.wait()) == sorted(mine), mine
    assert sorted(reducer.arrived) == sorted(mine)
    taken = {name: reducer.take(name) for name in mine}
    for name, got in taken.items():
        torch.testing.assert_close(got, expected[name], rtol=1e-12, atol=1e-12)
    assert torch.equal(taken[f"to{me}"], taken[f"to{me}"].mT), "rebuilt matrix is not symmetric"
    assert reducer.arrived == []
    for dst in range(size):
        if dst != me:
            try:
                reducer.take(f"to{dst}")
            except KeyError:
                continue
            raise AssertionError(f"rank {me} took the mean of to{dst}")


def check_owner_buckets_bounded() -> None:
    """Open owner buckets of all destinations together stay within ``reduce_bucket_cap_mb``
    (a tensor for another owner launches the open one first) and at most
    ``reduce_in_flight_mb`` of them is in flight; every owner still gets its exact mean.
    How many are in flight also depends on when the asynchronous reductions complete (a
    finished one is released at the next submit), so only the bound is asserted."""
    size, me = dist.get_world_size(), dist.get_rank()
    cap_mb = 4000 / 2**20  # one 20x20 float64 (3200 bytes) fits, two do not
    reducer = FactorAllreducer(
        bucket_cap_mb=25.0, reduce_bucket_cap_mb=cap_mb, reduce_in_flight_mb=cap_mb
    )
    tensors = [rank_tensor((20, 20), torch.float64, 30 + i) for i in range(2 * size)]
    before = [t.clone() for t in tensors]
    expected = [plain_mean(t) for t in tensors]
    for i, t in enumerate(tensors):
        reducer.submit(f"t{i}", t, dst=i % size)
        assert reducer.buckets_in_flight <= 1, (i, reducer.buckets_in_flight)
    reducer.wait()
    for i, t in enumerate(tensors):
        want = expected[i] if i % size == me else before[i]
        torch.testing.assert_close(t, want, rtol=1e-12, atol=1e-12)


def check_subgroup_reduction_and_broadcast() -> None:
    """Even and odd ranks form two groups; each averages and broadcasts within its own."""
    me, size = dist.get_rank(), dist.get_world_size()
    members = {parity: list(range(parity, size, 2)) for parity in (0, 1)}
    groups = {parity: dist.new_group(ranks) for parity, ranks in members.items()}  # all ranks
    mine, group = members[me % 2], groups[me % 2]
    tensor = torch.tensor([float(me), 1.0, 10.0 * me])
    reducer = FactorAllreducer(bucket_cap_mb=1.0, group=group)
    reducer.submit("t", tensor)
    reducer.wait()
    want = torch.tensor([sum(mine) / len(mine), 1.0, 10.0 * sum(mine) / len(mine)])
    torch.testing.assert_close(tensor, want, rtol=1e-6, atol=1e-6)
    assert any_rank(me == mine[-1], group=group) is True
    received = torch.full((2,), float(me))
    bc = AsyncBroadcaster(group)
    bc.broadcast(received, src=mine[-1])
    bc.wait()
    assert torch.equal(received, torch.full((2,), float(mine[-1]))), received


def check_any_rank() -> None:
    me = dist.get_rank()
    assert any_rank(me == dist.get_world_size() - 1) is True
    assert any_rank(False) is False
    assert any_rank(True) is True


def check_world_broadcast() -> None:
    size = dist.get_world_size()
    bc = AsyncBroadcaster()
    tensors = [torch.full((5, 3), float(dist.get_rank())) for _ in range(size)]
    for src, t in enumerate(tensors):
        bc.broadcast(t, src=src)
    bc.wait()
    for src, t in enumerate(tensors):
        assert torch.equal(t, torch.full((5, 3), float(src))), (src, t)


def check_bucketed_broadcast() -> None:
    """Every rank sends tensors of many shapes and two dtypes; buckets of any cap deliver the
    same data as one broadcast per tensor, also into non-contiguous receivers."""
    me, size = dist.get_rank(), dist.get_world_size()
    for cap in CAPS_MB:
        bc = AsyncBroadcaster(bucket_cap_mb=cap)
        received: list[tuple[torch.Tensor, torch.Tensor]] = []
        for src in range(size):
            for i, shape in enumerate(SHAPES):
                dtype = torch.float64 if i % 2 else torch.float32
                want = torch.full(shape, 100.0 * src + i, dtype=dtype)
                if len(shape) == 2 and shape[0] == shape[1]:  # receive into a transposed view
                    tensor = want.clone().T if me == src else torch.zeros(shape, dtype=dtype).T
                else:
                    tensor = want.clone() if me == src else torch.zeros(shape, dtype=dtype)
                bc.broadcast(tensor, src)
                received.append((tensor, want))
        bc.wait()
        for tensor, want in received:
            assert torch.equal(tensor, want), (
                f"cap {cap}: {tensor.flatten()[:3]} != {want.flatten()[:3]}"
            )


def layer_sizes() -> dict[str, tuple[int, int]]:
    return {f"layer{i}": (3 + 5 * i, 2 + 3 * (i % 4)) for i in range(9)}


def kaisa_flow(fraction: float, colocate: bool) -> None:
    """Second-order data along rows, preconditioned gradients down columns, as the optimizer
    does: every rank must end with every layer's gradient, and hold second-order data only for
    the layers it is a grad worker of."""
    me, size = dist.get_rank(), dist.get_world_size()
    plan = KAISAAssignment(layer_sizes(), size, fraction, "compute", colocate_factors=colocate)
    groups = KAISAGroups.create(plan)
    bc = AsyncBroadcaster()
    second_order: dict[tuple[str, str], torch.Tensor] = {}

    def value(name: str, factor: str) -> float:
        return 10.0 * list(plan.layers).index(name) + "AG".index(factor)

    for name, layer in plan.layers.items():
        for factor, src, group in groups.second_order_broadcasts(name):
            n = layer.a_size if factor == "A" else layer.g_size
            fill = value(name, factor) if me == src else -1.0
            second_order[name, factor] = torch.full((n, n), fill)
            bc.broadcast(second_order[name, factor], src, group)
    bc.wait()
    for (name, factor), t in second_order.items():
        assert plan.is_grad_worker(name, me), f"rank {me} got second-order data of {name}"
        assert torch.all(t == value(name, factor)), (name, factor)
    if plan.grad_worker_count > 1:
        expected = {
            (name, f) for name in plan.layers if plan.is_grad_worker(name, me) for f in "AG"
        }
        assert set(second_order) == expected, (sorted(second_order), sorted(expected))
    grads = {}
    for i, name in enumerate(plan.layers):
        worker = plan.is_grad_worker(name, me)
        grads[name] = torch.full((4,), float(i) if worker else float("nan"))
        target = groups.grad_broadcast(name)
        if target is not None:
            src, group = target
            assert plan.is_grad_worker(name, src), (name, src)
            bc.broadcast(grads[name], src, group)
        else:
            assert worker, f"rank {me} is no grad worker of {name} and receives nothing"
    bc.wait()
    for i, name in enumerate(plan.layers):
        assert torch.equal(grads[name], torch.full((4,), float(i))), (name, grads[name])


def main() -> None:
    ctx = init_distributed(backend="gloo", timeout_s=300)
    checks: dict[str, Callable[[], None]] = {
        "bucketed_equals_plain": check_bucketed_equals_plain,
        "bucketed_exact_on_integers": check_bucketed_exact_on_integers,
        "bucket_launches_when_full": check_bucket_launches_when_full,
        "triangle_packing": check_triangle_packing,
        "reduce_to_owner": check_reduce_to_owner,
        "reduce_to_owner_taken_whole": check_reduce_to_owner_taken_whole,
        "owner_buckets_bounded": check_owner_buckets_bounded,
        "any_rank": check_any_rank,
        "subgroup_reduction_and_broadcast": check_subgroup_reduction_and_broadcast,
        "world_broadcast": check_world_broadcast,
        "bucketed_broadcast": check_bucketed_broadcast,
    }
    for fraction in valid_grad_worker_fractions(ctx.world_size):
        for colocate in (True, False):
            checks[f"kaisa_flow_f{fraction:g}_colocate{colocate}"] = partial(
                kaisa_flow, fraction, colocate
            )
    if os.environ.get("KFAC_HPC_FAIL_CHECK_ON_RANK"):  # the harness's own test: one rank fails
        name, rank = os.environ["KFAC_HPC_FAIL_CHECK_ON_RANK"].split("@")
        checks[name] = partial(fail_on_rank, checks[name], int(rank))
    run_checks(checks)
    shutdown()


def fail_on_rank(check: Callable[[], None], rank: int) -> None:
    """``check`` with a failure on ``rank`` before its first collective, while the other ranks
    go on into it: the job must end with the failure reported, not hang."""
    if dist.get_rank() == rank:
        raise AssertionError(f"injected failure on rank {rank}")
    check()


if __name__ == "__main__":
    main_or_leave(main)
