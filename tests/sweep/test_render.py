"""Rendered sbatch scripts: golden files per launcher, bash -n, and the script's own logic
(signal forwarding, requeue on exit 75, exact argv) executed with stub Slurm commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from kfac_hpc.sweep.prepare import plan_arrays
from kfac_hpc.sweep.profile import load_profile
from kfac_hpc.sweep.render import load_template, render_array
from kfac_hpc.sweep.spec import expand_points
from tests.helpers.sweeps import GOLDEN, spec
from tests.helpers.waiting import wait_until

LAUNCHERS = ("srun", "mpiexec", "mpirun")


def _render(launcher: str, **fields) -> str:
    s = spec(
        name="golden",
        nodes="2",
        ranks_per_node=4,
        cpus_per_task=8,
        steps=100,
        optimizer="sgd,adam",
        kfac="true,false",
        grad_worker_fraction="0.5",
        profile=str(GOLDEN / f"{launcher}.toml"),
        **fields,
    )
    profile = load_profile(s.profile)
    [(name, points)] = plan_arrays(expand_points(s), s.nodes, 1000)
    return render_array(load_template(), s, profile, name, points).text


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_rendered_script_matches_golden_file(launcher):
    text = _render(launcher)
    golden = GOLDEN / f"{launcher}.sbatch"
    if os.environ.get("KFAC_HPC_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), (
        "rendering changed; review and rerun with KFAC_HPC_UPDATE_GOLDEN=1"
    )


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_rendered_script_passes_bash_syntax_check(launcher, tmp_path):
    script = tmp_path / "s.sbatch"
    script.write_text(_render(launcher))
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def test_script_has_the_conventions_users_expect():
    text = _render("srun")
    for line in (
        "#SBATCH --output=logs/%x_%A_%a.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR2@120",
        "#SBATCH --requeue",
        "#SBATCH --gpus-per-node=4",
        'export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"',
        'scontrol requeue "$SLURM_JOB_ID"',
    ):
        assert line in text


# --- executing the script with stub Slurm commands --------------------------------------

_STUB_LAUNCHER = """#!/bin/bash
python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" > "$STUB_DIR/argv.json"
env > "$STUB_DIR/env.txt"
trap 'echo usr2 >> "$STUB_DIR/signals"; exit 75' USR2
: > "$STUB_DIR/started"
if [ -n "${STUB_EXIT:-}" ]; then exit "$STUB_EXIT"; fi
for _ in $(seq 600); do sleep 0.05; done
exit 0
"""
_STUB_SCONTROL = """#!/bin/bash
echo "$*" >> "$STUB_DIR/scontrol.log"
case "$1 $2" in
  "show hostnames") echo n1 ;;
  "show node") echo "NodeName=n1 NodeAddr=127.0.0.1 NodeHostName=localhost" ;;
esac
"""


def _stub_env(tmp_path: Path, launcher: str, **extra: str) -> dict[str, str]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / launcher).write_text(_STUB_LAUNCHER)
    (stubs / "scontrol").write_text(_STUB_SCONTROL)
    for f in stubs.iterdir():
        f.chmod(0o755)
    return {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "STUB_DIR": str(tmp_path),
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_JOB_ID": "4321",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NTASKS": "8",
        "SLURM_CPUS_PER_TASK": "8",
        "HOME": str(tmp_path),
        **extra,
    }


def _run(script: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a rendered script as sbatch would, in ``cwd`` (its relative run and log paths land
    there, never in the checkout)."""
    return subprocess.run(
        ["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _script_without_setup(tmp_path: Path, launcher: str, **fields) -> Path:
    text = _render(launcher, **fields).replace("module load", ": module load")
    text = text.replace('source "$HOME/venv/bin/activate"', ": no venv")
    script = tmp_path / "s.sbatch"
    script.write_text(text)
    return script


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_script_runs_the_point_with_its_exact_argv(launcher, tmp_path):
    script = _script_without_setup(tmp_path, launcher)
    env = _stub_env(tmp_path, launcher, STUB_EXIT="0")
    out = _run(script, env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    tail = argv[argv.index("kfac-hpc") :]
    assert tail[:3] == ["kfac-hpc", "train", "--run-dir"]
    assert tail[3].startswith("runs/") and "--optimizer" in tail and "--kfac" in tail
    child_env = dict(
        line.split("=", 1)
        for line in (tmp_path / "env.txt").read_text().splitlines()
        if "=" in line
    )
    assert child_env["OMP_NUM_THREADS"] == "8"
    assert child_env["MASTER_ADDR"] == "127.0.0.1"  # n1 is unknown to DNS: its NodeAddr
    assert child_env["MASTER_PORT"] == str(20000 + 4321 % 40000)


def test_exit_75_requeues_the_task(tmp_path):
    script = _script_without_setup(tmp_path, "srun")
    env = _stub_env(tmp_path, "srun", STUB_EXIT="75")
    out = _run(script, env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "requeue 4321" in (tmp_path / "scontrol.log").read_text()


def test_other_exit_codes_pass_through_without_requeue(tmp_path):
    script = _script_without_setup(tmp_path, "srun")
    env = _stub_env(tmp_path, "srun", STUB_EXIT="1")
    out = _run(script, env, cwd=tmp_path)
    assert out.returncode == 1
    assert "requeue" not in (tmp_path / "scontrol.log").read_text()


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("code", ["1", "137"])
def test_a_failing_launcher_without_an_end_marker_leaves_an_error_marker(launcher, code, tmp_path):
    script = _script_without_setup(tmp_path, launcher)
    work = tmp_path / "work"
    work.mkdir()
    env = _stub_env(tmp_path, launcher, STUB_EXIT=code)
    out = subprocess.run(
        ["bash", str(script)], env=env, cwd=work, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == int(code)
    (run_dir,) = (work / "runs").iterdir()
    message = (run_dir / "error").read_text()
    assert f"the launcher exited with status {code} without an end marker" in message
    assert sorted(p.name for p in run_dir.iterdir()) == ["error"]


@pytest.mark.parametrize("marker", ["error", "done"])
def test_a_failing_launcher_keeps_the_jobs_own_end_marker(marker, tmp_path):
    script = _script_without_setup(tmp_path, "srun")
    work = tmp_path / "work"
    script_text = script.read_text()
    run_dir = work / script_text.split("run_dir=", 1)[1].split(";", 1)[0].strip("'")
    run_dir.mkdir(parents=True)
    (run_dir / marker).write_text("the job's own message\n")
    env = _stub_env(tmp_path, "srun", STUB_EXIT="1")
    out = subprocess.run(
        ["bash", str(script)], env=env, cwd=work, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1
    assert (run_dir / marker).read_text() == "the job's own message\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [marker]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_usr2_to_the_batch_shell_reaches_the_launcher_and_requeues(launcher, tmp_path):
    script = _script_without_setup(tmp_path, launcher)
    env = _stub_env(tmp_path, launcher)
    proc = subprocess.Popen(
        ["bash", str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until((tmp_path / "started").exists, "the stub launcher's start", timeout_s=120)
        proc.send_signal(signal.SIGUSR2)  # what Slurm's --signal=B:USR2 does
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (tmp_path / "signals").read_text().strip() == "usr2"
    assert "requeue 4321" in (tmp_path / "scontrol.log").read_text()
