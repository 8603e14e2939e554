"""An ImageNet-layout folder as a map-style Dataset: ``ROOT/CLASS/*.jpg`` (any image file
Pillow reads), classes in sorted order. Each item is decoded when it is read, so worker
processes (``--data-workers``) decode while the step computes. Pillow does the decoding;
torchvision is not needed.

The transform is ImageNet's evaluation one for every split: the shorter side resized to 256,
the centre 224x224 crop, RGB scaled to [0, 1] as a (3, 224, 224) float tensor.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ImageFolder"]

RESIZE, CROP = 256, 224
_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})


class ImageFolder(Dataset):
    """The images under ``root``, one sub-folder per class."""

    def __init__(self, root: Path) -> None:
        if importlib.util.find_spec("PIL") is None:
            raise ImportError("dataset 'imagefolder' needs Pillow: pip install pillow")
        self.root = root
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((root / name).rglob("*"))
            if path.suffix.lower() in _SUFFIXES
        ]
        if not self.samples:
            raise FileNotFoundError(f"no images under {str(root)!r} (ROOT/CLASS/*.jpg)")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        scale = RESIZE / min(rgb.size)
        width, height = round(rgb.width * scale), round(rgb.height * scale)
        rgb = rgb.resize((width, height), Image.Resampling.BILINEAR)
        left, top = (width - CROP) // 2, (height - CROP) // 2
        rgb = rgb.crop((left, top, left + CROP, top + CROP))
        pixels = torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())
        return pixels.permute(2, 0, 1).float().div_(255.0), label
