"""The embedded default backend: the same sweep runs with local MPI ranks through Parsl,
with no Slurm command ever called; a point made to fail is the only one `resume` reruns."""

from __future__ import annotations

import json
import os

import pytest

from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.spec import expand_points
from tests.helpers.sweeps import assert_scaling_report, cli, spec

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

_TRAP = """#!/bin/bash
echo "$0 $*" >> "{log}"
exit 99
"""


def test_local_backend_runs_the_sweep_without_slurm_and_resumes_a_failed_point(tmp_path):
    trap_bin = tmp_path / "no-slurm"
    trap_bin.mkdir()
    calls = tmp_path / "slurm-calls.log"
    for name in ("sbatch", "srun", "squeue", "scontrol", "scancel", "sacct", "salloc"):
        (trap_bin / name).write_text(_TRAP.format(log=calls))
        (trap_bin / name).chmod(0o755)
    env = {
        "PATH": f"{trap_bin}:{os.environ['PATH']}",
        "SLURM_CONF": str(tmp_path / "none.conf"),
    }
    sweep_dir = tmp_path / "local"
    points = expand_points(
        spec(
            nodes="1,2",
            kfac="true",
            steps=10,
            name="loc",
            extra_args=["--no-progress"],
            model="mlp",
        )
    )
    blocked = next(p.point_id for p in points if p.params["nodes"] == 2)
    (sweep_dir / "runs").mkdir(parents=True)
    (sweep_dir / "runs" / blocked).write_text("a file where the run dir goes: this point fails\n")
    out = cli(
        "sweep",
        "--backend",
        "local",
        "--nodes",
        "1,2",
        "--kfac",
        "true",
        "--steps",
        "10",
        "--train-arg=--no-progress",
        "--name",
        "loc",
        "--model",
        "mlp",
        "--sweep-dir",
        str(sweep_dir),
        env=env,
        timeout=400,
    )
    assert out.returncode == 1 and "1 point(s) did not finish" in out.stderr, out.stderr[-3000:]
    first = {p.point_id: p.state for p in read_manifest(sweep_dir).points}
    assert first == {p.point_id: ("failed" if p.point_id == blocked else "done") for p in points}
    # The workflow's last stage: the collector's scaling table (the done point's node count).
    assert_scaling_report(out, sweep_dir, {1}, points=2)

    resumed = cli("resume", str(sweep_dir), env=env, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.strip() == f"resubmitted 1 point(s): {blocked}"
    assert not calls.exists(), calls.read_text()
    manifest = read_manifest(sweep_dir)
    assert manifest.backend == "local"
    assert {p.state for p in manifest.points} == {"done"} and len(manifest.points) == 2
    for point in manifest.points:
        run = json.loads((sweep_dir / point.run_dir / "run.json").read_text())
        assert run["state"] == "done" and run["steps"] == 10
        assert run["world_size"] == point.params["nodes"]  # nodes x 1 rank, all on this host
        assert run["nodes"] == point.params["nodes"]  # the nodes asked for, emulated here
        assert point.job_id == "local" and point.attempts == (2 if point.point_id == blocked else 1)
    status = cli("status", str(sweep_dir), env=env)
    assert status.returncode == 0 and "2 done" in status.stdout
