"""Started as P real ranks (P = 1, 2, 4) by tests/optim/test_distributed_equivalence.py.

Every rank trains the same tiny float64 model on its slice of one fixed global batch of 16
(loss = mean over the local slice, gradients averaged over ranks as DDP would), runs
``KFACPreconditioner.step()`` and a plain SGD update for a few steps, under each distribution
configuration. It saves, per configuration and step, the preconditioned gradients and the
factors, plus ``memory_usage()``, the layers it holds second-order data for and the factor
tensors it holds, to
``OUT_DIR/p{P}_rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.optim import KFACPreconditioner
from kfac_hpc.runtime import init_distributed, shutdown
from tests.helpers.rank_checks import main_or_leave

GLOBAL_BATCH = 16
STEPS = 3

# name -> preconditioner options (besides the common ones below)
CONFIGS: dict[str, dict[str, Any]] = {
    "comm_eigen": {"grad_worker_fraction": "comm-opt"},
    "comm_eigen_split_sym": {
        "grad_worker_fraction": "comm-opt",
        "colocate_factors": False,
        "symmetry_aware": True,
        "allreduce_bucket_cap_mb": 0.001,
    },
    "comm_no_hook_no_outer": {
        "grad_worker_fraction": "comm-opt",
        "update_factors_in_hook": False,
        "compute_eigenvalue_outer_product": False,
    },
    "mem_eigen": {"grad_worker_fraction": "mem-opt"},
    "mem_inverse_kl": {"grad_worker_fraction": "mem-opt", "compute_method": "inverse",
                       "kl_clip": 0.001},
    "hybrid_eigen_split": {"grad_worker_fraction": "hybrid-opt", "colocate_factors": False},
    "hybrid_inverse_memory": {
        "grad_worker_fraction": "hybrid-opt",
        "compute_method": "inverse",
        "assignment_strategy": "memory",
        "symmetry_aware": True,
    },
    "half_eigen_stale_inverse": {"grad_worker_fraction": 0.5, "inv_update_steps": 2},
}  # fmt: skip
COMMON: dict[str, Any] = {
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 0.01,
    "factor_decay": 0.9,
    "kl_clip": None,
    "lr": 0.1,
    "inv_dtype": torch.float64,
}


def build_model() -> nn.Module:
    """Conv (bias, padding), grouped strided conv (no bias), dilated conv, two Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding="same", dilation=2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
        nn.Tanh(),
        nn.Linear(10, 3),
    ).double()


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 2, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=gen)
    return x, y


def grad_of(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def run_config(options: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    model = build_model()
    if options["grad_worker_fraction"] == 0.5 and world == 1:
        options = options | {"grad_worker_fraction": 1.0}  # 0.5 of one rank is no rank count
    kfac = KFACPreconditioner(model, **(COMMON | options))
    x, y = global_batch()
    per_rank = GLOBAL_BATCH // world
    x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    grads: list[list[torch.Tensor]] = []
    factors: list[dict[str, torch.Tensor]] = []
    in_flight: list[int] = []
    pending_after_backward: list[list[str]] = []
    arrived_after_backward: list[list[str]] = []
    for _ in range(STEPS):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        # factor buckets launched from the backward hooks, before step(): the overlap
        in_flight.append(kfac.reducer.buckets_in_flight)
        pending_after_backward.append(sorted(pending_statistics(kfac)))
        arrived_after_backward.append(sorted(kfac.reducer.reducer.arrived))
        for p in model.parameters():  # the DDP contract: the mean gradient of the global batch
            if world > 1:
                dist.all_reduce(grad_of(p))
                grad_of(p).div_(world)
        kfac.step()
        grads.append([grad_of(p).detach().clone() for p in model.parameters()])
        state = kfac.state_dict()["layers"]
        factors.append({f"{n}/{k}": t for n, e in state.items() for k, t in e.items()})
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * grad_of(p))
    return {
        "grads": grads,
        "factors": factors,
        "memory": kfac.memory_usage(),
        "buckets_in_flight_after_backward": in_flight,
        "pending_after_backward": pending_after_backward,
        "arrived_after_backward": arrived_after_backward,
        "second_order_layers": sorted(kfac.second_order),
        "grad_worker_layers": sorted(
            n for n in kfac.layers if kfac.assignment.is_grad_worker(n, rank)
        ),
        "fraction": kfac.assignment.grad_worker_fraction,
        "held_factors": sorted(held_factor_tensors(kfac)),
        "inverse_worker_of": sorted(
            f"{n}/{key}"
            for n in kfac.layers
            for key in ("A", "G")
            if kfac.assignment.inverse_worker(n, key) == rank
        ),
    }


def pending_statistics(kfac: KFACPreconditioner) -> list[str]:
    """ "layer/A" for every statistic of the current step this rank holds."""
    return [
        f"{name}/{key}"
        for name, f in kfac.factors.items()
        for key, pending in (("A", f.pending_a), ("G", f.pending_g))
        if pending is not None
    ]


def held_factor_tensors(kfac: KFACPreconditioner) -> list[str]:
    """ "layer/A" for every running or pending factor tensor this rank holds after a step."""
    held = []
    for name, f in kfac.factors.items():
        for key, running, pending in (("A", f.A, f.pending_a), ("G", f.G, f.pending_g)):
            held += [f"{name}/{key}"] * sum(t is not None for t in (running, pending))
    return held


def main() -> None:
    out_dir = Path(sys.argv[1])
    ctx = init_distributed(backend="gloo", timeout_s=300)
    world = dist.get_world_size()
    torch.set_num_threads(1)
    results = {name: run_config(options, ctx.rank, world) for name, options in CONFIGS.items()}
    torch.save({"world_size": world, "rank": ctx.rank, "results": results},
               out_dir / f"p{world}_rank{ctx.rank}.pt")  # fmt: skip
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
