"""FOSI's two Hessian-vector product routes, side by side: seconds per product, seconds per ESE
and the ESE's peak memory, on the models the benchmarks train (CPU, one thread).

``.venv/bin/python benchmarks/bench_hvp_routes.py [--rounds 3] [--products 5]``

Models (random data of the benchmarks' shapes and batch sizes):

* ``mlp``: bench_fosi.py's MLP 1024-1024-1024-10 (2.1 M parameters), curvature batch 64;
* ``cnn1d``: the MNIST-1D CNN of bench_tts_methods.py (``--cnn1d-channels 160``), batch 1024;
* ``autoencoder``: the digits autoencoder (64-128-32-8-32-128-64, mean squared error), batch 128;
* ``gpt``: the byte-level transformer at its defaults (2 blocks, width 64, context 64), batch 16;
* ``resnet20``: CIFAR ResNet-20 (BatchNorm in training mode), batch 32.

Per round, model and route (``forward-over-reverse``, ``double-backward``; the order alternates
from round to round), a fresh process (so that no allocator cache of another measurement is
reused): with the model's gradients allocated, the resident set's high-water mark is reset
(``/proc/self/clear_refs``) and FOSI (k = 10, 40 Lanczos steps, the defaults) runs one ESE with
``hvp`` set to the route: its seconds (``last_ese_s``) and the new high-water mark minus the
resident set before (Lanczos basis, the route's graphs and temporaries); then ``--products``
products of one ``HessianVectorProduct`` after the first (the first, timed apart, builds the
double-backward graph): their median. A route that fails on a model (forward-mode AD on
BatchNorm's running-statistic update, or on mse_loss's backward) is reported as such.

Prints median (min..max) over rounds and the ratio double-backward / forward-over-reverse of
the medians; writes benchmarks/results/bench_hvp_routes.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import harness  # benchmarks/harness.py, beside this script
from memprobe import reset_peak, status_kib

MODELS = ("mlp", "cnn1d", "autoencoder", "gpt", "resnet20")
ROUTES = ("forward-over-reverse", "double-backward")
MIB = 1024 * 1024


def workload(name: str) -> tuple[Any, Any]:
    """(the model, ``loss()`` of its curvature batch)."""
    import torch
    from torch import nn

    from kfac_hpc.train.config import TrainConfig
    from kfac_hpc.train.fosi_tasks import autoencoder
    from kfac_hpc.train.models import _cnn1d
    from kfac_hpc.train.transformer import GPT, GPTSizes
    from kfac_hpc.train.workloads import FactoryContext, build_model

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    f = nn.functional
    if name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024),
                                         nn.Tanh(), nn.Linear(1024, 10))  # fmt: skip
        x, y = torch.randn(64, 1024, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        return model, lambda: f.cross_entropy(model(x), y)
    if name == "cnn1d":
        model = _cnn1d(1, 40, 10, 160)
        x, y = torch.randn(1024, 1, 40, generator=gen), torch.randint(0, 10, (1024,), generator=gen)
        return model, lambda: f.cross_entropy(model(x), y)
    if name == "autoencoder":
        model = autoencoder(FactoryContext(TrainConfig(), {}, 0, 1, None, (64,), 64))
        x = torch.randn(128, 64, generator=gen)
        return model, lambda: f.mse_loss(model(x), x)
    if name == "gpt":
        model = GPT(GPTSizes())
        idx = torch.randint(0, 256, (16, 65), generator=gen)
        return model, lambda: f.cross_entropy(
            model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()
        )
    if name == "resnet20":
        model = build_model(TrainConfig(model="resnet20"), (3, 32, 32), 10)
        x, y = torch.randn(32, 3, 32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        return model, lambda: f.cross_entropy(model(x), y)
    raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def one(name: str, route: str, products: int) -> dict[str, Any]:
    """One model and route in this process: the ESE's seconds and peak, the products' seconds."""
    import torch

    from kfac_hpc.optim.fosi import FOSI
    from kfac_hpc.optim.fosi.hvp import HessianVectorProduct

    torch.set_num_threads(1)
    model, loss = workload(name)
    loss().backward()  # the gradients exist before the baseline
    params = [p for p in model.parameters() if p.requires_grad]
    reset_peak()
    baseline = status_kib("VmRSS")
    base = torch.optim.SGD(params, lr=0.01)
    opt = FOSI(params, base, k=10, warmup=0, ese_every=10**6, model=model, hvp=route)
    try:
        opt.step(loss)
    except (RuntimeError, NotImplementedError) as exc:
        return {"failed": " ".join(str(exc).split())[:120]}
    peak = (status_kib("VmHWM") - baseline) * 1024
    out: dict[str, Any] = {"ese_s": opt.last_ese_s, "ese_peak_bytes": peak,
                           "parameters": sum(p.numel() for p in params)}  # fmt: skip
    del opt, base
    hvp = HessianVectorProduct(params, loss, model, route)
    v = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(2))
    started = time.perf_counter()
    hvp(v)
    out["first_s"] = time.perf_counter() - started
    samples = []
    for _ in range(products):
        started = time.perf_counter()
        hvp(v)
        samples.append(time.perf_counter() - started)
    out["product_s"] = statistics.median(samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--products", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "ROUTE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args.products)))
        return
    models = args.models.split(",")
    load_before = harness.load_average()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        m: {r: [] for r in ROUTES} for m in models
    }
    for rnd in range(args.rounds):
        for name in models:
            for route in ROUTES if rnd % 2 == 0 else ROUTES[::-1]:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", name, route, "--products",
                     str(args.products)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                results[name][route].append(json.loads(done.stdout.splitlines()[-1]))
                print(f"round {rnd + 1} {name} {route}: {results[name][route][-1]}", flush=True)
    load_after = harness.load_average()
    print(f"\nmedian (min..max) over {args.rounds} rounds, one thread; load {load_before} -> "
          f"{load_after}")  # fmt: skip
    print(f"{'model':<12} {'route':<21} {'product ms':>22} {'first ms':>9} {'ESE s':>20} "
          f"{'ESE peak MiB':>20}")  # fmt: skip
    summary: dict[str, Any] = {}
    for name in models:
        summary[name] = {}
        for route in ROUTES:
            rows = results[name][route]
            if any("failed" in r for r in rows):
                summary[name][route] = {"failed": rows[0].get("failed")}
                print(f"{name:<12} {route:<21} fails: {rows[0].get('failed')}")
                continue
            s = {key: harness.stats([r[key] for r in rows])
                 for key in ("product_s", "first_s", "ese_s", "ese_peak_bytes")}  # fmt: skip
            summary[name][route] = {**s, "parameters": rows[0]["parameters"]}
            p, e, m = s["product_s"], s["ese_s"], s["ese_peak_bytes"]
            print(f"{name:<12} {route:<21} {p['median'] * 1e3:>7.1f} ({p['min'] * 1e3:.1f}.."
                  f"{p['max'] * 1e3:.1f}) {s['first_s']['median'] * 1e3:>9.1f} "
                  f"{e['median']:>6.2f} ({e['min']:.2f}..{e['max']:.2f}) "
                  f"{m['median'] / MIB:>6.0f} ({m['min'] / MIB:.0f}.."
                  f"{m['max'] / MIB:.0f})")  # fmt: skip
        routes = summary[name]
        if all("failed" not in routes[r] for r in ROUTES):
            ratio = {key: routes["double-backward"][key]["median"]
                     / routes["forward-over-reverse"][key]["median"]
                     for key in ("product_s", "ese_s", "ese_peak_bytes")}  # fmt: skip
            routes["double_over_forward"] = ratio
            print(f"{name:<12} {'double / forward':<21} product {ratio['product_s']:.2f}x, ESE "
                  f"{ratio['ese_s']:.2f}x, peak {ratio['ese_peak_bytes']:.2f}x")  # fmt: skip
    out = harness.RESULTS_DIR / "bench_hvp_routes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_before": load_before, "load_after": load_after,
                               "rounds": args.rounds, "summary": summary, "raw": results},
                              indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
