"""The wheel ships everything an installed `kfac-hpc` needs at run time (any directory)."""

from __future__ import annotations

import zipfile
from pathlib import Path

from tests.conftest import REPO

SUBPACKAGES = (
    "contracts",
    "runtime",
    "comm",
    "optim",
    "checkpoint",
    "train",
    "sweep",
    "analysis",
    "workflows",
    "site_profiles",
)


def test_wheel_holds_every_subpackage_and_the_templates(project_wheel: Path) -> None:
    wheel = project_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for sub in SUBPACKAGES:
        assert f"kfac_hpc/{sub}/__init__.py" in names, f"kfac_hpc.{sub} missing from the wheel"
    for init in (REPO / "kfac_hpc").rglob("__init__.py"):
        name = init.relative_to(REPO).as_posix()
        assert name in names, f"{name} missing from the wheel (setup.cfg packages)"
    assert "kfac_hpc/data/digits.npz" in names
    assert any(n.startswith("kfac_hpc/templates/") and n.endswith(".j2") for n in names)
    for profile in ("local", "mpiexec", "mpirun"):
        assert f"kfac_hpc/site_profiles/{profile}.toml" in names
    assert not any(n.startswith("kfac_hpc/templates/") and n.endswith(".toml") for n in names)
    assert "kfac_hpc/plan/profiles/a100-hdr200.toml" in names  # kfac-hpc plan --hardware
    assert "kfac_hpc/py.typed" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
