"""FOSI's per-step cost against its base's, on a small model, one process, one thread.

``.venv/bin/python benchmarks/bench_fosi_step.py`` times ``optimizer.step()`` alone (not the
forward or backward pass) over consecutive training steps of the digits autoencoder's shape
(kfac_hpc.train.fosi_tasks.autoencoder: 64-128-32-8-32-128-64, tanh, 25,480 parameters; batches
of 64 random inputs, its own reconstruction target; ``--widths`` another fully connected
shape, e.g. ``40-1000-500-250-30-250-500-1000-40``, the wide MNIST-1D autoencoder's) for four
optimizers: SGD (lr 0.01, momentum
0.9), FOSI around it, Adam (lr 1e-3) and FOSI around it. FOSI has a spectrum installed
(``set_spectrum``: k = 10 orthonormal random eigenvectors) and no ESE is due, so its time is
the cost of every step between two ESEs. Each step is preceded by ``zero_grad(set_to_none=True)``
and a backward pass, as in the training job.

Per round (``--rounds``, default 7) every optimizer runs ``--steps`` (default 200) timed steps
after 20 untimed ones, in turn (``harness.interleave``: the order rotates, so machine load hits
all alike); printed: per optimizer the median over rounds of the mean step time, with min-max,
and the FOSI / base ratios per round (median, min-max), also written to
benchmarks/results/bench_fosi_step.json (no target: the figures explain the time-to-target
rows). ``--baseline PACKAGE`` adds, in the same rounds, FOSI-SGD and FOSI-Adam from another
importable copy of the package (an earlier commit's ``kfac_hpc`` under another name, its own
imports renamed), printed as ``old-fosi-sgd`` and ``old-fosi-adam``, with their ratios to the
new ones. ``--profile NAME`` instead prints cProfile's top entries for that optimizer's steps.
"""

from __future__ import annotations

import cProfile
import importlib
import itertools
import pstats
import time
from collections.abc import Callable

import harness  # benchmarks/harness.py, beside this script
import torch
from torch import nn

from kfac_hpc.optim.fosi import FOSI

WIDTHS = "64-128-32-8-32-128-64"  # the digits autoencoder's layer widths
BATCH = 64
K = 10
WARM = 20


def _model(widths: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _fosi(model: nn.Module, base: torch.optim.Optimizer, fosi: type = FOSI) -> FOSI:
    opt = fosi(model.parameters(), base, k=K, alpha=0.01, warmup=10**9, model=model)
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(opt.n, K, generator=gen, dtype=torch.float64))
    opt.set_spectrum(torch.linspace(10.0, 1.0, K, dtype=torch.float64), q.T.contiguous())
    return opt


BUILDERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    "fosi-sgd": lambda m: _fosi(m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "fosi-adam": lambda m: _fosi(m, torch.optim.Adam(m.parameters(), lr=1e-3)),
}
PAIRS = (("fosi-sgd", "sgd"), ("fosi-adam", "adam"))


def _add_baseline(package: str) -> None:
    """FOSI-SGD and FOSI-Adam from ``package`` (a renamed copy of kfac_hpc) as ``old-*``."""
    old = importlib.import_module(f"{package}.optim.fosi").FOSI
    BUILDERS["old-fosi-sgd"] = lambda m: _fosi(
        m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), old
    )
    BUILDERS["old-fosi-adam"] = lambda m: _fosi(m, torch.optim.Adam(m.parameters(), lr=1e-3), old)


class Run:
    """One model and optimizer, stepped on fixed random batches."""

    def __init__(self, name: str, widths: tuple[int, ...]) -> None:
        self.model = _model(widths)
        self.optimizer = BUILDERS[name](self.model)
        gen = torch.Generator().manual_seed(2)
        self.batches = [torch.randn(BATCH, widths[0], generator=gen) for _ in range(4)]
        self.count = 0

    def steps(self, count: int) -> float:
        """Seconds spent in ``optimizer.step()`` over ``count`` training steps."""
        spent = 0.0
        for _ in range(count):
            x = self.batches[self.count % len(self.batches)]
            self.count += 1
            self.optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(self.model(x), x).backward()
            started = time.perf_counter()
            self.optimizer.step()
            spent += time.perf_counter() - started
        return spent


def main() -> int:
    parser = harness.parser(__doc__, rounds=7)
    parser.add_argument("--steps", type=harness.positive_int, default=200)
    parser.add_argument("--profile", choices=sorted(BUILDERS), help="cProfile this optimizer")
    parser.add_argument("--baseline", help="another copy of the package to compare, by name")
    parser.add_argument("--widths", default=WIDTHS, help="the layer widths, '-'-joined")
    args = parser.parse_args()
    try:
        widths = tuple(int(w) for w in args.widths.split("-"))
    except ValueError:
        parser.error(f"--widths: {args.widths!r} is not integers joined by '-'")
    if len(widths) < 2 or min(widths) < 1:
        parser.error(f"--widths: {args.widths!r}: give at least two positive widths")
    torch.set_num_threads(1)
    pairs = list(PAIRS)
    if args.baseline:
        _add_baseline(args.baseline)
        pairs += [("old-fosi-sgd", "sgd"), ("old-fosi-adam", "adam")]
        pairs += [("fosi-sgd", "old-fosi-sgd"), ("fosi-adam", "old-fosi-adam")]
    if args.profile:
        run = Run(args.profile, widths)
        run.steps(WARM)
        profiler = cProfile.Profile()
        profiler.enable()
        run.steps(args.steps)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return 0
    bench = harness.Benchmark("bench_fosi_step")
    runs = {name: Run(name, widths) for name in BUILDERS}
    for run in runs.values():
        run.steps(WARM)
    ms = harness.interleave(
        {
            name: lambda _round, run=run: 1e3 * run.steps(args.steps) / args.steps
            for name, run in runs.items()
        },
        args.rounds,
    )
    print(f"ms per step, median (min-max) of {args.rounds} rounds x {args.steps} steps, 1 thread")
    for name, values in ms.items():
        print(f"  {name:13s} {harness.Stats.of(values):.3f}")
    ratios = {f"{a} / {b}": harness.Stats.of(harness.ratios(ms[a], ms[b])) for a, b in pairs}
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.3f}x")
    results = {
        "step_ms": {name: harness.Stats.of(values) for name, values in ms.items()},
        "ratios": ratios,
        "steps_per_round": args.steps,
    }
    return bench.finish(results, check=args.check)


if __name__ == "__main__":
    raise SystemExit(main())
