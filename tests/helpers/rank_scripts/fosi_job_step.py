"""Started by tests/train/test_fosi_sharded_job.py: the job's own step with FOSI, or the
single-process FOSI reference, on a tiny float64 problem.

``MODE=job`` (under ``mpiexec -n P``): the job's :class:`~kfac_hpc.train.step.TrainStep` with
the registered ``fosi`` method, built from a ``TrainConfig`` as the job builds them, runs
``STEPS`` steps of a float64 MLP of 53 parameters (divisible by neither 2 nor 3) on this rank's
shard of each global batch. Every call of ``all_reduce``, ``reduce_scatter_single``,
``all_to_all_single`` (FOSI's reduce-scatter on gloo) and ``all_gather`` during the steps is
recorded (the number of elements it was handed), with the parameters after every step, each
rank's ``.grad`` after the step, the summed flags and the phase seconds.

``MODE=reference`` (plain python, no process group): ``kfac_hpc.FOSI`` around the same base
optimizer, single process, on the whole global batch of every step.

Writes ``OUT_DIR/{MODE}_rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.contracts import PHASES
from kfac_hpc.optim.fosi import FOSI
from kfac_hpc.runtime import init_distributed, shutdown
from kfac_hpc.train.config import load_config
from kfac_hpc.train.data import DataSource, ShardedBatches
from kfac_hpc.train.methods import MethodSetup, build_method
from kfac_hpc.train.optimizers import make_optimizer
from kfac_hpc.train.step import TrainStep
from kfac_hpc.train.timing import PhaseTimer
from tests.helpers.rank_checks import main_or_leave

GLOBAL_BATCH = 24
STEPS = 7  # ESEs at steps 1 and 4; crosses an epoch (4 steps of 24 out of 96 samples)
CONFIG = {
    "fosi": True,
    "fosi_k": 3,
    "fosi_l": 1,
    "fosi_alpha": 0.05,
    "fosi_warmup": 1,
    "ese_every": 3,
    "lanczos_iters": 12,
    "fosi_residual_tol": 1.0,  # every Ritz pair kept (4 per ESE): the steps use all of V
    "fosi_hvp": "double-backward",
    "optimizer": "sgd",
    "lr": 0.1,
    "momentum": 0.9,
    "weight_decay": 0.01,
    "lr_schedule": "constant",
    "batch_size": GLOBAL_BATCH,
    "seed": 3,
}


def source() -> DataSource:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(120, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (120,), generator=gen)
    return DataSource(
        "tiny", (6,), 3, 96, 24, lambda i: (x[i], y[i]), lambda i: (x[96 + i], y[96 + i])
    )


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def recording(calls: list[tuple[str, int]]) -> None:
    """Record the elements handed to every collective the step may use, by name."""

    def wrap(name: str, fn: Callable[..., Any], arg: int) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[arg]
            numel = sum(t.numel() for t in tensor) if isinstance(tensor, list) else tensor.numel()
            calls.append((name, numel))
            return fn(*args, **kwargs)

        return call

    dist.all_reduce = wrap("all_reduce", dist.all_reduce, 0)  # type: ignore[assignment]
    dist.reduce_scatter_single = wrap("reduce_scatter", dist.reduce_scatter_single, 1)  # type: ignore[assignment]
    dist.all_gather = wrap("all_gather", dist.all_gather, 0)  # type: ignore[assignment]
    # gloo's reduce-scatter of FOSI: an all-to-all of the pieces (kfac_hpc/optim/fosi/sharding.py)
    dist.all_to_all_single = wrap("reduce_scatter", dist.all_to_all_single, 1)  # type: ignore[assignment]


def job(world: int, rank: int) -> dict[str, Any]:
    config = load_config(None, CONFIG)
    net = model()
    method = build_method("fosi", MethodSetup(config, net, world))
    batches = ShardedBatches(source(), GLOBAL_BATCH, rank, world, config.seed, False)
    step = TrainStep(net, batches, torch.device("cpu"), method, world)
    timer = PhaseTimer(phases=PHASES + tuple(p for p in method.phases if p not in PHASES))
    calls: list[tuple[str, int]] = []
    recording(calls)
    out: dict[str, Any] = {"params": [], "grads": [], "flags": [], "calls": calls}
    for s in range(STEPS):
        timer.begin_step()
        _, flags = step(s, config.lr, [float(rank), 1.0], timer)
        timer.end_step()
        out["params"].append(flat(list(net.parameters())))
        out["grads"].append(flat([p.grad for p in net.parameters()]))
        out["flags"].append(flags)
    sums, _ = timer.drain()
    out["phases"] = dict(zip(timer.phases, sums, strict=True))
    out["eigenvalues"] = method.optimizer.eigenvalues.clone()  # type: ignore[attr-defined]
    return out


def reference() -> dict[str, Any]:
    config = load_config(None, CONFIG)
    net = model()
    opt = FOSI(net.parameters(), make_optimizer(config, net), model=net, **config.fosi_options())
    batches = ShardedBatches(source(), GLOBAL_BATCH, 0, 1, config.seed, False)
    out: dict[str, Any] = {"params": [], "grads": []}
    for s in range(STEPS):
        x, y = batches.batch(*divmod(s, batches.steps_per_epoch))
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        out["grads"].append(flat([p.grad for p in net.parameters()]))
        opt.step(lambda x=x, y=y: nn.functional.cross_entropy(net(x), y))
        out["params"].append(flat(list(net.parameters())))
    out["eigenvalues"] = opt.eigenvalues.clone()
    return out


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), os.environ["MODE"]
    if mode == "reference":
        torch.save(
            {"world_size": 1, "rank": 0, "results": reference()}, out_dir / "reference_rank0.pt"
        )
        return
    ctx = init_distributed(backend="gloo", timeout_s=300)
    results = job(ctx.world_size, ctx.rank)
    torch.save(
        {"world_size": dist.get_world_size(), "rank": ctx.rank, "results": results},
        out_dir / f"job{ctx.world_size}_rank{ctx.rank}.pt",
    )
    shutdown()


if __name__ == "__main__":
    main_or_leave(main)
