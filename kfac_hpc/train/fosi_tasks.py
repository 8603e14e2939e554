"""Two task types of FOSI's paper as workloads of the job, on the digits shipped with the package.

* ``--dataset kfac_hpc.train.fosi_tasks:digits_reconstruction`` with
  ``--model kfac_hpc.train.fosi_tasks:autoencoder``: a fully connected autoencoder that
  reconstructs each standardized 8x8 digit (64 numbers) through a narrow code; the loss and the
  quality metric are the mean squared error per pixel (lower is better: ``--target-loss``).
* ``--dataset kfac_hpc.train.fosi_tasks:mnist1d_reconstruction``: the same reconstruction task
  on the MNIST-1D sequences (40 numbers each), for wider autoencoders such as FOSI's paper's
  ``--model-arg widths=1000-500-250-30``, whose forward and backward dominate a step.
* ``--dataset digits --model kfac_hpc.train.fosi_tasks:logistic``: multinomial logistic
  regression, one ``Linear`` from the flattened input to the class logits (cross-entropy).

They are ``module:callable`` references (docs/workloads.md), resolved like any workload.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from kfac_hpc.train.data import DataSource, digits_arrays, digits_split, mnist1d
from kfac_hpc.train.workloads import FactoryContext

__all__ = ["autoencoder", "digits_reconstruction", "logistic", "mnist1d_reconstruction", "mse"]

# the autoencoder's encoder widths, input side first (the decoder mirrors them)
DEFAULT_WIDTHS = (128, 32, 8)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error per element (the reconstruction loss)."""
    return torch.nn.functional.mse_loss(outputs, targets)


def digits_reconstruction(ctx: FactoryContext) -> DataSource:
    """The 1,797 digits as flat 64-vectors (pixels / 16, standardized per pixel over the
    training images), each its own target; the digits' fixed 80/20 split (seed 0)."""
    images, _ = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    train, test = digits_split(len(x))
    mean, std = x[train].mean(dim=0), x[train].std(dim=0)
    x = (x - mean) / std.clamp_min(0.1)  # a pixel that is (almost) always blank stays ~0
    return _reconstruction("digits_reconstruction", x[train], x[test])


def mnist1d_reconstruction(ctx: FactoryContext) -> DataSource:
    """MNIST-1D's sequences (``--num-samples`` training ones, mnist1d's own train/test split) as
    flat 40-vectors, standardized per position over the training sequences, each its own
    target."""
    source = mnist1d(ctx)
    xtr, _ = source.train(torch.arange(source.train_len))
    xte, _ = source.test(torch.arange(source.test_len))
    xtr, xte = xtr.flatten(1), xte.flatten(1)
    mean, std = xtr.mean(dim=0), xtr.std(dim=0)
    return _reconstruction("mnist1d_reconstruction", (xtr - mean) / std, (xte - mean) / std)


def _reconstruction(name: str, xtr: torch.Tensor, xte: torch.Tensor) -> DataSource:
    """Flat training and test vectors, each its own target; the loss and metric are the MSE."""
    return DataSource(
        name,
        (xtr.shape[1],),
        xtr.shape[1],  # the outputs: one per input number
        len(xtr),
        len(xte),
        lambda idx: (xtr[idx], xtr[idx]),
        lambda idx: (xte[idx], xte[idx]),
        loss=mse,
        metric="loss",
    )


def _widths(text: str) -> tuple[int, ...]:
    widths = tuple(int(w) for w in text.split("-"))
    if not widths or min(widths) < 1:
        raise ValueError(f"widths={text!r}: give positive integers joined by '-', e.g. 128-32-8")
    return widths


def autoencoder(ctx: FactoryContext) -> nn.Module:
    """Linear layers through the encoder widths (``--model-arg widths=128-32-8``, the last the
    code) and back, tanh between them, a linear output of the input's size."""
    assert ctx.input_shape is not None
    features = math.prod(ctx.input_shape)
    widths = _widths(ctx.args.get("widths", "-".join(map(str, DEFAULT_WIDTHS))))
    sizes = [features, *widths, *reversed(widths[:-1]), features]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def logistic(ctx: FactoryContext) -> nn.Module:
    """Multinomial logistic regression: the flattened input to the class logits."""
    assert ctx.input_shape is not None and ctx.num_classes is not None
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(ctx.input_shape), ctx.num_classes))
