"""What only the scheduler can judge, asked before anything is written (allocations Slurm
can never grant, the parsl-slurm pilot, a Slurm that does not answer): one line naming the
field, exit 2 (exit 1 when Slurm itself fails), and nothing written or submitted; a dry run
without Slurm says it was not checked.

The first tests run in this process against stand-in Slurm commands; those marked ``slurm``
ask the real local cluster (slurm/cluster.sh: 16 nodes of 2 CPUs, no GPUs). (Bad input the
sweep judges alone: test_bad_input.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.sweep.spec import load_spec


def sweep(tmp_path: Path, *args: str, env: dict[str, str | None] | None = None):
    """`kfac-hpc sweep ARGS` in this process, into ``tmp_path/sw``."""
    argv = ["sweep", *args, "--sweep-dir", str(tmp_path / "sw")]
    return CliRunner().invoke(main, argv, env=env)


def assert_refused(result, text: str, sweep_dir: Path, code: int = 2) -> str:
    """Exit ``code``, one line on stderr holding ``text``, no sweep folder; the line."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not sweep_dir.exists(), sorted(p.name for p in sweep_dir.iterdir())
    return lines[0]


# Slurm that does not answer, and the pilot's environment, with stand-in commands.
def fake_slurm(tmp_path: Path, scontrol: str) -> dict[str, str | None]:
    """PATH with an ``sbatch`` that must not run and an ``scontrol`` running ``scontrol``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch-called"
    for name, body in (("sbatch", f"touch {record}; exit 1"), ("scontrol", scontrol)):
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_CONF": None}


DOWN = 'echo "Slurmctld(primary) at head is DOWN"; exit 1'
NO_CONFIG = (
    'echo "scontrol: error: s_p_parse_file: cannot stat file /etc/slurm/slurm.conf: No such '
    'file or directory, retrying in 1sec up to 60sec" >&2; exec sleep 60'
)


@pytest.mark.parametrize("backend", ["slurm", "parsl-slurm"])
def test_a_slurm_that_does_not_answer_stops_the_sweep_at_once(tmp_path, backend):
    env = fake_slurm(tmp_path, DOWN)
    result = sweep(tmp_path, "--nodes", "1", "--backend", backend, env=env)
    line = assert_refused(
        result, "Slurm error: the Slurm controller does not answer", tmp_path / "sw", 1
    )
    assert "is DOWN" in line
    assert not (tmp_path / "sbatch-called").exists()


def test_a_missing_slurm_configuration_is_known_at_once(tmp_path):
    env = fake_slurm(tmp_path, NO_CONFIG)
    # the fake scontrol prints Slurm's own complaint, then retries (sleeps) for 60 s: the sweep
    # must take the complaint, not wait for the retries to give up with another message
    result = sweep(tmp_path, "--nodes", "1", "--backend", "parsl-slurm", env=env)
    assert_refused(
        result, "error: SLURM_CONF: Slurm's configuration /etc/slurm/slurm.conf", tmp_path / "sw"
    )
    missing = sweep(tmp_path, "--nodes", "1", env={**env, "SLURM_CONF": str(tmp_path / "nope")})
    assert_refused(missing, "error: SLURM_CONF:", tmp_path / "sw")
    dry = sweep(tmp_path, "--nodes", "1", "--dry-run", env=env)
    assert dry.exit_code == 0, dry.output
    assert "NOT checked against a Slurm cluster: SLURM_CONF:" in dry.stderr


@pytest.mark.parametrize("backend", ["slurm", "parsl-slurm"])
def test_a_dry_run_says_it_did_not_check_against_slurm(tmp_path, backend):
    env = fake_slurm(tmp_path, DOWN)
    args = ["--nodes", "17", "--scaling", "weak", "--backend", backend, "--dry-run"]
    result = sweep(tmp_path, *args, env=env)
    assert result.exit_code == 0, result.output
    [warning] = result.stderr.strip().splitlines()
    assert "warning: NOT checked against a Slurm cluster" in warning
    assert "# NOT checked against a Slurm cluster" in result.stdout


def test_a_pilot_address_that_is_no_ip_is_refused(tmp_path):
    env = {**fake_slurm(tmp_path, DOWN), "KFAC_HPC_PILOT_ADDRESS": "not-an-ip"}
    result = sweep(tmp_path, "--nodes", "1", "--backend", "parsl-slurm", "--dry-run", env=env)
    assert_refused(
        result, "error: KFAC_HPC_PILOT_ADDRESS: 'not-an-ip' is not an IP", tmp_path / "sw"
    )


# Allocations the real cluster can never grant: refused before anything is written.
def _squeue(env: dict[str, str]) -> set[str]:
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return set(out.stdout.split())


def _cluster_nodes(env: dict[str, str]) -> int:
    out = subprocess.run(
        ["sinfo", "-h", "-o", "%D"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return sum(int(n) for n in out.stdout.split())


@pytest.mark.slurm
@pytest.mark.parametrize("backend", ["slurm", "parsl-slurm"])
def test_allocations_slurm_never_grants_are_refused_before_anything_is_written(
    slurm_cluster, tmp_path, backend
):
    before = _squeue(slurm_cluster)
    nodes = _cluster_nodes(slurm_cluster)
    profile = tmp_path / "site.toml"
    profile.write_text('partition = "nosuch"\n')
    common = ["--steps", "5", "--scaling", "weak", "--backend", backend]
    cases = [
        (["--nodes", str(nodes), "--ranks-per-node", "3"], "Requested node configuration"),
        (["--nodes", "1", "--ranks-per-node", "1000"], "Requested node configuration"),
        (["--nodes", "1", "--cpus-per-task", "100"], "Requested node configuration"),
        (["--nodes", "1", "--gpus-per-node", "4", "--ranks-per-node", "4"], "gres"),
        (["--nodes", "1", "--sbatch-arg=--partition=nosuch"], "invalid partition"),
        (["--nodes", "1", "--profile", str(profile)], "invalid partition"),
        (["--nodes", f"1,{nodes + 1}", "--dry-run"], f"at most {nodes} node(s)"),
    ]
    for args, reason in cases:
        result = sweep(tmp_path, *args, *common, env=slurm_cluster)
        assert_refused(result, reason, tmp_path / "sw")
    assert _squeue(slurm_cluster) <= before


@pytest.mark.slurm
def test_a_pilot_slurm_refuses_fails_at_once_and_its_points_show_failed(
    slurm_cluster, tmp_path, monkeypatch
):
    """A pilot Slurm refuses at submission (here: its profile's partition vanished after
    the sweep was checked) fails in seconds with sbatch's reason, and ``status`` shows it."""
    from kfac_hpc.sweep.backends import backend_for
    from kfac_hpc.sweep.follow import status
    from kfac_hpc.sweep.prepare import new_manifest, prepare_sweep, write_scripts
    from kfac_hpc.sweep.slurm_commands import SlurmError
    from kfac_hpc.workflows.pilot import run_pilot_points

    monkeypatch.setenv("SLURM_CONF", slurm_cluster["SLURM_CONF"])
    spec = load_spec(None, {"nodes": "1,2", "steps": "5", "scaling": "weak"})
    prepared = prepare_sweep(spec, tmp_path / "sw", backend_for("parsl-slurm"), load=False)
    manifest = new_manifest(prepared)
    manifest.profile["partition"] = "nosuch"
    write_scripts(prepared)
    manifest.write(prepared.sweep_dir)
    # sbatch's own reason (the old code waited for a block id, then failed without it)
    with pytest.raises(SlurmError, match=r"^Slurm refused the pilot: invalid partition"):
        run_pilot_points(prepared.sweep_dir)
    _, rows = status(prepared.sweep_dir)
    assert {r.state for r in rows} == {"failed"}
    assert all("invalid partition" in r.detail for r in rows)
