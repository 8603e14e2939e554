"""Time to solution on MNIST-1D: tuned SGD against tuned SGD+K-FAC (expand and reduce), 1 rank.

    .venv/bin/python benchmarks/bench_mnist1d_tts.py [--target 0.85] [--max-epochs 40]

MNIST-1D (generated locally by the ``mnist1d`` package: 4,000 training and 1,000 test
sequences, the paper's setting) and the paper's 1-D CNN (3 Conv1d + 1 Linear, all of it
preconditioned), batch 64, SGD with momentum 0.9, constant learning rate, 2 threads. Each
optimizer's learning rate is picked from a small grid by its own time to the target; the time
counts training steps only (the test-set evaluation every ``--eval-every`` steps is not
timed). K-FAC: factors every 5 steps, eigendecompositions every 20, damping 0.003, KL clip
0.001. One seed per point: the spread between seeds is not measured here.

Prints the grid and the best of each optimizer, and writes
benchmarks/results/bench_mnist1d_tts.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.data import DataSource, load_data
from kfac_hpc.train.models import build_model

RESULTS = Path(__file__).resolve().parent / "results" / "bench_mnist1d_tts.json"
BATCH = 64
THREADS = 2
GRID = {
    "sgd": (0.01, 0.03, 0.1),
    "kfac_expand": (0.01, 0.03, 0.1),
    "kfac_reduce": (0.01, 0.03, 0.1),
}


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def time_to_target(
    data: DataSource, method: str, lr: float, target: float, max_epochs: int, eval_every: int
) -> dict[str, Any]:
    """Training seconds until the test accuracy first reaches ``target`` (None if never)."""
    torch.manual_seed(0)
    model = build_model("cnn1d", data.shape, data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    pre = None
    if method != "sgd":
        approx = method.removeprefix("kfac_")
        pre = KFACPreconditioner(
            model,
            lr=lr,
            damping=0.003,
            factor_update_steps=5,
            inv_update_steps=20,
            kfac_approx=approx,
        )
    x_train, y_train = data.train(torch.arange(data.train_len))
    x_test, y_test = data.test(torch.arange(data.test_len))
    gen = torch.Generator().manual_seed(0)
    train_s, step, best = 0.0, 0, 0.0
    for epoch in range(max_epochs):
        order = torch.randperm(data.train_len, generator=gen)
        for idx in order[: data.train_len // BATCH * BATCH].split(BATCH):
            start = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            if pre is not None:
                pre.step()
            opt.step()
            train_s += time.perf_counter() - start
            step += 1
            if step % eval_every == 0:
                best = max(best, _accuracy(model, x_test, y_test))
                if best >= target:
                    return {"reached": True, "train_s": train_s, "steps": step, "epochs": epoch}
    return {"reached": False, "train_s": train_s, "steps": step, "best_accuracy": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.85, help="test accuracy to reach")
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=20, help="steps between evaluations")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    data = load_data(TrainConfig(dataset="mnist1d", model="cnn1d", num_samples=4000))
    grid: dict[str, dict[str, Any]] = {}
    for method, lrs in GRID.items():
        for lr in lrs:
            run = time_to_target(data, method, lr, args.target, args.max_epochs, args.eval_every)
            grid.setdefault(method, {})[str(lr)] = run
            shown = (
                f"{run['train_s']:.1f} s, {run['steps']} steps"
                if run["reached"]
                else (f"not reached in {args.max_epochs} epochs (best {run['best_accuracy']:.3f})")
            )
            print(f"  {method:12s} lr {lr:<5g} {shown}", flush=True)
    best: dict[str, Any] = {}
    for method, runs in grid.items():
        reached = {lr: r for lr, r in runs.items() if r["reached"]}
        if reached:
            lr = min(reached, key=lambda k: reached[k]["train_s"])
            best[method] = {"lr": float(lr), **reached[lr]}
    result: dict[str, Any] = {
        "schema": 1,
        "benchmark": "mnist1d_tts",
        "target_accuracy": args.target,
        "batch": BATCH,
        "threads": THREADS,
        "ranks": 1,
        "grid": grid,
        "best": best,
        "wall_s": time.perf_counter() - started,
    }
    print(f"MNIST-1D, 1-D CNN, batch {BATCH}, 1 rank, target test accuracy {args.target}")
    for method in ("kfac_expand", "kfac_reduce"):
        if "sgd" in best and method in best:
            ratio = best[method]["train_s"] / best["sgd"]["train_s"]
            result[f"{method}_over_sgd"] = ratio
            print(
                f"  {method}: {best[method]['train_s']:.1f} s (lr {best[method]['lr']:g}) vs SGD "
                f"{best['sgd']['train_s']:.1f} s (lr {best['sgd']['lr']:g}) = {ratio:.2f}x "
                f"({1 - ratio:.0%} less time; target >= 25% less)"
            )
        else:
            print(f"  {method}: no ratio (a method never reached the target)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  wall {result['wall_s']:.0f} s; wrote {RESULTS}")


if __name__ == "__main__":
    main()
