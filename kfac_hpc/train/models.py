"""The networks of the job, written here so torchvision stays optional.

Inputs are NCHW image batches (NCL sequences for ``cnn1d``); outputs are logits of shape
(N, num_classes).
CIFAR ResNets follow He et al. 2016 (3 stages of 16/32/64 channels, 6n+2 layers) with 1x1
projection shortcuts where the shape changes; ResNet-50 is the ImageNet bottleneck network.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from kfac_hpc.train.transformer import GPT, GPTSizes

if TYPE_CHECKING:
    from kfac_hpc.train.workloads import FactoryContext

__all__ = ["cnn1d", "gpt", "mlp", "resnet20", "resnet32", "resnet50", "resnet56", "small_cnn"]


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers: seconds per epoch on digits (8x8)."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _cnn1d(channels: int, length: int, num_classes: int, width: int) -> nn.Module:
    """The MNIST-1D paper's CNN: three stride-2 Conv1d layers of ``width`` channels (the
    paper's 25) and a linear classifier (every weight layer is Conv1d or Linear, so K-FAC
    preconditions all of it)."""
    out = length
    for kernel in (5, 3, 3):
        out = (out + 2 - kernel) // 2 + 1
    return nn.Sequential(
        nn.Conv1d(channels, width, 5, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(width, width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv1d(width, width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(width * out, num_classes),
    )


def _mlp(in_features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
    ]


class _Residual(nn.Module):
    """relu(body(x) + shortcut(x)); the shortcut is a strided 1x1 conv-BN when shapes change."""

    def __init__(self, body: nn.Sequential, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = body
        self.shortcut: nn.Module = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class BasicBlock(_Residual):
    """Two 3x3 conv-BN layers with a residual connection (CIFAR ResNets)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        body = nn.Sequential(
            *_conv_bn(cin, cout, 3, stride), nn.ReLU(inplace=True), *_conv_bn(cout, cout, 3)
        )
        super().__init__(body, cin, cout, stride)


class Bottleneck(_Residual):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a residual connection (ResNet-50)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        body = nn.Sequential(
            *_conv_bn(cin, width, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride),
            nn.ReLU(inplace=True),
            *_conv_bn(width, width * 4, 1),
        )
        super().__init__(body, cin, width * 4, stride)


def _cifar_resnet(depth: int, channels: int, num_classes: int) -> nn.Module:
    blocks_per_stage = (depth - 2) // 6
    layers: list[nn.Module] = [*_conv_bn(channels, 16, 3), nn.ReLU(inplace=True)]
    cin = 16
    for stage, width in enumerate((16, 32, 64)):
        for block in range(blocks_per_stage):
            layers.append(BasicBlock(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


def _resnet50(channels: int, num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [
        *_conv_bn(channels, 64, 7, 2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    cin = 64
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for block in range(blocks):
            layers.append(Bottleneck(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


# The built-in models' factories (contracts/workload_names.py registers them by name): each
# takes the FactoryContext of kfac_hpc.train.workloads (input_shape, num_classes, config).


def _inputs(ctx: FactoryContext) -> tuple[tuple[int, ...], int]:
    assert ctx.input_shape is not None and ctx.num_classes is not None
    return ctx.input_shape, ctx.num_classes


def small_cnn(ctx: FactoryContext) -> nn.Module:
    """Two convolutions, two linear layers (images)."""
    shape, classes = _inputs(ctx)
    return SmallCNN(shape[0], classes)


def mlp(ctx: FactoryContext) -> nn.Module:
    """Three linear layers on the flattened input (any shape)."""
    shape, classes = _inputs(ctx)
    return _mlp(math.prod(shape), classes)


def cnn1d(ctx: FactoryContext) -> nn.Module:
    """The MNIST-1D paper's CNN (sequences; ``--cnn1d-channels`` wide)."""
    shape, classes = _inputs(ctx)
    return _cnn1d(shape[0], shape[-1], classes, ctx.config.cnn1d_channels)


def resnet20(ctx: FactoryContext) -> nn.Module:
    """CIFAR ResNet-20 (images)."""
    shape, classes = _inputs(ctx)
    return _cifar_resnet(20, shape[0], classes)


def resnet32(ctx: FactoryContext) -> nn.Module:
    """CIFAR ResNet-32 (images)."""
    shape, classes = _inputs(ctx)
    return _cifar_resnet(32, shape[0], classes)


def resnet56(ctx: FactoryContext) -> nn.Module:
    """CIFAR ResNet-56 (images)."""
    shape, classes = _inputs(ctx)
    return _cifar_resnet(56, shape[0], classes)


def resnet50(ctx: FactoryContext) -> nn.Module:
    """ImageNet ResNet-50 (images)."""
    shape, classes = _inputs(ctx)
    return _resnet50(shape[0], classes)


def gpt(ctx: FactoryContext) -> nn.Module:
    """A GPT-style byte-level decoder (byte windows; sizes from the ``gpt_*`` options and
    ``--context-length``)."""
    return GPT(GPTSizes.of(ctx.config))
