"""Forward and backward priced by the model's own modules: the small CNN's inventory against
its shapes worked out by hand, each module's price against ``call + FLOPs·c + elements·c``
written out here, a kind the profile does not fit priced as before, the fit against
scipy's non-negative least squares on the real modules' measured points it was fitted to,
and the profile table's round trip and one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from scipy.optimize import nnls

from kfac_hpc.cli import main
from kfac_hpc.plan import layer_rates as rates
from kfac_hpc.plan.alphabeta import AlphaBeta
from kfac_hpc.plan.compute_costs import RatedCompute
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.layers import INPUTS, build_network, model_shape
from kfac_hpc.plan.module_fits import MODULE_KINDS, ModuleFit, fit_module
from kfac_hpc.plan.profiles import MachineProfile, load_profile
from kfac_hpc.plan.site import profile_text
from tests.plan.test_cli_input import write_profile

SHAPE = model_shape("small_cnn", "digits")
# the small CNN on 1×8×8 digits, per sample: (kind, weight FLOPs, input + output elements)
BY_HAND = [
    ("conv", 2 * 64 * 16 * 1 * 9, 64 + 16 * 64),  # 1 -> 16 channels, 3×3, 8×8 positions
    ("activation", 0, 2 * 16 * 64),
    ("conv", 2 * 64 * 32 * 16 * 9, 16 * 64 + 32 * 64),  # 16 -> 32
    ("activation", 0, 2 * 32 * 64),
    ("adaptive_pool", 0, 32 * 64 + 32 * 16),  # 8×8 -> 4×4
    ("view", 0, 2 * 32 * 16),  # flatten
    ("linear", 2 * 512 * 64, 512 + 64),
    ("activation", 0, 2 * 64),
    ("linear", 2 * 64 * 10, 64 + 10),
]
FITS = {
    "conv": ModuleFit((2e-5, 3e-11, 4e-9), (5e-5, 6e-11, 1e-8)),
    "linear": ModuleFit((1e-5, 2e-11, 1e-9), (3e-5, 4e-11, 2e-9)),
    "activation": ModuleFit((3e-6, 0.0, 5e-10), (6e-6, 0.0, 3e-9)),
    "adaptive_pool": ModuleFit((5e-5, 0.0, 6e-10), (1e-5, 0.0, 7e-10)),
    "view": ModuleFit((1e-5, 0.0, 0.0), (3e-5, 0.0, 0.0)),
}
CONV = ((1e5, 1e-4, 3e-4, 5e-4), (1e7, 4e-4, 9e-4, 2e-3), (1e9, 2e-2, 5e-2, 9e-2))


def _machine(fits: dict[str, ModuleFit], **curves: object) -> MachineProfile:
    return MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, modules=tuple(fits.items()), **curves)  # type: ignore[arg-type]


def test_the_inventory_is_every_leaf_module_with_its_own_shape() -> None:
    got = [(m.kind, m.flops, m.elements) for m in SHAPE.modules]
    assert got == BY_HAND
    assert sum(m.flops for m in SHAPE.modules) == SHAPE.forward_flops  # the layers' count


@pytest.mark.parametrize("batch", [16, 64])
def test_each_module_is_priced_by_its_kind_s_fit(batch: int) -> None:
    forward = backward = 0.0
    for kind, flops, elements in BY_HAND:
        f, b = FITS[kind].forward, FITS[kind].backward
        forward += f[0] + batch * flops * f[1] + batch * elements * f[2]
        backward += b[0] + batch * flops * b[1] + batch * elements * b[2]
    got = RatedCompute(_machine(FITS), SHAPE).forward_backward_s(batch)
    assert got == pytest.approx((forward, backward), rel=1e-12)


def test_a_kind_without_a_fit_is_priced_as_without_fits() -> None:
    """No conv fit: the convolutions from the conv curve (log-log, inside it), the rest
    from their fits; with ``kfac`` the hooks' factor update is added: from the curve for the
    convolutions, at the GEMM rate (+ 2 kernel launches) for the linear layers (no curve)."""
    fits = {k: v for k, v in FITS.items() if k != "conv"}
    machine = _machine(fits, conv_curve=CONV)
    batch = 32
    forward = backward = factor = 0.0
    for kind, flops, elements in BY_HAND:
        if kind == "conv":
            x = np.log(batch * flops)
            xs = np.log([p[0] for p in CONV])
            at = [float(np.exp(np.interp(x, xs, np.log([p[c] for p in CONV])))) for c in (1, 2, 3)]
            forward, backward, factor = forward + at[0], backward + at[1], factor + at[2]
        else:
            f, b = fits[kind].seconds(batch * flops, batch * elements)
            forward, backward = forward + f, backward + b
    for layer in SHAPE.layers:
        if layer.rows == 1:  # a linear layer
            rated = batch * layer.factor_flops / machine.gemm_flops_per_s
            factor += rated + 2 * machine.kernel_overhead_s
    compute = RatedCompute(machine, SHAPE)
    assert compute.forward_backward_s(batch) == pytest.approx((forward, backward), rel=1e-9)
    with_hooks = compute.forward_backward_s(batch, kfac=True)
    assert with_hooks == pytest.approx((forward, backward + factor), rel=1e-9)


def test_without_fits_the_model_is_the_layer_rates_and_traffic() -> None:
    machine = MachineProfile("cpu", 1e10, 1e9, 1e10, 1e10, kernel_overhead_s=1e-5)
    batch = 8
    traffic = batch * SHAPE.activations_per_sample * 8 / 1e10
    layers = sum(batch * flops / 1e10 + 1e-5 for kind, flops, _ in BY_HAND if flops)
    got = RatedCompute(machine, SHAPE).forward_backward_s(batch)
    assert got == pytest.approx((traffic + layers, 2 * traffic + 2 * layers), rel=1e-12)


def test_the_fit_recovers_known_coefficients() -> None:
    truth = ModuleFit((2e-5, 3e-11, 4e-9), (0.0, 6e-11, 1e-8))
    points = [
        (flops, elements, *truth.seconds(flops, elements))
        for flops, elements in ((1e5, 1e3), (1e7, 5e4), (3e8, 2e4), (1e9, 1e6), (2e6, 4e5))
    ]
    fit = fit_module(points)
    assert np.allclose(fit.row(), truth.row(), rtol=1e-6, atol=1e-15)


def _relative_nnls(points: list[tuple[float, float, float, float]], column: int) -> np.ndarray:
    data = np.array(points)
    features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    return nnls(features / data[:, column : column + 1], np.ones(len(data)))[0]


@pytest.mark.parametrize("kind", ["conv", "activation"])
def test_a_calibrate_fit_is_the_least_relative_error_on_its_measured_points(kind: str) -> None:
    """Real modules timed on this CPU (the small CNN's own among them); the fit's relative
    residuals are scipy's non-negative least squares optimum on those same points."""
    net = build_network("small_cnn", "digits")
    own = [s for k, s in rates.model_samples(net, INPUTS["digits"][0], (16,)) if k == kind]
    assert own  # the model has modules of this kind
    points = rates.module_points([*rates.MODULE_SAMPLES[kind][:3], *own], torch.device("cpu"))
    fit = fit_module(points)
    data = np.array(points)
    for column, coefficients in ((2, fit.forward), (3, fit.backward)):
        assert min(coefficients) >= 0
        oracle = _relative_nnls(points, column)
        features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        mine = np.sum((features @ np.array(coefficients) / data[:, column] - 1) ** 2)
        best = np.sum((features @ oracle / data[:, column] - 1) ** 2)
        assert mine == pytest.approx(best, rel=1e-6, abs=1e-12)


def test_the_profile_table_round_trips(tmp_path: Path) -> None:
    rows = {kind: fit.row() for kind, fit in FITS.items()}
    text = profile_text(
        "cpu",
        {"eigh_curve": [[64, 1e-3], [512, 4e-3]], "gemm": 2e10, "copy": 5e9, "modules": rows},
        8e9,
        2,
        "gloo",
        AlphaBeta(1e-5, 1e-9),
        None,
        2,
        model="small_cnn",
    )
    path = tmp_path / "site.toml"
    path.write_text(text)
    machine, _ = load_profile(str(path))
    assert dict(machine.modules) == FITS  # 6 digits hold them
    assert machine.module_fit("batchnorm") is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("conv", "[1e-5, 0, 0, 1e-5, 0]"),  # 5 numbers
        ("conv", "[1e-5, 0, 0, 1e-5, 0, -1e-9]"),  # negative
        ("softmax", "[1e-5, 0, 0, 1e-5, 0, 0]"),  # not a kind
    ],
)
def test_a_bad_module_fit_is_one_line_naming_it_exit_2(
    tmp_path: Path, key: str, value: str
) -> None:
    path = write_profile(tmp_path / "p.toml", {"machine": {"modules": f"{{{key} = {value}}}"}})
    with pytest.raises(PlanInputError, match=rf"machine\.modules\.{key}"):
        load_profile(str(path))
    result = CliRunner().invoke(main, ["plan", "--hardware", str(path), "--ranks", "1,2"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"machine.modules.{key}" in lines[0]


@pytest.mark.parametrize("name", ["v100-edr", "a100-hdr200", "a100-hdr200-4gpu", "h100-ndr400"])
def test_shipped_profiles_have_no_module_fits(name: str) -> None:
    """The published-hardware profiles keep the layer rates (no GPU measured here)."""
    assert load_profile(name)[0].modules == ()
    assert set(FITS) <= set(MODULE_KINDS)
