"""A plain PyTorch training loop of a small CNN on the bundled 8x8 digits, with K-FAC, kept as
it is and run through ``kfac_hpc.Run`` (docs/workloads.md, "Your own training script").

    python examples/cnn_digits.py --run-dir runs/cnn --epochs 3
    kfac-hpc sweep --script examples/cnn_digits.py --backend local --nodes 1,2 -- --epochs 3

Under ``mpiexec -n 2`` (or ``srun``) every rank trains on its half of each batch; the run
directory is the one ``kfac-hpc train`` writes, so ``kfac-hpc report`` reads it.
"""

from __future__ import annotations

import argparse
from importlib import resources

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import kfac_hpc


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 digits shipped with kfac-hpc, split 1,497 / 300 with a fixed permutation."""
    with resources.files("kfac_hpc").joinpath("data/digits.npz").open("rb") as fh:
        arrays = np.load(fh)
        images, labels = arrays["images"], arrays["labels"]
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[300:], order[:300]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/cnn_digits")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="steps instead of epochs")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--no-kfac", action="store_true", help="plain SGD")
    parser.add_argument("--checkpoint-every", type=int, default=None)
    args = parser.parse_args()

    length = {"steps": args.steps} if args.steps else {"epochs": args.epochs}
    settings = {"lr": args.lr, "batch_size": args.batch_size, "kfac": not args.no_kfac, **length}
    with kfac_hpc.Run(
        args.run_dir,
        model="digits_cnn",
        dataset="digits",
        config=settings,
        checkpoint_every=args.checkpoint_every,
        log_every=5,
    ) as run:
        torch.manual_seed(0)
        train, test = digits()
        sampler = DistributedSampler(train, run.world_size, run.rank, shuffle=True, seed=0)
        loader = DataLoader(train, batch_size=args.batch_size // run.world_size, sampler=sampler)
        model = cnn().to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        pre = None if args.no_kfac else kfac_hpc.KFACPreconditioner(model, lr=args.lr)
        loss_fn = nn.CrossEntropyLoss()
        run.track(model=model, optimizer=optimizer, preconditioner=pre, sampler=sampler)
        total = args.steps or args.epochs * len(loader)

        for step, (x, y) in run.steps(loader, **length):
            x, y = x.to(run.device), y.to(run.device)
            optimizer.zero_grad()
            with run.phase("forward"):
                loss = loss_fn(model(x), y)
            with run.phase("backward"):
                loss.backward()
            run.average_gradients()
            if pre is not None:
                with run.phase("precondition"):
                    pre.step()
            with run.phase("optimizer"):
                optimizer.step()
            run.log(loss=loss)
            if (step + 1) % len(loader) == 0 or step + 1 == total:
                run.log(**evaluate(model, test, run))


def evaluate(model: nn.Module, test: TensorDataset, run: kfac_hpc.Run) -> dict[str, float]:
    """Loss and accuracy on the whole test set (every rank computes the same)."""
    x, y = (t.to(run.device) for t in test.tensors)
    with torch.no_grad():
        logits = model(x)
    loss = nn.functional.cross_entropy(logits, y).item()
    return {"eval_loss": loss, "accuracy": (logits.argmax(1) == y).float().mean().item()}


if __name__ == "__main__":
    main()
