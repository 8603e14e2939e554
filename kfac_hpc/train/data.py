"""Datasets of the job and their deterministic sharding over ranks. Nothing is downloaded.

A :class:`DataSource` returns batches by sample index. :class:`ShardedBatches` decides which
indices each rank takes: every epoch has one permutation of the training set (from the seed and
the epoch, the same on every rank); optimizer step ``s`` of the epoch uses the slice
``[s*G, (s+1)*G)`` of it (G the global batch), and rank ``r`` takes the ``r``-th per-rank part.
So the data a step sees depends only on (seed, epoch, step, rank): a resumed run sees exactly
what an uninterrupted one would. In-memory tensors are indexed in place; a Dataset's samples
are read in that same order by worker processes (:mod:`kfac_hpc.train.loader`).
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from kfac_hpc.contracts.targets import HIGHER_IS_BETTER
from kfac_hpc.train.imagefolder import ImageFolder
from kfac_hpc.train.loader import StepLoader

if TYPE_CHECKING:
    from kfac_hpc.train.workloads import FactoryContext

__all__ = [
    "DataSource",
    "ShardedBatches",
    "cifar10",
    "cross_entropy",
    "dataset_source",
    "digits",
    "digits_arrays",
    "digits_split",
    "generated_text",
    "imagefolder",
    "mnist1d",
    "read_cifar10_batch",
    "synthetic_cifar",
    "synthetic_imagenet",
    "tensor_source",
    "text",
]

_POOL_BYTES = 64 * 2**20  # synthetic data cycles through a pool of at most this many bytes
_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (N, C) or (N, ..., C) against class
    indices (N,) or (N, ...): a classifier's loss and a language model's alike."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


@dataclass
class DataSource:
    """Train and test samples addressed by index; ``shape`` is one sample's, e.g. (C, H, W) of
    images or (C, L) of sequences. ``loss(outputs, targets)`` is the mean training loss;
    ``metric`` the quality the workload is judged by (a key of
    :data:`~kfac_hpc.contracts.targets.HIGHER_IS_BETTER`)."""

    name: str
    shape: tuple[int, ...]
    num_classes: int
    train_len: int
    test_len: int
    train: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    test: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    metric: str = "accuracy"
    dataset: Dataset | None = None  # the train Dataset behind ``train``, for worker processes

    def __post_init__(self) -> None:
        if self.metric not in HIGHER_IS_BETTER:
            raise ValueError(f"metric {self.metric!r} is not one of {', '.join(HIGHER_IS_BETTER)}")


def tensor_source(
    name: str, train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor]
) -> DataSource:
    """In-memory (inputs, targets) tensors of the train and test sets; the classes are the
    largest target + 1."""
    (xtr, ytr), (xte, yte) = train, test
    return DataSource(
        name,
        tuple(xtr.shape[1:]),
        int(max(ytr.max().item(), yte.max().item())) + 1,
        len(ytr),
        len(yte),
        lambda idx: (xtr[idx], ytr[idx]),
        lambda idx: (xte[idx], yte[idx]),
    )


def _stacked(dataset: Dataset) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A batch of map-style ``dataset`` items (sample, target) by index, stacked."""

    def get(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [dataset[int(i)] for i in idx]
        return torch.stack([x for x, _ in items]), torch.as_tensor([y for _, y in items])

    return get


def dataset_source(name: str, train: Dataset, test: Dataset) -> DataSource:
    """Map-style Datasets of (sample, class) items; the classes come from ``num_classes`` or
    ``classes`` of ``train`` (an ImageFolder's, ours or torchvision's)."""
    classes = getattr(train, "num_classes", None)
    if classes is None and hasattr(train, "classes"):
        classes = len(train.classes)
    if not isinstance(classes, int) or classes < 1:
        raise ValueError(f"{name}: the train Dataset needs num_classes or classes")
    sample, _ = train[0]
    return DataSource(
        name,
        tuple(torch.as_tensor(sample).shape),
        classes,
        len(train),  # type: ignore[arg-type]
        len(test),  # type: ignore[arg-type]
        _stacked(train),
        _stacked(test),
        dataset=train,
    )


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits as shipped: images (1797, 64) uint8 in [0, 16], labels (1797,) uint8."""
    with resources.files("kfac_hpc").joinpath("data/digits.npz").open("rb") as fh:
        data = np.load(fh)
        return data["images"], data["labels"]


def digits_split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits' fixed 80/20 split of ``count`` images: (train, test) indices, from seed 0
    always, so every run and every digits workload tests on the same images."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * count)
    return order[:cut], order[cut:]


def _digits(seed: int) -> DataSource:
    """The 1,797 8x8 UCI digits (scikit-learn's copy, shipped in ``kfac_hpc/data``),
    standardised; a fixed 80/20 split (seed 0 always, so every run tests on the same images)."""
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    train, test = digits_split(len(y))
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return tensor_source("digits", (x[train], y[train]), (x[test], y[test]))


def _mnist1d(train_samples: int, cache: Path | None) -> DataSource:
    """MNIST-1D (Greydanus 2020): 10 classes of length-40 sequences, generated locally by the
    ``mnist1d`` package from its templates (never downloaded). ``train_samples`` training
    sequences and a quarter as many test sequences (the package's 80/20 split), from the
    package's fixed seed, so every run sees the same data. Shape (1, 40). With ``cache`` (a
    folder) the arrays are read from ``mnist1d-<samples>.npz`` there, or generated and written
    to it (atomically) when it is missing: generating 40,000 sequences takes seconds."""
    if importlib.util.find_spec("mnist1d") is None:
        raise ImportError(
            "dataset 'mnist1d' needs the mnist1d package: pip install 'kfac-hpc[mnist1d]'"
        )
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = 10 * -(-train_samples * 5 // 40)  # 5/4 of it, a multiple of 10 classes
    cached = None if cache is None else cache / f"mnist1d-{args.num_samples}.npz"
    if cached is not None and cached.is_file():
        with np.load(cached) as stored:
            raw = {key: stored[key] for key in ("x", "y", "x_test", "y_test")}
    else:
        # The generator reseeds the global RNGs: keep the job's own streams untouched.
        saved = random.getstate(), np.random.get_state()
        try:
            raw = make_dataset(args)
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
        if cached is not None:
            partial = cached.with_name(f".{cached.name}.{os.getpid()}.npz")
            np.savez(partial, **{key: raw[key] for key in ("x", "y", "x_test", "y_test")})
            os.replace(partial, cached)

    def part(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(x, dtype=torch.float32).unsqueeze(1), torch.tensor(y, dtype=torch.int64)

    return tensor_source("mnist1d", part(raw["x"], raw["y"]), part(raw["x_test"], raw["y_test"]))


def _synthetic(shape: tuple[int, int, int], num_classes: int, n: int, seed: int) -> DataSource:
    """Random images of a fixed seed (for throughput): a pool of at most 64 MiB is cycled,
    labels are random per sample index."""
    gen = torch.Generator().manual_seed(seed)
    sample_bytes = 4 * shape[0] * shape[1] * shape[2]
    pool = torch.randn(min(n, max(1, _POOL_BYTES // sample_bytes)), *shape, generator=gen)
    n_test = max(1, n // 8)
    labels = torch.randint(0, num_classes, (n + n_test,), generator=gen)

    def train(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pool[idx % len(pool)], labels[idx]

    def test(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pool[(idx + n) % len(pool)], labels[idx + n]

    name = "synthetic_cifar" if shape[1] == 32 else "synthetic_imagenet"
    return DataSource(name, shape, num_classes, n, n_test, train, test)


def read_cifar10_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 binary batch: records of 1 label byte + 3072 pixel bytes (RGB planes)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % 3073:
        raise ValueError(f"{path} is not a CIFAR-10 binary batch (size {raw.size} bytes)")
    records = raw.reshape(-1, 3073)
    images = torch.from_numpy(records[:, 1:].copy()).reshape(-1, 3, 32, 32)
    return images, torch.from_numpy(records[:, 0].astype(np.int64))


def _cifar10(root: Path) -> DataSource:
    train_files = sorted(root.glob("data_batch_*.bin"))
    test_file = root / "test_batch.bin"
    if not train_files or not test_file.is_file():
        raise FileNotFoundError(
            f"data_path {str(root)!r} lacks data_batch_*.bin / test_batch.bin "
            "(the CIFAR-10 binary version)"
        )
    parts = [read_cifar10_batch(p) for p in train_files]
    mean = torch.tensor(_CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(_CIFAR_STD).view(1, 3, 1, 1)

    def norm(images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - mean) / std

    xtr = norm(torch.cat([p[0] for p in parts]))
    ytr = torch.cat([p[1] for p in parts])
    xte, yte = read_cifar10_batch(test_file)
    source = tensor_source("cifar10", (xtr, ytr), (norm(xte), yte))
    source.num_classes = 10
    return source


def _imagefolder(root: Path) -> DataSource:
    """``root/train`` and ``root/val`` (ImageNet's layout), decoded as they are read."""
    return dataset_source("imagefolder", ImageFolder(root / "train"), ImageFolder(root / "val"))


# The built-in datasets' factories (contracts/workload_names.py registers them by name).


def digits(ctx: FactoryContext) -> DataSource:
    """The 8x8 UCI digits shipped with the package."""
    return _digits(ctx.config.seed)


def mnist1d(ctx: FactoryContext) -> DataSource:
    """MNIST-1D, generated locally (``--data-path``: a cache folder)."""
    return _mnist1d(ctx.config.num_samples, ctx.data_path)


def synthetic_cifar(ctx: FactoryContext) -> DataSource:
    """Random 3x32x32 images of 10 classes (throughput)."""
    return _synthetic((3, 32, 32), 10, ctx.config.num_samples, ctx.config.seed)


def synthetic_imagenet(ctx: FactoryContext) -> DataSource:
    """Random 3x224x224 images of 1,000 classes (throughput)."""
    return _synthetic((3, 224, 224), 1000, ctx.config.num_samples, ctx.config.seed)


def cifar10(ctx: FactoryContext) -> DataSource:
    """CIFAR-10's binary batches in ``--data-path``."""
    assert ctx.data_path is not None  # the config requires it
    return _cifar10(ctx.data_path)


def imagefolder(ctx: FactoryContext) -> DataSource:
    """An ImageNet-layout folder (``train/CLASS/*.jpg``, ``val/CLASS/*.jpg``)."""
    assert ctx.data_path is not None  # the config requires it
    return _imagefolder(ctx.data_path)


def generated_text(ctx: FactoryContext) -> DataSource:
    """Byte windows of the corpus generated in kfac_hpc.train.text_data (``gpt``'s)."""
    from kfac_hpc.train import text_data  # it builds on DataSource: imported when used

    return text_data.generated_text(ctx.config.num_samples, ctx.config.context_length)


def text(ctx: FactoryContext) -> DataSource:
    """Byte windows of a UTF-8 file or folder of files in ``--data-path`` (``gpt``'s)."""
    from kfac_hpc.train import text_data

    assert ctx.data_path is not None  # the config requires it
    return text_data.text_files(ctx.data_path, ctx.config.context_length)


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random 4-pixel-padded crop and horizontal flip, per sample (x: N, C, H, W)."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    dy = torch.randint(0, 9, (n,), generator=gen)
    dx = torch.randint(0, 9, (n,), generator=gen)
    flip = torch.rand(n, generator=gen) < 0.5
    out = torch.empty_like(x)
    for i in range(n):
        crop = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
        out[i] = crop.flip(-1) if flip[i] else crop
    return out


class ShardedBatches:
    """Which samples rank ``rank`` of ``world_size`` uses at each step; see the module doc."""

    def __init__(
        self,
        source: DataSource,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        augment: bool,
        pin_memory: bool = False,
        workers: int = 0,
    ) -> None:
        """``pin_memory``: hand out batches in page-locked host memory, so that the copy to
        the GPU (``.to(device, non_blocking=True)``) runs asynchronously. ``workers``: read a
        Dataset's samples (``source.dataset``) in that many worker processes, ahead of the
        step (:mod:`kfac_hpc.train.loader`); in-memory tensors are always read in place."""
        self.source = source
        self.pin_memory = pin_memory
        self.loader = (
            StepLoader(source.dataset, workers, pin_memory)
            if workers > 0 and source.dataset is not None
            else None
        )
        self.global_batch = global_batch
        self.per_rank = global_batch // world_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.augment = augment and source.shape[1:] == (32, 32)
        self.steps_per_epoch = source.train_len // global_batch
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def batch(self, epoch: int, step_in_epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels) of ``step_in_epoch`` in ``epoch``."""
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.source.train_len, generator=gen)
            self._epoch = epoch
        part = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        if self.loader is not None:
            x, y = self.loader.batch(
                self._perm, epoch, step_in_epoch, self.steps_per_epoch, self.global_batch, part
            )
        else:
            start = step_in_epoch * self.global_batch
            x, y = self.source.train(self._perm[start + part.start : start + part.stop])
        if self.augment:
            key = ((self.seed * 1_000_003 + epoch) * 100_003 + step_in_epoch) * 1009 + self.rank
            x = _augment(x, torch.Generator().manual_seed(key))
        if self.pin_memory and not x.is_pinned():
            return x.pin_memory(), y.pin_memory()
        return x, y

    def test_batches(self, batch: int, ranks: int | None = None) -> list[torch.Tensor]:
        """This rank's share of the test set (every ``ranks``-th sample; default: every
        ``world_size``-th), in batches."""
        idx = torch.arange(self.rank, self.source.test_len, ranks or self.world_size)
        return list(idx.split(batch))
