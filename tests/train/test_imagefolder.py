"""The built-in `imagefolder` dataset: an ImageNet-layout folder read with Pillow as a Dataset,
decoded as it is read; worker processes hand out the very batches the step would read itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.data import ShardedBatches
from kfac_hpc.train.imagefolder import CROP
from kfac_hpc.train.workloads import load_data

Image = pytest.importorskip("PIL.Image")


def _folder(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for split, count in (("train", 4), ("val", 2)):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (240, 300, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def test_an_image_folder_is_decoded_resized_and_cropped(tmp_path):
    root = _folder(tmp_path / "images")
    source = load_data(TrainConfig(dataset="imagefolder", data_path=str(root)))
    assert (source.shape, source.num_classes) == ((3, CROP, CROP), 2)
    assert (source.train_len, source.test_len) == (8, 4)
    x, y = source.test(torch.tensor([0, 3]))
    assert x.shape == (2, 3, CROP, CROP) and y.tolist() == [0, 1]  # classes in sorted order
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    # the crop is the centre of the image resized so its shorter side is 256
    expected = (
        Image.open(root / "val" / "cat" / "0.png")
        .convert("RGB")
        .resize((320, 256), Image.Resampling.BILINEAR)
    )
    centre = np.asarray(expected)[16 : 16 + CROP, 48 : 48 + CROP]
    assert np.allclose(x[0].permute(1, 2, 0).numpy() * 255, centre, atol=1e-3)


def test_worker_processes_hand_out_the_batches_the_step_would_read(tmp_path):
    source = load_data(TrainConfig(dataset="imagefolder", data_path=str(_folder(tmp_path / "i"))))
    inline = ShardedBatches(source, 4, 1, 2, seed=5, augment=False)
    workers = ShardedBatches(source, 4, 1, 2, seed=5, augment=False, workers=1)
    for step in (1, 0, 1):  # a step other than the next one restarts the loader there
        a, b = inline.batch(0, step), workers.batch(0, step)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
