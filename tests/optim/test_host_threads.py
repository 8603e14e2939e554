"""Decompositions side by side on host threads: the same second-order data as one after the
other, each item with one intra-op thread, the caller's thread count restored, fallbacks kept."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim import decompose_and_broadcast
from kfac_hpc.optim.host_threads import map_side_by_side
from tests.helpers.models import small_cnn

CPU = torch.device("cpu")


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _seen(item: int, together: threading.Barrier | None = None) -> tuple[int, int, int]:
    """(item, the running thread, its intra-op thread count); items 0 and 1 first wait for
    each other at ``together``, which only two threads running at once can pass."""
    if together is not None and item < 2:
        together.wait()
    return item, threading.get_ident(), torch.get_num_threads()


def test_items_run_on_two_threads_at_once_with_one_intra_op_thread_each(
    two_threads: None,
) -> None:
    together = threading.Barrier(2, timeout=30)
    results = map_side_by_side(partial(_seen, together=together), list(range(6)), CPU)
    assert [item for item, _, _ in results] == list(range(6))  # in the items' order
    assert len({ident for _, ident, _ in results}) == 2
    assert threading.get_ident() not in {ident for _, ident, _ in results}
    assert {threads for _, _, threads in results} == {1}
    assert torch.get_num_threads() == 2


def test_one_intra_op_thread_or_a_non_cpu_device_runs_in_the_callers_thread(
    two_threads: None,
) -> None:
    for device in (torch.device("meta"), torch.device("cuda")):
        results = map_side_by_side(_seen, [0, 1], device)
        assert {ident for _, ident, _ in results} == {threading.get_ident()}
    torch.set_num_threads(1)
    results = map_side_by_side(_seen, [0, 1, 2], CPU)
    assert {ident for _, ident, _ in results} == {threading.get_ident()}


def test_an_error_propagates_and_the_thread_count_is_restored(two_threads: None) -> None:
    def fails(item: int) -> int:
        if item == 3:
            raise ValueError("item 3")
        return item

    with pytest.raises(ValueError, match="item 3"):
        map_side_by_side(fails, list(range(5)), CPU)
    assert torch.get_num_threads() == 2


def _preconditioned(method: str) -> list[torch.Tensor]:
    """Preconditioned gradients of two float64 steps of the small CNN (factors and
    decompositions every step)."""
    torch.manual_seed(0)
    model = small_cnn().double()
    pre = KFACPreconditioner(model, compute_method=method)
    grads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        x, y = torch.randn(8, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads


def _in_layer_order(
    self: decompose_and_broadcast.SecondOrderUpdate, work: list[Any], damping: float
) -> list[Any]:
    """Reference: every (layer, factor) in layer order in the caller's thread, with one
    intra-op thread for a factor up to the limit (as in the pool), every thread above it."""
    threads, results = torch.get_num_threads(), []
    limit = decompose_and_broadcast.SIDE_BY_SIDE_MAX_N
    try:
        for state, key in work:
            width = state.layer.factor_shapes["AG".index(key)][-1]
            torch.set_num_threads(1 if width <= limit else threads)
            a, g = state.factors.A, state.factors.G
            results.append(self.method.compute(a, g, damping, [key])[key])
    finally:
        torch.set_num_threads(threads)
    return results


@pytest.mark.parametrize("limit", [1024, 20])  # 20: small_cnn's factors both wider and not
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_side_by_side_decompositions_give_the_layer_order_result_bit_for_bit(
    method: str, limit: int, two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decompose_and_broadcast, "SIDE_BY_SIDE_MAX_N", limit)
    name = "eigh" if method == "eigen" else "inv"
    real, threads = getattr(torch.linalg, name), set()

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, name, recorded)
    side_by_side = _preconditioned(method)
    assert threads - {threading.get_ident()}  # the pool's threads ran some
    monkeypatch.setattr(decompose_and_broadcast.SecondOrderUpdate, "_decompose", _in_layer_order)
    reference = _preconditioned(method)
    assert len(side_by_side) == len(reference) > 0
    for a, b in zip(side_by_side, reference, strict=True):
        assert torch.equal(a, b)


def test_failing_decompositions_side_by_side_warn_once_per_layer_from_the_caller(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small_cnn()
    pre = KFACPreconditioner(model)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    real_warn, warned_from = warnings.warn, set()

    def warn(*args: Any, **kwargs: Any) -> None:
        warned_from.add(threading.get_ident())
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        real_warn(*args, **kwargs)

    monkeypatch.setattr(decompose_and_broadcast.warnings, "warn", warn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            pre.step()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == len(pre.layers), messages
    assert all("using the identity" in m for m in messages)
    assert warned_from == {threading.get_ident()}
    assert torch.get_num_threads() == 2


def test_factors_wider_than_the_limit_run_in_the_callers_thread(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    real, seen = torch.linalg.eigh, []

    def recorded(matrix: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append((matrix.shape[-1], threading.get_ident()))
        return real(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", recorded)
    monkeypatch.setattr(decompose_and_broadcast, "SIDE_BY_SIDE_MAX_N", 20)
    _preconditioned("eigen")
    caller = threading.get_ident()
    wide = {ident for n, ident in seen if n > 20}
    narrow = {ident for n, ident in seen if n <= 20}
    assert wide == {caller}
    assert narrow and caller not in narrow


def test_calls_after_the_pool_exists_leave_the_thread_settings_alone(
    two_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    map_side_by_side(_seen, [0, 1], CPU)  # the pool exists from here on
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # each call clears caches
    results = map_side_by_side(_seen, list(range(4)), CPU)
    assert calls == []
    assert {threads for _, _, threads in results} == {1}
