"""A rank killed with SIGKILL under plain mpiexec (issue 14): the launcher ends its peers before
any writes an end marker. The local backend, `status` and the collector call the point failed,
with the launcher's exit status, and the collector's report still has its row."""

from __future__ import annotations

import json
import sys

import pytest

from kfac_hpc.analysis.collect import collect
from kfac_hpc.analysis.output import build_tables
from kfac_hpc.contracts.rundir import read_markers
from kfac_hpc.sweep.manifest import read_manifest
from tests.helpers.sweeps import cli

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

# Rank 1 runs the job until rank 0 has written its first metrics window, then kills rank 0
# (its pid in $PIDFILE) and itself with SIGKILL, as a node failure would: no rank is left to
# write an end marker (the job's argv: --run-dir DIR ...).
_KILL_RANKS = (
    'rank="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-0}}"; py="$0"; '
    'if [ "$rank" = 0 ]; then echo $$ > "$PIDFILE"; exec "$py" -u -m kfac_hpc train "$@"; fi; '
    '"$py" -u -m kfac_hpc train "$@" & child=$!; '
    'while [ ! -s "$2/metrics.jsonl" ]; do sleep 0.1; done; '
    'kill -9 "$(cat "$PIDFILE")" "$child"; kill -9 $$'
)


def test_a_killed_rank_is_a_failed_point_with_its_exit_status(tmp_path):
    profile = tmp_path / "kill.toml"
    command = json.dumps(["bash", "-c", _KILL_RANKS, sys.executable])
    pidfile = json.dumps(str(tmp_path / "rank0.pid"))
    profile.write_text(f"train_command = {command}\n[env]\nPIDFILE = {pidfile}\n")
    sweep_dir = tmp_path / "sw"
    args = ["--backend", "local", "--nodes", "1", "--ranks-per-node", "2", "--steps", "2000"]
    args += ["--model", "mlp", "--profile", str(profile), "--sweep-dir", str(sweep_dir)]
    out = cli("sweep", *args, "--train-arg=--no-progress", timeout=400)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "1 point(s) did not finish" in out.stderr
    assert "Traceback" not in out.stderr
    [point] = read_manifest(sweep_dir).points
    run_dir = sweep_dir / point.run_dir
    markers = read_markers(run_dir)
    assert markers.done is None and markers.error is None  # no end marker was written
    assert (run_dir / "metrics.jsonl").stat().st_size > 0 and not (run_dir / "run.json").exists()
    assert point.state == "failed" and point.detail.startswith("exit code "), point.detail
    assert int(point.detail.split()[2].rstrip(";")) != 0

    status = cli("status", str(sweep_dir), "--json")
    assert status.returncode == 0, status.stderr
    [row] = [json.loads(line) for line in status.stdout.splitlines()]
    assert row["state"] == "failed" and row["detail"] == point.detail

    [table_row] = build_tables(collect(sweep_dir)).runs
    assert table_row["state"] == "failed"
    assert point.detail in table_row["reason"], table_row["reason"]


@pytest.mark.slurm
def test_under_slurm_the_sbatch_script_writes_the_missing_error_marker(slurm_cluster, tmp_path):
    """The same kill inside a Slurm array task: the batch script sees the launcher fail with no
    end marker and writes one with the exit status; `status` and the collector show it."""
    command = json.dumps(["bash", "-c", _KILL_RANKS, sys.executable])
    pidfile = json.dumps(str(tmp_path / "rank0.pid"))
    profile = tmp_path / "kill.toml"
    profile.write_text(
        f'time = "00:05:00"\nlauncher = "mpiexec"\nsignal_seconds = 30\n'
        f"train_command = {command}\n[env]\nPIDFILE = {pidfile}\n"
    )
    sweep_dir = tmp_path / "sw"
    args = ["--nodes", "1", "--ranks-per-node", "2", "--steps", "2000", "--model", "mlp"]
    args += ["--profile", str(profile), "--sweep-dir", str(sweep_dir), "--name", "t-kill"]
    out = cli("sweep", *args, "--train-arg=--no-progress", "--wait", env=slurm_cluster, timeout=400)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "1 point(s) did not finish" in out.stderr and "Traceback" not in out.stderr
    [point] = read_manifest(sweep_dir).points
    run_dir = sweep_dir / point.run_dir
    assert (run_dir / "metrics.jsonl").stat().st_size > 0 and not (run_dir / "run.json").exists()
    error = read_markers(run_dir).error
    assert error is not None and error.startswith("the launcher exited with status "), error
    assert point.state == "failed" and point.detail == error

    status = cli("status", str(sweep_dir), "--json", env=slurm_cluster)
    [row] = [json.loads(line) for line in status.stdout.splitlines()]
    assert row["state"] == "failed" and row["detail"] == error
    [table_row] = build_tables(collect(sweep_dir)).runs
    assert table_row["state"] == "failed" and error in table_row["reason"]
