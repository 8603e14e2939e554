"""Started as P real ranks (P = 1, 2, 3, 4) by tests/optim/fosi/test_distributed.py.

Every rank trains the same tiny float64 MLP (53 parameters: divisible by none of 2, 3, 4; two
parameter groups, weight decay in one) with FOSI on its slice of fixed global batches of 24
(training and curvature batches apart), for a few steps with two ESEs, under each
configuration. It saves the parameters after every step, the eigenvalues, ``memory_usage()``
and the staleness record to ``OUT_DIR/{TAG}_rank{r}.pt``; rank 0 also writes the parameters and
the full FOSI state at the end to ``OUT_DIR/{TAG}/{config}.h5`` (kfac_hpc.checkpoint.hdf5_tree).
Pipelined configurations also save ``late_steps`` (base update alone: the ESE was late).
With ``RESUME=dir`` every rank first loads those files (saved at any world size) and continues.

Pipelined configurations give the last ranks to ESE (``curvature_ranks``; staleness bound 0,
and 2 in ``sgd_pipelined_stale``): the training batch is split over the training ranks and the
curvature batch over the curvature ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import h5py
import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.checkpoint.hdf5_tree import read_tree, write_tree
from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.rank_checks import main_or_leave

GLOBAL_BATCH = 24
STEPS = 6
# residual_tol 1: every Ritz pair kept (4 of them in each ESE), so that the steps use all of V
FOSI_OPTIONS: dict[str, Any] = {"k": 3, "l": 1, "alpha": 0.05, "warmup": 1, "ese_every": 3,
                                "hvp": "double-backward", "residual_tol": 1.0}  # fmt: skip


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def build_base(model: nn.Module, name: str) -> torch.optim.Optimizer:
    groups = [
        {"params": model[0].parameters()},
        {"params": model[2].parameters(), "lr": 0.05, "weight_decay": 0.01},
    ]
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(GLOBAL_BATCH, 6, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=gen)


def part(data: tuple[torch.Tensor, torch.Tensor], index: int, count: int) -> tuple[Any, Any]:
    size = GLOBAL_BATCH // count
    return data[0][index * size : (index + 1) * size], data[1][index * size : (index + 1) * size]


# name -> (base, curvature_ranks at P = 1, 2, 3, 4, max_staleness)
CONFIGS: dict[str, tuple[str, dict[int, int], int]] = {
    "sgd": ("sgd", {1: 0, 2: 0, 3: 0, 4: 0}, 0),
    "adam": ("adam", {1: 0, 2: 0, 3: 0, 4: 0}, 0),
    "sgd_pipelined": ("sgd", {1: 0, 2: 1, 3: 1, 4: 2}, 0),
    "sgd_pipelined_stale": ("sgd", {1: 0, 2: 1, 3: 1, 4: 2}, 2),
}


def run(name: str, world: int, rank: int, resume: Path | None) -> dict[str, Any]:
    base_name, curvature, staleness = CONFIGS[name]
    model = build_model()
    opt = FOSI(model.parameters(), build_base(model, base_name), model=model,
               curvature_ranks=curvature[world], max_staleness=staleness,
               ese_check=not curvature[2],  # not applied with curvature ranks: P = 1 alike
               **FOSI_OPTIONS)  # fmt: skip
    if resume is not None:
        with h5py.File(resume / f"{name}.h5", "r") as f:
            tree = read_tree(f)
        with torch.no_grad():
            for p, value in zip(model.parameters(), tree["params"], strict=True):
                p.copy_(value)
        opt.load_full_state_dict(tree["fosi"])
    trainers = world - curvature[world]
    params: list[torch.Tensor] = []
    for step in range(opt.step_count, opt.step_count + STEPS):
        curvature_batch = batch(1000 + step)  # split over the ranks that run ESE
        if opt.is_curvature_rank:
            cx, cy = part(curvature_batch, rank - trainers, world - trainers)
        else:
            cx, cy = part(curvature_batch, rank, world)  # unused by pipelined training ranks
            x, y = part(batch(step), rank, trainers)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()

        def closure(cx: torch.Tensor = cx, cy: torch.Tensor = cy) -> torch.Tensor:
            return nn.functional.cross_entropy(model(cx), cy)

        opt.step(closure)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
    full = opt.full_state_dict()
    opt.close()  # the stale configuration may end with an ESE in flight
    out = Path(sys.argv[1]) / os.environ["TAG"]
    if rank == 0:
        out.mkdir(exist_ok=True)
        tree = {"params": [p.detach().clone() for p in model.parameters()], "fosi": full}
        with h5py.File(out / f"{name}.h5", "w") as f:
            write_tree(f, tree)
    return {
        "params": params,
        "eigenvalues": opt.eigenvalues,
        "memory": opt.memory_usage(),
        "staleness": opt.staleness,
        "late_steps": opt.late_steps,
        "curvature_rank": opt.is_curvature_rank,
        "full_state": full,
    }


def main() -> None:
    ctx = init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    world = dist.get_world_size()
    resume = Path(os.environ["RESUME"]) if os.environ.get("RESUME") else None
    results = {name: run(name, world, ctx.rank, resume) for name in CONFIGS}
    torch.save({"world_size": world, "rank": ctx.rank, "results": results},
               Path(sys.argv[1]) / f"{os.environ['TAG']}_rank{ctx.rank}.pt")  # fmt: skip
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
