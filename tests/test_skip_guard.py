"""The must-not-skip guard: under `make test`/CI a missing test dependency fails the test."""

from __future__ import annotations

import pytest

from tests.conftest import require_module


def test_missing_dependency_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="make venv"):
        require_module("no_such_module_of_kfac_hpc")


def test_missing_dependency_skips_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KFAC_HPC_REQUIRE_SLURM", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_module("no_such_module_of_kfac_hpc")


@pytest.mark.parametrize("name", ["curvlinops", "sklearn.datasets", "pyarrow.parquet"])
def test_venv_dependencies_import(name):
    assert require_module(name) is not None
