"""The hardware profile's topology and compute keys: choices, the eigendecomposition curve, the
shipped profiles, and plan's old flag for it (--profile, the sweep's word) refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.plan.errors import PlanInputError
from kfac_hpc.plan.profiles import builtin_profiles, load_profile
from tests.plan.test_cli_input import write_profile


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("network", "backend", '"mpi"'),
        ("network", "allreduce", '"butterfly"'),
        ("network.intra", "kind", '"carrier-pigeon"'),
    ],
)
def test_a_bad_choice_names_the_key_and_the_choices(tmp_path: Path, section, key, value) -> None:
    path = write_profile(tmp_path / "p.toml", {section: {key: value}})
    with pytest.raises(PlanInputError) as info:
        load_profile(str(path))
    assert f"{section}.{key}" in str(info.value) and "must be one of" in str(info.value)


def test_choices_and_nics_are_read(tmp_path: Path) -> None:
    path = write_profile(
        tmp_path / "p.toml",
        {
            "network": {"backend": '"gloo"', "allreduce": '"hierarchical"', "nics_per_node": "2"},
            "network.intra": {"kind": '"pcie"'},
        },
    )
    _, net = load_profile(str(path))
    assert (net.backend, net.allreduce, net.nics_per_node, net.intra_link) == (
        "gloo",
        "hierarchical",
        2,
        "pcie",
    )


def test_nics_default_to_one_per_rank(tmp_path: Path) -> None:
    _, net = load_profile(str(write_profile(tmp_path / "p.toml")))
    assert net.nics == net.ranks_per_node


def test_eigh_curve_interpolates_log_log_and_extends_its_end_segments(tmp_path: Path) -> None:
    curve = "[[100, 0.001], [1000, 0.01], [2000, 0.08]]"
    path = write_profile(tmp_path / "p.toml", {"machine": {"eigh_curve": curve}})
    machine, _ = load_profile(str(path))
    assert machine.eigh_s(100) == pytest.approx(0.001)
    assert machine.eigh_s(2000) == pytest.approx(0.08)
    # between 100 and 1000 the time grows as n^1: 0.001 * (316.2/100)
    assert machine.eigh_s(round(10**2.5)) == pytest.approx(0.001 * round(10**2.5) / 100)
    # beyond 2000 the last segment's power (3) continues
    assert machine.eigh_s(4000) == pytest.approx(0.08 * 8)
    assert machine.eigh_s(50) == pytest.approx(0.0005)


@pytest.mark.parametrize(
    "curve",
    ["[[100, 0.001]]", "[[100, 0.001], [50, 0.01]]", "[[100, 0]]", '[[100, "x"], [200, 1]]', "3"],
)
def test_a_bad_eigh_curve_is_refused(tmp_path: Path, curve: str) -> None:
    path = write_profile(tmp_path / "p.toml", {"machine": {"eigh_curve": curve}})
    with pytest.raises(PlanInputError, match=r"machine\.eigh_curve"):
        load_profile(str(path))


@pytest.mark.parametrize("name", builtin_profiles())
def test_every_shipped_profile_loads_and_names_its_sources(name: str) -> None:
    machine, net = load_profile(name)
    assert math.isfinite(machine.eigh_s(4608)) and net.nics >= 1
    text = (Path(__file__).parents[2] / "kfac_hpc/plan/profiles" / f"{name}.toml").read_text()
    assert "[sources]" in text and "Published figures used" in text


def test_the_old_flag_is_refused_in_one_line_naming_the_new_one() -> None:
    result = CliRunner().invoke(main, ["plan", "--profile", "a100-hdr200", "--ranks", "1,2"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--profile" in lines[0] and "--hardware" in lines[0]
