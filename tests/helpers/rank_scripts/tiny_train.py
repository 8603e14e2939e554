"""A tiny, complete training job for the checkpoint tests (the real job lives in kfac_hpc.train).

MLP with dropout on scikit-learn's digits; each rank takes its slice of every global batch;
gradients averaged by allreduce; optional K-FAC; numpy and Python RNGs used for input noise so
every RNG stream matters. Run under mpiexec (world size from the launcher) or plain python.

It auto-resumes from RUN/checkpoints (or --resume-from), checkpoints every --save-every steps,
stops after --stop-at steps, checkpoints and exits 75 on preemption, and rank 0 writes the final
parameters and K-FAC factors to RUN/final-<attempt>.h5 plus a JSON line with what happened.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from kfac_hpc.checkpoint import (
    CheckpointManager,
    DataPosition,
    capture_training_state,
    load_checkpoint,
    restore_training_state,
)
from kfac_hpc.checkpoint.files import open_h5
from kfac_hpc.checkpoint.hdf5_tree import write_tree
from kfac_hpc.runtime import init_distributed
from kfac_hpc.train.preemption import REQUEUE_EXIT_CODE, PreemptionHandler
from tests.helpers.rank_checks import main_or_leave

GLOBAL_BATCH = 32


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1797 8x8 images), read without importing sklearn (fast)."""
    spec = importlib.util.find_spec("sklearn")
    assert spec is not None and spec.origin is not None, "scikit-learn is not installed"
    table = np.loadtxt(
        Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=","
    )
    return table[:, :-1], table[:, -1].astype(np.int64)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="total steps of the run")
    p.add_argument("--stop-at", type=int, default=None, help="save and exit 0 after this step")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--kfac", action="store_true")
    p.add_argument("--fraction", default="comm-opt", help="K-FAC grad_worker_fraction")
    p.add_argument("--inv-every", type=int, default=3)
    p.add_argument("--deterministic-data", action="store_true", help="no dropout, no noise")
    p.add_argument("--float64", action="store_true")
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--signal-at", type=int, default=None, help="a rank sends itself USR2 here")
    p.add_argument("--signal-rank", type=int, default=1)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, object | None]:
    torch.manual_seed(0)  # same initial weights everywhere
    dropout = 0.0 if args.deterministic_data else 0.2
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 10))
    if args.float64:
        model = model.double()
    if args.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kfac = None
    if args.kfac:
        from kfac_hpc.optim import KFACPreconditioner

        kfac = KFACPreconditioner(
            model,
            factor_update_steps=1,
            inv_update_steps=args.inv_every,
            damping=0.01,
            lr=0.05,
            grad_worker_fraction=args.fraction,
            inv_dtype=torch.float64 if args.float64 else torch.float32,
        )
    return model, opt, kfac


def main() -> int:
    args = parse()
    ctx = init_distributed(backend="gloo", timeout_s=300)
    rank, world = ctx.rank, ctx.world_size
    (args.run / f"pid.{rank}").write_text(str(os.getpid()))
    data, target = load_digits()
    dtype = torch.float64 if args.float64 else torch.float32
    x_all = torch.tensor(data / 16.0, dtype=dtype)
    y_all = torch.tensor(target)
    steps_per_epoch = len(x_all) // GLOBAL_BATCH
    per_rank = GLOBAL_BATCH // world

    model, opt, kfac = build(args)
    manager = CheckpointManager(args.run / "checkpoints", keep=2, rank=rank, world_size=world)
    # Per-rank streams differ (as in a real job); restored from the checkpoint on resume.
    torch.manual_seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    random.seed(args.seed + rank)
    step, position = 0, DataPosition(0, 0, args.seed)
    ckpt = load_checkpoint(args.resume_from) if args.resume_from else manager.load_latest()
    resumed_from = None
    if ckpt is not None:
        restored = restore_training_state(
            ckpt, model=model, optimizer=opt, preconditioner=kfac, rank=rank, world_size=world
        )
        step, position, resumed_from = restored.step, restored.data_position, restored.step

    def save() -> None:
        manager.save(
            capture_training_state(
                step=step,
                model=model,
                optimizer=opt,
                preconditioner=kfac,  # type: ignore[arg-type]
                data_position=position,
                config=vars(args) | {"run": str(args.run), "resume_from": None},
                config_hash="tiny",
                rank=rank,
                world_size=world,
            )
        )

    end = "done"
    stop_at = args.stop_at if args.stop_at is not None else args.steps
    with PreemptionHandler() as handler:
        while step < stop_at:
            epoch, b = position.epoch, position.batch_index
            order = torch.randperm(
                len(x_all), generator=torch.Generator().manual_seed(position.sampler_seed + epoch)
            )
            idx = order[
                b * GLOBAL_BATCH + rank * per_rank : b * GLOBAL_BATCH + (rank + 1) * per_rank
            ]
            x, y = x_all[idx], y_all[idx]
            if not args.deterministic_data:
                noise = np.random.normal(0.0, 0.01, size=tuple(x.shape))
                x = x * (1.0 + 0.01 * random.random()) + torch.from_numpy(noise).to(dtype)
            model.train()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if world > 1:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            if kfac is not None:
                kfac.step()  # type: ignore[attr-defined]
            opt.step()
            step += 1
            b += 1
            position = DataPosition(
                epoch + (b == steps_per_epoch), b % steps_per_epoch, position.sampler_seed
            )
            if args.signal_at == step and rank == args.signal_rank:
                os.kill(os.getpid(), signal.SIGUSR2)
            if handler.should_stop():
                save()
                end = "preempted"
                break
            if args.save_every and step % args.save_every == 0:
                save()
    if end == "done" and args.stop_at is not None:
        save()
    # collective under MEM-OPT/HYBRID-OPT: factors are gathered from their owners
    kfac_state = kfac.state_dict() if kfac is not None else None  # type: ignore[attr-defined]
    if rank == 0:
        attempt = len(list(args.run.glob("final-*.h5")))
        out = {"params": {n.replace(".", "_"): p.detach() for n, p in model.named_parameters()}}
        if kfac_state is not None:
            out["kfac"] = kfac_state
        with open_h5(args.run / f"final-{attempt}.h5", "w") as h5:
            write_tree(h5, out)
    record = {"rank": rank, "world": world, "step": step, "end": end, "resumed_from": resumed_from}
    os.write(1, (json.dumps(record) + "\n").encode())  # one write: ranks share stdout
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return REQUEUE_EXIT_CODE if end == "preempted" else 0


if __name__ == "__main__":
    main_or_leave(main)
