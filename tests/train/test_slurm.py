"""`srun -N 2 --mpi=pmi2 kfac-hpc train` inside an sbatch job on the local Slurm cluster."""

from __future__ import annotations

import subprocess

import pytest

from kfac_hpc.contracts import validate_run_dir
from kfac_hpc.train.faults import ENV

from .conftest import clean_env, read_json, train_cmd

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]


def _sbatch(tmp_path, run_dir, *args, env_line=""):
    script = tmp_path / "job.sh"
    out = tmp_path / "job.out"
    command = " ".join(train_cmd(run_dir, *args))
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=kfac-train-test\n"
        "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --time=5\n"
        f"#SBATCH --output={out}\n"
        "export OMP_NUM_THREADS=1\n"
        f"{env_line}\n"
        f"srun --mpi=pmi2 {command}\n"
    )
    proc = subprocess.run(
        ["sbatch", "--wait", str(script)],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = out.read_text() if out.exists() else ""
    return proc, f"sbatch: {proc.stdout} {proc.stderr}\njob output:\n{log[-4000:]}"


def test_srun_two_nodes_trains_and_records(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc, log = _sbatch(tmp_path, run_dir, "--epochs", "2")
    assert proc.returncode == 0, log
    assert validate_run_dir(run_dir) == [], log
    summary = read_json(run_dir / "run.json")
    assert (summary["world_size"], summary["nodes"], summary["ranks_per_node"]) == (2, 2, 1)
    assert summary["launcher"] == "slurm" and summary["state"] == "done"
    assert summary["final_accuracy"] > 0.8


def test_srun_rank_raising_ends_the_job_with_error(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc, log = _sbatch(
        tmp_path,
        run_dir,
        "--epochs",
        "2",
        "--collective-timeout-s",
        "60",
        env_line=f"export {ENV}=rank=1,step=4",
    )
    assert proc.returncode != 0, log
    assert "injected fault on rank 1 at step 4" in (run_dir / "error").read_text(), log
    assert read_json(run_dir / "run.json")["state"] == "error"
    assert not (run_dir / "done").exists()
