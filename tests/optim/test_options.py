"""Every invalid option raises ValueError naming the option (and its valid range)."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc

import pytest
import torch
from torch import nn

from kfac_hpc import KFACPreconditioner
from kfac_hpc.optim import KFACOptions

INVALID = [
    ("factor_update_steps", 0),
    ("factor_update_steps", 2.5),
    ("factor_update_steps", "10"),
    ("inv_update_steps", -1),
    ("damping", 0.0),
    ("damping", float("nan")),
    ("factor_decay", 1.0),
    ("factor_decay", -0.1),
    ("kl_clip", 0),
    ("lr", -0.1),
    ("lr", True),
    ("accumulation_steps", 0),
    ("accumulation_steps", 1.5),
    ("allreduce_bucket_cap_mb", 0),
    ("allreduce_bucket_cap_mb", "25"),
    ("assignment_strategy", "fastest"),
    ("colocate_factors", "yes"),
    ("compute_method", "cholesky"),
    ("compute_eigenvalue_outer_product", 1),
    ("grad_worker_fraction", "half"),
    ("grad_worker_fraction", 0.0),
    ("grad_worker_fraction", 1.5),
    ("grad_worker_fraction", 0.5),  # f·P = 0.5 ranks at world size 1
    ("symmetry_aware", None),
    ("grad_scaler", object()),
    ("factor_dtype", torch.int32),
    ("inv_dtype", torch.float16),
    ("skip_layers", "fc"),
    ("update_factors_in_hook", "no"),
    ("synchronize_timings", 0),
]


@pytest.mark.parametrize(
    ("name", "value"),
    INVALID,
    ids=[f"{n}={type(v).__name__ if type(v) is object else repr(v)}" for n, v in INVALID],
)
def test_invalid_option_names_itself(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        KFACPreconditioner(nn.Linear(2, 2), **{name: value})


def test_unknown_option_is_refused_naming_it() -> None:
    # The constructor's signature is explicit: Python itself refuses a misspelt option.
    with pytest.raises(TypeError, match="facter_decay"):
        KFACPreconditioner(nn.Linear(2, 2), facter_decay=0.9)


def test_signature_shows_every_option_with_the_validated_default() -> None:
    signature = inspect.signature(KFACPreconditioner)
    options = {f.name: f.default for f in dataclasses.fields(KFACOptions)}
    shown = {n: p.default for n, p in signature.parameters.items() if n != "model"}
    assert shown == options
    text = pydoc.render_doc(KFACPreconditioner, renderer=pydoc.plaintext)
    assert all(f"{name}:" in text for name in options)


def test_scheduled_value_out_of_range_names_option() -> None:
    model = nn.Linear(2, 2)
    pre = KFACPreconditioner(model, damping=lambda step: 0.1 - 0.1 * step)
    model(torch.randn(3, 2)).sum().backward()
    pre.step()
    model(torch.randn(3, 2)).sum().backward()
    with pytest.raises(ValueError, match="damping must be a finite number > 0"):
        pre.step()


def test_repr_names_layers_and_options() -> None:
    text = repr(KFACPreconditioner(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), damping=0.01))
    assert "damping=0.01" in text and "0 (Linear, A 3, G 3)" in text and "comm-opt" in text


def test_skip_layers_by_name_prefix_or_class() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3)), nn.Conv2d(1, 1, 1), nn.Linear(3, 1)
    )
    assert list(KFACPreconditioner(model, skip_layers=["0"]).layers) == ["1", "2"]
    assert list(KFACPreconditioner(model, skip_layers=["conv2d", "0.1"]).layers) == ["0.0", "2"]


def test_module_called_twice_needs_step_time_factors() -> None:
    layer = nn.Linear(2, 2)
    model = nn.Sequential(layer, nn.ReLU(), layer)
    pre = KFACPreconditioner(model)
    with pytest.raises(RuntimeError, match="layer 0 ran more than accumulation_steps"):
        model(torch.randn(3, 2)).sum().backward()
    pre.remove_hooks()
    pre = KFACPreconditioner(model, update_factors_in_hook=False)
    model(torch.randn(3, 2)).sum().backward()
    pre.step()
    assert pre.factors["0"].A is not None
