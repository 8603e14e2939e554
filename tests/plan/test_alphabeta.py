"""The α-β model: step counts of each collective, the fit on synthetic timings of known α, β,
and the bucketed allreduce (placement: test_placement.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kfac_hpc.plan.alphabeta import AlphaBeta, fit_alpha_beta, step_counts
from kfac_hpc.plan.model import bucketed_allreduce_s, collective_s
from kfac_hpc.plan.profiles import NetworkProfile


@pytest.mark.parametrize(
    ("collective", "ranks", "expected"),
    [
        ("allreduce", 1, (0.0, 0.0)),
        ("allreduce", 4, (6.0, 1.5)),  # ring: 2(P-1) steps, 2(P-1)/P of the data per rank
        ("allreduce", 8, (14.0, 1.75)),
        ("broadcast", 2, (1.0, 1.0)),
        ("broadcast", 5, (3.0, 3.0)),  # binomial tree: ceil(log2 P) rounds
        ("reduce", 8, (3.0, 3.0)),
    ],
)
def test_step_counts(collective, ranks, expected) -> None:
    assert step_counts(collective, ranks) == expected


def test_unknown_collective_is_an_error() -> None:
    with pytest.raises(ValueError, match="allgather"):
        step_counts("allgather", 4)


def test_fit_recovers_known_alpha_beta_from_noisy_timings() -> None:
    truth = AlphaBeta(alpha_s=25e-6, beta_s_per_byte=1 / 8e9)
    rng = np.random.default_rng(0)
    samples = []
    for collective in ("allreduce", "broadcast", "reduce"):
        for ranks in (2, 4, 8):
            for nbytes in (1e3, 1e4, 1e5, 1e6, 1e7):
                noise = 1 + rng.uniform(-0.02, 0.02)  # ±2 % measurement noise
                samples.append(
                    (collective, ranks, nbytes, truth.time_s(collective, nbytes, ranks) * noise)
                )
    fitted = fit_alpha_beta(samples)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=0.03)
    assert fitted.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=0.03)


def test_fit_of_exact_timings_is_exact() -> None:
    truth = AlphaBeta(3e-6, 1 / 20e9)
    samples = [
        ("allreduce", p, n, truth.time_s("allreduce", n, p)) for p in (2, 4) for n in (1e4, 1e6)
    ]
    fitted = fit_alpha_beta(samples)
    assert fitted.alpha_s == pytest.approx(3e-6, rel=1e-9)
    assert fitted.beta_s_per_byte == pytest.approx(1 / 20e9, rel=1e-9)


def test_fit_never_returns_a_negative_latency() -> None:
    # pure bandwidth timings with a slight negative intercept still fit alpha = 0
    samples = [("allreduce", 2, n, n / 1e9 - 1e-7) for n in (1e5, 1e6, 1e7)]
    fitted = fit_alpha_beta(samples)
    assert fitted.alpha_s == 0.0
    assert fitted.beta_s_per_byte == pytest.approx(1e-9, rel=0.01)


def test_fit_needs_two_usable_samples() -> None:
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta([("allreduce", 1, 1e6, 1e-3), ("allreduce", 2, 1e6, 1e-3)])


def test_buckets_pay_one_latency_each() -> None:
    link = AlphaBeta(1e-3, 0.0)
    net = NetworkProfile("t", 64, link, link)
    # 60 MiB in 25 MiB buckets: 3 allreduces of 2(P-1) = 2 steps each at P = 2
    assert bucketed_allreduce_s(net, 60 * 2**20, 2, 25.0) == pytest.approx(3 * 2 * 1e-3)


def test_small_gloo_allreduce_at_large_p_takes_the_binomial_trees() -> None:
    link = AlphaBeta(10e-6, 1 / 20e9)
    net = NetworkProfile("t", 1 << 20, link, link, backend="gloo")
    small, large = 4e3, 1e9
    tree = 2 * 10 * (10e-6 + small / 20e9)  # reduce + broadcast, ceil(log2 1024) = 10 rounds
    assert collective_s(net, "allreduce", small, 1024) == pytest.approx(tree)
    ring = 2046 * 10e-6 + 2 * 1023 / 1024 * large / 20e9
    assert collective_s(net, "allreduce", large, 1024) == pytest.approx(ring)
