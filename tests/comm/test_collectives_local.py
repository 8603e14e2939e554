"""The collectives in one process without torch.distributed: no-ops that keep the data, and
input validation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kfac_hpc.comm import AsyncBroadcaster, FactorAllreducer, any_rank, group_size


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized()


def test_single_process_reduction_keeps_tensors_and_reports_names() -> None:
    reducer = FactorAllreducer(bucket_cap_mb=0.0, symmetric=True)
    a = torch.eye(3) * 2
    b = torch.arange(6.0)
    reducer.submit("a", a)
    reducer.submit("b", b, symmetric=False)
    assert reducer.pending
    assert reducer.buckets_in_flight == 0
    assert reducer.wait() == []
    assert not reducer.pending
    assert torch.equal(a, torch.eye(3) * 2) and torch.equal(b, torch.arange(6.0))
    assert group_size() == 1


def test_single_process_take_returns_a_copy_of_the_local_tensor() -> None:
    reducer = FactorAllreducer(symmetric=True)
    a = torch.eye(3) * 2
    reducer.submit("a", a, dst=0, write_back=False)
    assert reducer.wait() == []
    assert reducer.arrived == ["a"]
    got = reducer.take("a")
    assert torch.equal(got, a) and got.data_ptr() != a.data_ptr()
    with pytest.raises(KeyError, match="no arrived mean of 'a'"):
        reducer.take("a")


def test_invalid_bucket_cap_names_the_option() -> None:
    with pytest.raises(ValueError, match="allreduce_bucket_cap_mb=-1"):
        FactorAllreducer(bucket_cap_mb=-1)
    with pytest.raises(ValueError, match=r"reduce_in_flight_mb=-2"):
        FactorAllreducer(reduce_in_flight_mb=-2)
    with pytest.raises(ValueError, match=r"bucket_cap_mb=-0\.5"):
        AsyncBroadcaster(bucket_cap_mb=-0.5)


def test_same_name_twice_is_refused() -> None:
    reducer = FactorAllreducer()
    reducer.submit("x", torch.zeros(2))
    with pytest.raises(ValueError, match="'x' was submitted twice"):
        reducer.submit("x", torch.zeros(2))
    reducer.wait()
    reducer.submit("x", torch.zeros(2))  # a new round after wait()


def test_broadcast_and_flag_without_process_group() -> None:
    bc = AsyncBroadcaster()
    t = torch.ones(3)
    bc.broadcast(t, src=0)
    bc.wait()
    assert torch.equal(t, torch.ones(3))
    assert any_rank(True) is True and any_rank(False) is False


def test_triangle_packing_refuses_non_square_tensors() -> None:
    with pytest.raises(ValueError, match=r"'v' of shape \(2, 3\) is not square"):
        FactorAllreducer(symmetric=True).submit("v", torch.zeros(2, 3))
