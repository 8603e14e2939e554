"""Past four nodes, on the real local cluster (tools/run-tests.sh starts it with
``--nodes 16 --max-array-size 9``): the literal ``kfac-hpc sweep --nodes 1,2,4,16`` runs to
its report with its 16-node point preempted once; a sweep larger than MaxArraySize is split
into arrays Slurm accepts; a node count no partition can hold is refused before submission."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from kfac_hpc.sweep.manifest import read_manifest
from kfac_hpc.sweep.slurm_commands import max_array_size
from kfac_hpc.sweep.waiting import wait_for_sweep
from kfac_hpc.train.faults import ENV as FAULT_ENV
from tests.conftest import clean_env
from tests.helpers.report_checks import assert_report_complete, run_report
from tests.helpers.sweeps import cli
from tests.helpers.waiting import wait_until
from tests.sweep.test_slurm_sweep import _status_of, _train_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _slurm(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), env=clean_env(env), capture_output=True, text=True, timeout=60
    )


def _cluster_nodes(env: dict[str, str]) -> int:
    out = _slurm("sinfo", "-h", "-o", "%D", env=env)
    return sum(int(n) for n in out.stdout.split())


def _require(condition: bool, why: str) -> None:
    """The cluster shape these tests need; under `make test`/CI a wrong shape fails."""
    if condition:
        return
    if os.environ.get("KFAC_HPC_REQUIRE_SLURM") == "1" or os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


def _wait_queue_empty(ids: set[str], env: dict[str, str]) -> None:
    def queued() -> set[str]:
        return ids & set(_slurm("squeue", "-h", "-o", "%F", env=env).stdout.split())

    wait_until(lambda: not queued(), "the cancelled jobs leaving the queue", detail=queued)


def test_sweep_1_2_4_16_runs_through_preemption_status_and_report(slurm_cluster, tmp_path):
    _require(
        _cluster_nodes(slurm_cluster) >= 16,
        "needs 16 nodes: bash slurm/cluster.sh start --nodes 16",
    )
    sweep_dir = tmp_path / "s16"
    # Rank 0 of the 16-node point holds before step 12 until the USR2 below reaches it: it is
    # certainly still training when preempted, however fast or slow the machine is.
    hold = {FAULT_ENV: "rank=0,step=12,hold=preempt,world=16"}
    out = cli(
        "sweep",
        "--nodes",
        "1,2,4,16",
        "--steps",
        "120",
        "--name",
        "t-16",
        "--checkpoint-every",
        "100000",
        "--train-arg=--log-every=5",
        "--train-arg=--no-progress",
        "--sweep-dir",
        str(sweep_dir),
        env={**slurm_cluster, **hold},
    )
    assert out.returncode == 0, out.stderr
    manifest = read_manifest(sweep_dir)
    assert [a.nodes for a in manifest.arrays] == [1, 2, 4, 16]
    victim = next(p for p in manifest.points if p.params["nodes"] == 16)
    # The 16-node point starts once the smaller ones have left the nodes; USR2 to its batch
    # shell makes all 16 ranks agree on a step, checkpoint and exit for a requeue.
    deadline = time.monotonic() + 600
    while _train_step(sweep_dir / victim.run_dir) < 10:
        assert time.monotonic() < deadline, "the 16-node point never started training"
        assert not (sweep_dir / victim.run_dir / "done").exists(), "finished before preemption"
        time.sleep(0.2)
    sig = _slurm("scancel", "--signal=USR2", "--batch", str(victim.job_id), env=slurm_cluster)
    assert sig.returncode == 0, sig.stderr
    while (row := _status_of(sweep_dir, victim.point_id, slurm_cluster))["state"] != "requeued":
        assert time.monotonic() < deadline, "the 16-node point was never requeued"
        assert row["state"] in ("running", "preempted"), row
        time.sleep(0.5)
    # Skip most of Slurm's ~2 min requeue hold, not the first seconds (see test_slurm_sweep).
    update = _slurm(
        "scontrol", "update", f"JobId={victim.job_id}", "StartTime=now+5", env=slurm_cluster
    )
    assert update.returncode == 0, update.stderr

    final = wait_for_sweep(sweep_dir, first_s=1.0, max_s=5.0, timeout_s=600)
    assert {p.state for p in final.points} == {"done"}
    for point in final.points:
        run = json.loads((sweep_dir / point.run_dir / "run.json").read_text())
        assert run["world_size"] == run["nodes"] == point.params["nodes"]
        assert run["state"] == "done" and run["steps"] == 120
    run16 = json.loads((sweep_dir / victim.run_dir / "run.json").read_text())
    assert [a["end"] for a in run16["attempts"]] == ["preempted", "done"]
    assert 0 < run16["attempts"][0]["end_step"] < 120

    status = cli("status", str(sweep_dir), "--json", env=slurm_cluster)
    assert status.returncode == 0, status.stderr
    rows = [json.loads(line) for line in status.stdout.splitlines()]
    assert sorted(r["nodes"] for r in rows) == [1, 2, 4, 16]
    assert {r["state"] for r in rows} == {"done"}
    assert {r["progress"] for r in rows} == {"step 120/120"}

    reported = run_report(sweep_dir)
    assert reported.returncode == 0, reported.stderr
    assert_report_complete(sweep_dir, requeued={victim.point_id})


def test_a_sweep_larger_than_max_array_size_is_split_into_accepted_arrays(slurm_cluster, tmp_path):
    limit = max_array_size()
    _require(limit <= 64, "needs a small MaxArraySize: slurm/cluster.sh start --max-array-size 9")
    points = 2 * (limit - 1) + 1  # two full arrays and one task more
    sweep_dir = tmp_path / "split"
    args = ["--nodes", "1", "--repeats", str(points), "--steps", "5", "--name", "t-split"]
    out = cli(
        "sweep", *args, "--sbatch-arg=--hold", "--sweep-dir", str(sweep_dir), env=slurm_cluster
    )
    assert out.returncode == 0, out.stderr
    manifest = read_manifest(sweep_dir)
    try:
        assert [(a.name, a.size) for a in manifest.arrays] == [
            ("n1-0", limit - 1),
            ("n1-1", limit - 1),
            ("n1-2", 1),
        ]
        assert len({p.point_id for p in manifest.points}) == points
        queued = _slurm("squeue", "-h", "-r", "-o", "%F %K", env=slurm_cluster).stdout.split("\n")
        for array in manifest.arrays:
            job = array.submissions[0]["array_job_id"]
            tasks = sorted(int(line.split()[1]) for line in queued if line.startswith(f"{job} "))
            assert tasks == list(range(array.size)), (array.name, queued)
        # Without the split Slurm refuses the sweep: its indices would reach MaxArraySize.
        whole = _slurm(
            "sbatch",
            "--test-only",
            f"--array=0-{points - 1}",
            str(sweep_dir / manifest.arrays[0].script),
            env=slurm_cluster,
        )
        assert whole.returncode != 0
    finally:
        cancelled = cli("cancel", str(sweep_dir), env=slurm_cluster)
        assert cancelled.returncode == 0, cancelled.stderr
        _wait_queue_empty(
            {a.submissions[0]["array_job_id"] for a in manifest.arrays}, slurm_cluster
        )


def test_a_node_count_no_partition_holds_is_refused_before_submission(slurm_cluster, tmp_path):
    total = _cluster_nodes(slurm_cluster)
    before = _slurm("squeue", "-h", "-o", "%i", env=slurm_cluster).stdout.split()
    sweep_dir = tmp_path / "too-big"
    out = cli(
        "sweep",
        "--nodes",
        f"1,{total + 1}",
        "--steps",
        "5",
        "--scaling",  # a global batch of 128 splits over no odd node count: the job refuses it
        "weak",
        "--sweep-dir",
        str(sweep_dir),
        env=slurm_cluster,
    )
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert f"{total + 1} node(s) do not fit partition debug" in line
    assert f"at most {total} node(s)" in line
    assert not sweep_dir.exists()
    after = _slurm("squeue", "-h", "-o", "%i", env=slurm_cluster).stdout.split()
    assert set(after) <= set(before)
