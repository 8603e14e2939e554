"""The arithmetic of the step's forward and backward (``--precision``): float32, bfloat16
autocast, or float16 autocast with dynamic loss scaling (``torch.amp.GradScaler``).

Parameters, optimizer state and K-FAC factors stay float32 under every precision: autocast
only lowers the forward's matrix products (and their backward), and the preconditioner
computes its factors in the weights' dtype outside autocast. Under fp16 the loss is scaled
before the backward, the gradients are unscaled after the gradient allreduce (K-FAC's G
divides the scale out itself, as the scaler is handed to it), a step whose gradients hold an
inf or NaN is skipped by the scaler, and the scale is updated after every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kfac_hpc.train.config import ConfigError

__all__ = ["Precision"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and loss scaling of one job on ``device``; ConfigError naming ``precision``
    where this torch cannot run it (fp16 loss scaling on a CPU needs torch >= 2.3)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device_type = device.type
        self.dtype = _DTYPES.get(name)
        self.scaler: torch.amp.GradScaler | None = None
        if name == "fp16":
            try:
                self.scaler = torch.amp.GradScaler(device.type)
            except (TypeError, RuntimeError, AttributeError) as exc:
                raise ConfigError(
                    "precision",
                    f"fp16 loss scaling is not available on {device.type} with torch "
                    f"{torch.__version__} ({exc}); use --precision bf16 or fp32",
                ) from None

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward (and its loss) under autocast; nothing under fp32."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the scaled loss under fp16."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the (allreduced) gradients by the loss scale, noting infs for the step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def update(self) -> None:
        """Grow or shrink the loss scale after the step (fp16)."""
        if self.scaler is not None:
            self.scaler.update()
