"""The real thing on the local Slurm cluster: a 1,2,4-node × 2-repeat sweep of tiny digits
runs as three arrays; a point made to fail is the only one `resume` resubmits; `status`
reports every point; a preempted point checkpoints, is requeued, resumes and ends with the
same parameters as an uninterrupted twin."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.spec import expand_points, load_spec
from kfac_hpc.sweep.waiting import wait_for_sweep
from tests.conftest import clean_env
from tests.helpers.report_checks import assert_report_complete, run_report
from tests.helpers.sweeps import assert_scaling_report, cli

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SWEEP = [
    "--nodes",
    "1,2,4",
    "--repeats",
    "2",
    "--steps",
    "10",
    "--name",
    "t-sweep",
    "--kfac",
    "true",
    "--train-arg=--no-progress",
    "--time",
    "00:05:00",
    "--model",
    "mlp",
]


@pytest.fixture(scope="module")
def sweep_run(slurm_cluster, tmp_path_factory):
    """Submit the sweep with one point blocked (a file where its run dir goes), wait, resume,
    wait again; record what was observed at each stage."""
    sweep_dir = tmp_path_factory.mktemp("slurm") / "sweep"
    spec = load_spec(
        None,
        {
            "nodes": "1,2,4",
            "repeats": 2,
            "steps": 10,
            "name": "t-sweep",
            "kfac": "true",
            "extra_args": ["--no-progress"],
            "model": "mlp",
        },
    )
    blocked = next(
        p for p in expand_points(spec) if p.params["nodes"] == 2 and p.params["repeat"] == 0
    )
    (sweep_dir / "runs").mkdir(parents=True)
    (sweep_dir / "runs" / blocked.point_id).write_text("not a directory: makes this point fail\n")
    seen: dict = {"blocked": blocked.point_id, "dir": sweep_dir}
    out = cli("sweep", *SWEEP, "--sweep-dir", str(sweep_dir), env=slurm_cluster)
    assert out.returncode == 0, out.stderr
    squeue = subprocess.run(
        ["squeue", "-h", "-o", "%F %j"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(slurm_cluster),
    )
    seen["squeue"] = squeue.stdout
    seen["first"] = wait_for_sweep(sweep_dir, first_s=1.0, max_s=5.0, timeout_s=420)
    resumed = cli("resume", str(sweep_dir), env=slurm_cluster)
    assert resumed.returncode == 0, resumed.stderr
    seen["resume_stdout"] = resumed.stdout
    seen["final"] = wait_for_sweep(sweep_dir, first_s=1.0, max_s=5.0, timeout_s=300)
    seen["status"] = cli("status", str(sweep_dir), "--json", env=slurm_cluster)
    return seen


def test_one_array_per_node_count_appears_in_squeue(sweep_run):
    manifest = sweep_run["first"]
    ids = {a.submissions[0]["array_job_id"] for a in manifest.arrays}
    assert [a.nodes for a in manifest.arrays] == [1, 2, 4]
    queued = {line.split()[0]: line.split()[1] for line in sweep_run["squeue"].splitlines()}
    assert ids <= set(queued), sweep_run["squeue"]
    assert {queued[i] for i in ids} == {"t-sweep-n1-0", "t-sweep-n2-0", "t-sweep-n4-0"}


def test_the_blocked_point_fails_and_the_others_complete(sweep_run):
    states = {p.point_id: p.state for p in sweep_run["first"].points}
    assert states.pop(sweep_run["blocked"]) == "failed"
    assert set(states.values()) == {"done"} and len(states) == 5


def test_resume_resubmits_only_the_failed_point(sweep_run):
    assert sweep_run["resume_stdout"].strip() == f"resubmitted 1 point(s): {sweep_run['blocked']}"
    for point in sweep_run["final"].points:
        assert point.attempts == (2 if point.point_id == sweep_run["blocked"] else 1)
    [array] = [a for a in sweep_run["final"].arrays if a.nodes == 2]
    assert [s["indices"] for s in array.submissions] == [[0, 1], [0]]


def test_every_point_completes_with_a_complete_run_dir(sweep_run):
    sweep_dir: Path = sweep_run["dir"]
    manifest = read_manifest(sweep_dir)
    assert len(manifest.points) == 6 and {p.state for p in manifest.points} == {"done"}
    for point in manifest.points:
        run_dir = sweep_dir / point.run_dir
        for name in ("config.json", "metrics.jsonl", "run.json", "done"):
            assert (run_dir / name).exists(), f"{run_dir}/{name}"
        run = json.loads((run_dir / "run.json").read_text())
        assert run["state"] == "done" and run["steps"] == 10
        assert run["world_size"] == point.params["nodes"]  # 1 rank per node
        assert run["nodes"] == point.params["nodes"]
    assert (
        sweep_dir / "failed" / f"{sweep_run['blocked']}.1"
    ).is_file()  # the obstacle, moved aside


def test_the_sweep_is_collected_and_reported(sweep_run):
    reported = run_report(sweep_run["dir"])
    assert reported.returncode == 0, reported.stderr
    assert_report_complete(sweep_run["dir"])


def test_status_reports_every_point(sweep_run):
    out = sweep_run["status"]
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 6
    assert {r["state"] for r in rows} == {"done"}
    assert {r["progress"] for r in rows} == {"step 10/10"}


# --- preemption ------------------------------------------------------------------------------


def _latest_params(run_dir: Path) -> dict[str, np.ndarray]:
    name = (run_dir / "checkpoints" / "latest").read_text().strip()
    with h5py.File(run_dir / "checkpoints" / name, "r") as f:
        out: dict[str, np.ndarray] = {}
        f["model"].visititems(
            lambda k, v: out.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None
        )
    return out


def _status_of(sweep_dir: Path, point_id: str, env: dict[str, str]) -> dict:
    out = cli("status", str(sweep_dir), "--json", env=env)
    assert out.returncode == 0, out.stderr
    return next(r for r in map(json.loads, out.stdout.splitlines()) if r["point_id"] == point_id)


def _train_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written right now
            continue
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    return steps[-1] if steps else -1


def test_preempted_point_is_requeued_and_matches_an_uninterrupted_twin(slurm_cluster, tmp_path):
    """Two identical points (repeat 0 and 1) on 2 nodes; USR2 to repeat 0's batch shell
    (what Slurm does before a time limit) → checkpoint, exit 75, requeue, resume."""
    sweep_dir = tmp_path / "pre"
    out = cli(
        "sweep",
        "--nodes",
        "2",
        "--repeats",
        "2",
        "--steps",
        "200",
        "--name",
        "t-preempt",
        "--checkpoint-every",
        "100000",
        "--train-arg=--log-every=5",
        "--train-arg=--no-progress",
        "--sweep-dir",
        str(sweep_dir),
        env=slurm_cluster,
    )
    assert out.returncode == 0, out.stderr
    manifest = read_manifest(sweep_dir)
    victim, twin = sorted(manifest.points, key=lambda p: p.params["repeat"])
    env = clean_env(slurm_cluster)
    deadline = time.monotonic() + 300
    while _train_step(sweep_dir / victim.run_dir) < 10:
        assert time.monotonic() < deadline, "the victim never started training"
        assert not (sweep_dir / victim.run_dir / "done").exists(), (
            "finished before it could be preempted"
        )
        time.sleep(0.2)
    sig = subprocess.run(
        ["scancel", "--signal=USR2", "--batch", victim.job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sig.returncode == 0, sig.stderr
    # Slurm holds a requeued job ~2 min (its BeginTime) before it may start again; status says
    # `requeued` meanwhile. Make it eligible sooner so the test need not sit out that delay, but
    # not at once: slurmd rejects a start in the same second as the requeue ("Job credential
    # revoked"), which is what the delay protects against.
    while True:
        assert time.monotonic() < deadline, "the victim was never requeued"
        row = _status_of(sweep_dir, victim.point_id, slurm_cluster)
        if row["state"] == "requeued":
            break
        assert row["state"] in ("running", "preempted"), row
        time.sleep(0.5)
    update = subprocess.run(
        ["scontrol", "update", f"JobId={victim.job_id}", "StartTime=now+5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert update.returncode == 0, update.stderr
    final = wait_for_sweep(sweep_dir, first_s=1.0, max_s=5.0, timeout_s=400)
    assert {p.state for p in final.points} == {"done"}
    run = json.loads((sweep_dir / victim.run_dir / "run.json").read_text())
    assert run["restarts"] == 1 and [a["end"] for a in run["attempts"]] == ["preempted", "done"]
    assert 0 < run["attempts"][0]["end_step"] < 200
    twin_run = json.loads((sweep_dir / twin.run_dir / "run.json").read_text())
    assert twin_run["restarts"] == 0
    log = next((sweep_dir / "logs").glob(f"t-preempt-n2-0_*_{victim.array_index}.out")).read_text()
    assert "requeueing job" in log
    a, b = _latest_params(sweep_dir / victim.run_dir), _latest_params(sweep_dir / twin.run_dir)
    assert a.keys() == b.keys() and a
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-6, err_msg=key)
    # the collector sees the preempted point as one run with two segments
    reported = run_report(sweep_dir)
    assert reported.returncode == 0, reported.stderr
    assert_report_complete(sweep_dir, requeued={victim.point_id})


# --- cluster facts and cancel ------------------------------------------------------------------


def test_max_array_size_is_read_from_the_cluster(slurm_cluster):
    from kfac_hpc.sweep.slurm_commands import max_array_size

    conf = Path(os.environ["SLURM_CONF"]).read_text()
    assert f"MaxArraySize={max_array_size()}\n" in conf


def test_cancel_stops_every_array_and_marks_the_points(slurm_cluster, tmp_path):
    sweep_dir = tmp_path / "cancel"
    out = cli(
        "sweep",
        "--nodes",
        "1,4",
        "--steps",
        "100000",
        "--name",
        "t-cancel",
        "--sweep-dir",
        str(sweep_dir),
        env=slurm_cluster,
    )
    assert out.returncode == 0, out.stderr
    ids = {a.submissions[0]["array_job_id"] for a in read_manifest(sweep_dir).arrays}
    cancelled = cli("cancel", str(sweep_dir), env=slurm_cluster)
    assert cancelled.returncode == 0 and "cancelled 2 point(s)" in cancelled.stdout, (
        cancelled.stderr
    )
    env = clean_env(slurm_cluster)
    deadline = time.monotonic() + 60
    while True:
        queued = subprocess.run(
            ["squeue", "-h", "-o", "%F"], capture_output=True, text=True, timeout=30, env=env
        )
        if not ids & set(queued.stdout.split()):
            break
        assert time.monotonic() < deadline, queued.stdout
        time.sleep(0.5)
    status = cli("status", str(sweep_dir), "--json", env=slurm_cluster)
    assert {json.loads(line)["state"] for line in status.stdout.splitlines()} == {"cancelled"}


def test_wait_runs_the_workflow_to_the_report_with_the_mpiexec_profile(slurm_cluster, tmp_path):
    """`--wait`: the Parsl DAG submits, waits and reports; the point runs 2 ranks on 2 nodes
    under Hydra's mpiexec inside the allocation (the srun profile runs in the tests above)."""
    sweep_dir = tmp_path / "wait"
    args = ["--nodes", "2", "--steps", "10", "--name", "t-wait", "--profile", "mpiexec"]
    args += ["--model", "mlp"]
    args += ["--train-arg=--no-progress", "--sweep-dir", str(sweep_dir), "--wait"]
    out = cli("sweep", *args, env=slurm_cluster, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    [point] = read_manifest(sweep_dir).points
    assert point.state == "done" and point.array_job_id is not None
    run = json.loads((sweep_dir / point.run_dir / "run.json").read_text())
    assert run["world_size"] == 2 and run["nodes"] == 2
    assert "mpiexec -n" in (sweep_dir / "scripts" / "n2-0.sbatch").read_text()
    # The last stage printed the collector's scaling table (matplotlib is in the test venv).
    assert_scaling_report(out, sweep_dir, {2})
    # and the progress line, one per change (stderr is not a terminal here)
    assert "sweep: 1/1 done, 0 running, 0 pending, 0 failed" in out.stderr, out.stderr
