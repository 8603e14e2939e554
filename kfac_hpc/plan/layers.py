"""What a model is made of, as the cost model needs it: one entry per K-FAC layer.

Found by running one sample through the real model (``kfac_hpc.train.models``) with hooks on
the modules K-FAC preconditions, so the shapes are those the job trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kfac_hpc.contracts.errors import InputError
from kfac_hpc.contracts.options import DATASETS
from kfac_hpc.contracts.workload_names import BUILTIN_MODELS, absolute_name
from kfac_hpc.optim.layers import KFACLayer, make_layer
from kfac_hpc.plan.errors import PlanInputError, check_planned
from kfac_hpc.train.config import TrainConfig
from kfac_hpc.train.workloads import build_model

__all__ = [
    "INPUTS",
    "LayerShape",
    "ModelShape",
    "ModuleCost",
    "build_network",
    "check_fit",
    "model_shape",
    "module_kind",
    "weight_flops",
]

# dataset -> (input shape C, H, W of images or C, L of sequences; classes); cifar10,
# imagefolder and mnist1d are the shapes of the real sets (the plan needs no data files)
INPUTS: dict[str, tuple[tuple[int, ...], int]] = {
    "digits": ((1, 8, 8), 10),
    "mnist1d": ((1, 40), 10),
    "synthetic_cifar": ((3, 32, 32), 10),
    "cifar10": ((3, 32, 32), 10),
    "synthetic_imagenet": ((3, 224, 224), 1000),
    "imagefolder": ((3, 224, 224), 1000),
}


@dataclass(frozen=True)
class LayerShape:
    """One K-FAC layer. ``n_a``/``n_g``: factor sizes (bias folded into A); ``rows``: rows of
    the factor matrices per sample (output positions of a conv, 1 for a linear layer);
    ``factor_flops``: FLOPs of the GEMMs the factor code runs per sample (row-shifted products
    and upper block triangles, not full products: ``KFACLayer.factor_flops``)."""

    name: str
    n_a: int
    n_g: int
    rows: int
    factor_flops: int
    groups: int = 1
    has_bias: bool = True

    @property
    def forward_flops(self) -> float:
        """Multiply-adds ×2 of the weight product per sample (bias excluded)."""
        n_in = self.n_a - 1 if self.has_bias else self.n_a
        return 2.0 * self.rows * n_in * self.n_g * self.groups

    @property
    def factor_elements(self) -> int:
        return (self.n_a**2 + self.n_g**2) * self.groups

    @property
    def grad_elements(self) -> int:
        return self.n_a * self.n_g * self.groups


@dataclass(frozen=True)
class ModuleCost:
    """One leaf module of the model, per sample: its kind (:func:`module_kind`), the FLOPs of
    its weight product (convolution, linear; else 0) and its input plus output elements."""

    name: str
    kind: str
    flops: float
    elements: int


_KINDS: tuple[tuple[tuple[type[nn.Module], ...], str], ...] = (
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), "conv"),
    ((nn.Linear,), "linear"),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), "batchnorm"),
    ((nn.LayerNorm, nn.GroupNorm), "layernorm"),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d), "adaptive_pool"),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d), "pool"),
    ((nn.Flatten, nn.Identity, nn.Unflatten), "view"),
)


def module_kind(module: nn.Module) -> str:
    """The kind a profile prices ``module`` as: ``conv``, ``linear``, ``batchnorm``,
    ``layernorm``, ``pool``, ``adaptive_pool``, ``view`` (reshapes); any other leaf module
    (ReLU, GELU, dropout, ...) is ``activation``: one elementwise pass."""
    for types, kind in _KINDS:
        if isinstance(module, types):
            return kind
    return "activation"


def weight_flops(module: nn.Module, out: torch.Tensor) -> float:
    """Multiply-adds ×2 of ``module``'s weight product for the output ``out`` of one sample
    (0 for a module without one)."""
    if isinstance(module, nn.Linear):
        return 2.0 * out.numel() * module.in_features
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        kernel = module.weight[0].numel()  # in_channels / groups × kernel positions
        return 2.0 * out.numel() * kernel
    return 0.0


@dataclass(frozen=True)
class ModelShape:
    """The K-FAC layers plus model-wide sizes (elements, per sample where stated)."""

    model: str
    dataset: str
    layers: tuple[LayerShape, ...]
    params: int
    activations_per_sample: int
    param_tensors: int = 0  # trainable parameter tensors (the optimizer loops over them)
    modules: tuple[ModuleCost, ...] = ()  # every leaf module, in forward order

    @property
    def forward_flops(self) -> float:
        return sum(layer.forward_flops for layer in self.layers)


def check_fit(model: str, dataset: str) -> None:
    """PlanInputError naming ``model`` when it cannot take ``dataset``'s input (the job's rule,
    TrainConfig.validate): cnn1d only the mnist1d sequences, the image models only images,
    mlp either."""
    sequences = len(INPUTS[dataset][0]) == 2
    if model == "mlp" or sequences == (model == "cnn1d"):
        return
    if model == "cnn1d":
        fix = f"takes the mnist1d sequences, not {dataset!r} images; give --dataset mnist1d"
    else:
        fix = f"takes images, not {dataset!r} sequences; give --model cnn1d or mlp"
    raise PlanInputError("model", f"{model!r} {fix}")


def build_network(model: str, dataset: str) -> nn.Module:
    """The job's network ``model`` (any name ``--model`` takes: a built-in, an installed
    package's, ``module:callable``, ``file.py:callable``) for ``dataset``'s input shape,
    built as the job builds it with the job's defaults; PlanInputError naming the flag."""
    check_planned(model, dataset)
    if dataset not in DATASETS:
        raise PlanInputError("dataset", f"{dataset!r} is not one of {', '.join(DATASETS)}")
    if model in BUILTIN_MODELS:
        check_fit(model, dataset)
    shape, classes = INPUTS[dataset]
    try:
        return build_model(TrainConfig(model=absolute_name(model)), shape, classes)
    except InputError as exc:
        raise PlanInputError(exc.field, exc.reason) from None


