"""The parsl-slurm pilot backend on the real local Slurm cluster: one allocation runs every
point of a sweep; a point preempted on purpose (USR2 to the pilot's steps) ends ``preempted``,
``resume`` continues it in a new allocation, and ``status``, the run directories and
``report`` are the array backend's."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kfac_hpc.contracts.records import validate_run_dir
from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.train.faults import ENV as FAULT_ENV
from kfac_hpc.workflows.pilot import pilot_nodes, pilot_walltime_s, slurm_seconds
from tests.conftest import clean_env
from tests.helpers.report_checks import assert_report_complete, run_report
from tests.helpers.sweeps import cli
from tests.helpers.waiting import bound_s
from tests.sweep.test_slurm_sweep import _train_step


def test_pilot_shape_packs_by_node_count():
    # Room for one largest point by default; max_concurrent of them; capped by the partition.
    assert pilot_nodes([1, 1, 2, 2], None, 16) == 2
    assert pilot_nodes([1, 2, 4] * 4, 4, 16) == 16
    assert pilot_nodes([1, 2, 4] * 4, 4, 8) == 8
    assert pilot_nodes([1, 1], 8, None) == 2  # never more than all points need
    # Two 1-node points share a 2-node pilot, then each 2-node point: 3 rounds; the bound
    # (twice the node-seconds, at most one round per point) gives 4.
    assert pilot_walltime_s([1, 1, 2, 2], 2, 600) == 4 * 600
    assert pilot_walltime_s([1], 1, 600) == 600
    assert [slurm_seconds(t) for t in ("10", "01:30", "1:00:00", "1-2", "2-00:00:30")] == [
        600,
        90,
        3600,
        93600,
        172830,
    ]


def _squeue_ids(env: dict[str, str]) -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=30
    )
    return set(out.stdout.split())


@pytest.mark.slurm
@pytest.mark.slow
def test_pilot_sweep_one_allocation_preempt_resume_status_report(slurm_cluster, tmp_path):
    # The 2-node point's rank 0 holds before step 12 until the USR2 below reaches it: it is
    # certainly still training when preempted, however fast or slow the machine is.
    hold = {FAULT_ENV: "rank=0,step=12,hold=preempt,world=2"}
    env = clean_env({**slurm_cluster, "KFAC_HPC_PILOT_ADDRESS": "127.0.0.1", **hold})
    before = _squeue_ids(env)
    sweep_dir = tmp_path / "pilot"
    argv = [
        *("sweep", "--backend", "parsl-slurm", "--nodes", "1,2", "--max-concurrent", "2"),
        *("--model", "mlp", "--steps", "150", "--name", "t-pilot"),
        *("--checkpoint-every", "100000", "--train-arg=--log-every=5"),
        *("--train-arg=--no-progress", "--sweep-dir", str(sweep_dir)),
    ]
    sweep = subprocess.Popen(
        [sys.executable, "-m", "kfac_hpc", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: set[str] = set()
    victim = None
    deadline = time.monotonic() + bound_s(600)
    while sweep.poll() is None:
        assert time.monotonic() < deadline, f"the pilot sweep did not end in {bound_s(600):g} s"
        seen |= _squeue_ids(env) - before
        if victim is None and (sweep_dir / "manifest.json").exists():
            manifest = read_manifest(sweep_dir)
            two = next(p for p in manifest.points if p.params["nodes"] == 2)
            run_dir = sweep_dir / two.run_dir
            if _train_step(run_dir) >= 10 and not (run_dir / "done").exists():
                # USR2 to every job step of the pilot (not its batch shell): the running
                # points checkpoint and exit 75, as at the pilot's time limit.
                victim = two.point_id
                signal = subprocess.run(
                    ["scancel", "--signal=USR2", str(two.job_id)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert signal.returncode == 0, signal.stderr
        time.sleep(0.2)
    out, err = sweep.communicate()
    assert victim is not None, f"the 2-node point was never seen running: {out}{err}"
    manifest = read_manifest(sweep_dir)
    [job_id] = {p.job_id for p in manifest.points}
    assert seen == {job_id}, "both points ran in the one pilot allocation"
    states = {p.point_id: p.state for p in manifest.points}
    assert states[victim] == "preempted"
    assert set(states.values()) <= {"preempted", "done"}
    preempted = sorted(p for p, s in states.items() if s == "preempted")
    assert sweep.returncode == 1, err  # preempted points did not finish
    assert f"{len(preempted)} point(s) did not finish" in err

    resumed = cli("resume", str(sweep_dir), env=env, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resubmitted {len(preempted)} point(s): {' '.join(preempted)}" in resumed.stdout

    status = cli("status", str(sweep_dir), "--json", env=env)
    assert status.returncode == 0, status.stderr
    rows = [json.loads(line) for line in status.stdout.splitlines()]
    assert sorted(r["nodes"] for r in rows) == [1, 2] and {r["state"] for r in rows} == {"done"}
    assert {r["progress"] for r in rows} == {"step 150/150"}
    final = read_manifest(sweep_dir)
    again = next(p for p in final.points if p.point_id == victim)
    assert again.attempts == 2 and again.job_id != job_id  # resumed in a new pilot
    for point in final.points:
        run_dir = sweep_dir / point.run_dir
        assert validate_run_dir(run_dir) == []
        run = json.loads((run_dir / "run.json").read_text())
        assert run["world_size"] == run["nodes"] == point.params["nodes"]
    run = json.loads((sweep_dir / again.run_dir / "run.json").read_text())
    assert [a["end"] for a in run["attempts"]] == ["preempted", "done"]
    assert 0 < run["attempts"][0]["end_step"] < 150

    reported = run_report(sweep_dir)
    assert reported.returncode == 0, reported.stderr
    assert_report_complete(sweep_dir, requeued=set(preempted))


def test_a_profile_the_pilot_cannot_launch_is_refused(tmp_path):
    sweep_dir = tmp_path / "refused"
    out = cli(
        *("sweep", "--backend", "parsl-slurm", "--profile", "mpirun", "--nodes", "1"),
        *("--steps", "5", "--sweep-dir", str(sweep_dir)),
    )
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "error: profile: profile mpirun launches with mpirun" in line
    assert not (sweep_dir / "manifest.json").exists()
