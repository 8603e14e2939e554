"""The default install runs the default sweep (issue 14): the built wheel, installed with no
extras (torch first, as the README says) into a fresh venv, runs a local sweep on the default
dataset to its report from a directory outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN

TORCH = "torch==2.13.0"  # the pinned wheel of constraints.txt


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 900):
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv[:4]}: {result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_the_wheel_without_extras_runs_a_local_sweep_to_its_report(
    tmp_path: Path, project_wheel: Path
) -> None:
    system_path = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != VENV_BIN
    )
    assert shutil.which("mpiexec", path=system_path), "the local backend needs an mpiexec on PATH"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = system_path
    wheel = project_wheel
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(tmp_path / "venv")], tmp_path, env)
    # --no-compile: the modules a run imports are compiled when first imported, not the
    # thousands of torch's and parsl's that it never does
    pip = [str(tmp_path / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, TORCH], tmp_path, env)
    _run([*pip, str(wheel)], tmp_path, env)

    work = tmp_path / "elsewhere"
    work.mkdir()
    env["PATH"] = f"{tmp_path / 'venv' / 'bin'}{os.pathsep}{system_path}"
    # Open MPI refuses to start as root without these (a container's CI user); inert otherwise.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    kfac_hpc = str(tmp_path / "venv" / "bin" / "kfac-hpc")
    args = ["--nodes", "1,2", "--backend", "local", "--model", "mlp", "--steps", "30"]
    result = _run([kfac_hpc, "sweep", *args, "--kfac", "false,true"], work, env)

    python = str(tmp_path / "venv" / "bin" / "python")
    installed = subprocess.run(
        [python, "-c", "import kfac_hpc; print(kfac_hpc.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(tmp_path / "venv") in installed  # the wheel, not the checkout
    rows = [line.split() for line in result.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 4, result.stdout
    for row in rows:
        assert row[5] == "done", result.stdout
        assert 0.5 < float(row[7]) <= 1.0, result.stdout  # test accuracy on digits
    assert sorted(int(r[1]) for r in rows) == [1, 1, 2, 2]
    assert (work / "sweeps" / "sweep" / "manifest.json").is_file()