def model_shape(model: str, dataset: str) -> ModelShape:
    """The layer inventory of ``model`` on ``dataset``'s input shape."""
    net = build_network(model, dataset)
    shape = INPUTS[dataset][0]
    layers, rows, inputs, activations, modules = _probe(net, shape)
    shapes = tuple(
        LayerShape(
            k.name,
            k.n_a,
            k.n_g,
            rows[k.name],
            k.factor_flops(inputs[k.name]),
            k.groups,
            k.bias is not None,
        )
        for k in layers
    )
    trained = [p for p in net.parameters() if p.requires_grad]
    params = sum(p.numel() for p in trained)
    return ModelShape(model, dataset, shapes, params, activations, len(trained), tuple(modules))


def _probe(
    net: nn.Module, shape: tuple[int, ...]
) -> tuple[list[KFACLayer], dict[str, int], dict[str, tuple[int, ...]], int, list[ModuleCost]]:
    """One sample through ``net``: K-FAC layers, their output positions and input shapes
    (without the batch), activation elements, every leaf module's cost inventory."""
    layers: list[KFACLayer] = []
    rows: dict[str, int] = {}
    inputs: dict[str, tuple[int, ...]] = {}
    modules: list[ModuleCost] = []
    activations = 0
    handles = []

    def leaf_hook(
        module: nn.Module, args: tuple[object, ...], out: torch.Tensor, name: str
    ) -> None:
        nonlocal activations
        activations += out.numel()
        read = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
        kind = module_kind(module)
        modules.append(ModuleCost(name, kind, weight_flops(module, out), read + out.numel()))

    for name, module in net.named_modules():
        layer = make_layer(name or type(module).__name__, module)
        if layer is not None:
            layers.append(layer)

            def hook(
                mod: nn.Module,
                args: tuple[torch.Tensor, ...],
                out: torch.Tensor,
                key: str = layer.name,
            ) -> None:
                rows[key] = out[0, 0].numel() if out.dim() > 2 else 1
                inputs[key] = tuple(args[0].shape[1:])

            handles.append(module.register_forward_hook(hook))
        if not list(module.children()):
            key = name or type(module).__name__
            handles.append(
                module.register_forward_hook(lambda m, a, o, k=key: leaf_hook(m, a, o, k))
            )
    net.eval()
    with torch.no_grad():
        net(torch.zeros(1, *shape))
    for handle in handles:
        handle.remove()
    return layers, rows, inputs, activations, modules
