"""What the K-FAC preconditioner adds to the forward: the small CNN in one process, one thread.

    .venv/bin/python benchmarks/bench_kfac_forward.py [--rounds 6] [--batch 64]

The small CNN on digits-shaped input (1×8×8), the job's step in a loop (forward with the loss,
gradients set to None, backward, the preconditioner's step when registered, SGD's update), its
forward timed; variants, interleaved by rounds: plain SGD, K-FAC registered with factors every
step (its forward hook captures each step), and K-FAC registered with factors never updated
(its hook returns at once). Per variant the median forward over a round's steps, then the
median (min-max) over rounds, and K-FAC's extra per layer against ``plan calibrate``'s
``kfac_forward_layer_s`` measured in the same invocation. Then cProfile of the factor-step
variant's forwards: where the hook's time goes.

Writes benchmarks/results/bench_kfac_forward.json.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from typing import Any

import harness  # benchmarks/harness.py, beside this script
import torch
from torch import nn

from kfac_hpc.optim.preconditioner import KFACPreconditioner
from kfac_hpc.plan.layer_rates import kfac_forward_layer_s
from kfac_hpc.train.models import SmallCNN

STEPS, WARMUP = 60, 5
VARIANTS = {"sgd": None, "kfac-factors": 1, "kfac-no-factors": 10**9}
LAYERS = 4  # the small CNN's K-FAC layers


def _loop(batch: int, factor_steps: int | None, profile: cProfile.Profile | None = None) -> float:
    """The median forward seconds of STEPS job-like steps (after WARMUP)."""
    torch.manual_seed(0)
    net = SmallCNN(1, 10)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    pre = None
    if factor_steps is not None:
        pre = KFACPreconditioner(net, factor_update_steps=factor_steps, inv_update_steps=10)
    x, y = torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))
    times = []
    for step in range(WARMUP + STEPS):
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(net(x), y)
        end = time.perf_counter()
        if profile is not None:
            profile.disable()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if pre is not None:
            pre.step()
        opt.step()
        if step >= WARMUP:
            times.append(end - start)
    return statistics.median(times)


def main() -> int:
    parser = harness.parser(__doc__, rounds=6)
    parser.add_argument("--batch", type=int, default=64, help="the local batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench = harness.Benchmark("bench_kfac_forward")
    variants: dict[str, Any] = {
        name: (lambda index, steps=steps: _loop(args.batch, steps))
        for name, steps in VARIANTS.items()
    }
    variants["calibrate-hook"] = lambda index: kfac_forward_layer_s(torch.device("cpu"))
    measured = harness.interleave(variants, args.rounds, warmup=1)
    results: dict[str, Any] = {"batch": args.batch}
    print(f"forward, batch {args.batch}, one thread: median (min-max) over {args.rounds} rounds")
    for name in VARIANTS:
        stats = harness.Stats.of(measured[name]).scaled(1e3)
        results[name] = stats.as_dict()
        print(f"  {name:<16} {stats:.3f} ms")
    for name in ("kfac-factors", "kfac-no-factors"):
        extra = [(k - s) / LAYERS for k, s in zip(measured[name], measured["sgd"], strict=True)]
        stats = harness.Stats.of(extra).scaled(1e6)
        results[f"{name}_extra_per_layer_us"] = stats.as_dict()
        print(f"  {name} − sgd, per layer: {stats:.1f} µs (per round, paired)")
    hook = harness.Stats.of(measured["calibrate-hook"]).scaled(1e6)
    results["calibrate_kfac_forward_layer_us"] = hook.as_dict()
    print(f"  calibrate's kfac_forward_layer_s: {hook:.1f} µs")
    profile = cProfile.Profile()
    _loop(args.batch, 1, profile)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(10)
    results["cprofile"] = out.getvalue().splitlines()
    print(out.getvalue())
    bench.target(
        "K-FAC's forward over SGD's, factor steps (ratio of medians)",
        results["kfac-factors"]["median"] / results["sgd"]["median"],
        1.0,
        ">=",
    )
    return bench.finish(results, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
