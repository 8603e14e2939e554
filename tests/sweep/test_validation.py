"""Bad input: one line naming the field, exit 2, nothing written or submitted; and injection
attempts in every user field are rejected or end up as inert literal strings."""

from __future__ import annotations

import json
import subprocess

import pytest

from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.profile import load_profile
from kfac_hpc.sweep.render import load_template, render_array
from kfac_hpc.sweep.spec import expand_points, load_spec, point_id
from kfac_hpc.sweep.submit import plan_arrays
from tests.sweep.helpers import cli, spec
from tests.sweep.test_render import _stub_env

PAYLOAD = "$(touch PWNED); `touch PWNED`; touch PWNED"


def test_point_ids_are_stable_hashes_of_the_parameters():
    a = expand_points(spec(nodes="1,2", kfac="true,false", repeats=2, grad_worker_fraction="0.5,1"))
    b = expand_points(spec(nodes="1,2", kfac="true,false", repeats=2, grad_worker_fraction="0.5,1"))
    assert [p.point_id for p in a] == [p.point_id for p in b]
    assert all(p.point_id == point_id(p.params) for p in a)
    # 2 nodes x (2 gwf with K-FAC + 1 without: gwf means nothing without K-FAC) x 2 repeats
    assert len(a) == 2 * 3 * 2
    assert len({p.point_id for p in a}) == len(a)


def test_sweep_file_and_flags_merge_with_flags_winning(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(
        'name = "f"\nnodes = [1, 2]\nrepeats = 3\n'
        '[train]\nsteps = 7\n[axes]\noptimizer = ["sgd", "adam"]\n'
    )
    s = load_spec(f, {"repeats": 1, "nodes": None})
    assert s.name == "f" and s.nodes == (1, 2) and s.repeats == 1
    assert s.train.steps == 7 and s.axes["optimizer"] == ("sgd", "adam")


BAD_FLAGS = [
    (["--nodes", "1,,4"], "nodes"),
    (["--nodes", "1,x"], "nodes"),
    (["--nodes", "0"], "nodes"),
    (["--nodes", "1", "--optimizer", "lbfgs"], "optimizer"),
    (["--nodes", "1", "--kfac", "maybe"], "kfac"),
    (["--nodes", "1", "--grad-worker-fraction", "1.5"], "grad_worker_fraction"),
    (["--nodes", "1", "--profile", "nosuchsite"], "profile"),
    (["--nodes", "1", "--time", "1h; reboot"], "time"),
    (["--nodes", "1", "--name", "a;b"], "name"),
    (["--nodes", "1", "--model", "mlp$(id)"], "model"),
    (["--nodes", "1", "--sbatch-arg", "rm -rf /"], "sbatch_args"),
    (["--nodes", "1", "--train-arg", "--lr\n0.1"], "extra_args"),
    (["--nodes", "1", "--steps", "5", "--epochs", "2"], "steps"),
    (["--optimizer", "sgd"], "nodes"),
    (["--nodes", "1", "--ranks-per-node", "two"], "ranks_per_node"),
    (["--nodes", "1", "--max-concurrent", "0"], "max_concurrent"),
    (["--nodes", "1", "--lr", "fast"], "lr"),
]


@pytest.mark.parametrize(("args", "field"), BAD_FLAGS)
def test_bad_flag_is_one_line_naming_the_field_exit_2_nothing_written(args, field, tmp_path):
    sweep_dir = tmp_path / "sw"
    out = cli("sweep", *args, "--sweep-dir", str(sweep_dir), "--backend", "local", "--dry-run")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"error: {field}" in lines[0], out.stderr
    assert not sweep_dir.exists()


def test_unknown_axis_and_unknown_key_in_the_sweep_file(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("nodes = [1]\n[axes]\nmomentum = [0.9]\n")
    with pytest.raises(SweepInputError, match=r"axes.momentum: unknown axis"):
        load_spec(f, {})
    f.write_text("nodes = [1]\nnode_count = 3\n")
    with pytest.raises(SweepInputError, match=r"node_count: unknown sweep field"):
        load_spec(f, {})


def test_template_with_a_missing_variable_is_bad_input(tmp_path):
    t = tmp_path / "t.j2"
    t.write_text("#!/bin/bash\n#SBATCH --nodes={{ nodes }}\n{{ not_a_variable }}\n")
    out = cli(
        "sweep",
        "--nodes",
        "1",
        "--template",
        str(t),
        "--sweep-dir",
        str(tmp_path / "sw"),
        "--dry-run",
        "--backend",
        "local",
    )
    assert out.returncode == 2 and "error: template: 'not_a_variable' is undefined" in out.stderr
    assert not (tmp_path / "sw").exists()


def test_unwritable_sweep_dir_is_bad_input(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = cli("sweep", "--nodes", "1", "--sweep-dir", str(blocker / "sw"), "--backend", "local")
    assert out.returncode == 2 and "error: sweep_dir" in out.stderr


def test_missing_sbatch_is_bad_input(tmp_path):
    out = cli(
        "sweep", "--nodes", "1", "--sweep-dir", str(tmp_path / "sw"), env={"PATH": "/nonexistent"}
    )
    assert out.returncode == 2 and "error: backend: sbatch is not on PATH" in out.stderr
    assert not (tmp_path / "sw").exists()


PROFILE_ATTACKS = [
    ('partition = "debug;touch PWNED"', "profile.partition"),
    ('account = "a b"', "profile.account"),
    ('qos = "$(id)"', "profile.qos"),
    ('constraint = "a100 && touch PWNED"', "profile.constraint"),
    ('srun_mpi = "pmi2 touch"', "profile.srun_mpi"),
    ('launcher = "bash -c"', "profile.launcher"),
    ('setup = ["module load x\\ntouch PWNED"]', "profile.setup"),
    ('time = "1:00:00\\n#SBATCH --uid=0"', "profile.time"),
    ('[env]\n"A;touch PWNED" = "1"', "profile.env"),
    ('[env]\nA = "1\\ntouch PWNED"', "profile.env.A"),
    ('train_command = ["kfac-hpc\\ntouch PWNED"]', "profile.train_command"),
    ('sbatch_args = ["--x\\ny"]', "profile.sbatch_args"),
]


@pytest.mark.parametrize(("line", "field"), PROFILE_ATTACKS)
def test_injection_in_profile_fields_is_rejected(line, field, tmp_path):
    p = tmp_path / "site.toml"
    p.write_text(line + "\n")
    out = cli(
        "sweep",
        "--nodes",
        "1",
        "--profile",
        str(p),
        "--sweep-dir",
        str(tmp_path / "sw"),
        "--dry-run",
        "--backend",
        "local",
    )
    assert out.returncode == 2 and f"error: {field}" in out.stderr, out.stderr
    assert not (tmp_path / "sw").exists()


def test_quoted_fields_carry_payloads_as_inert_literals(tmp_path):
    """Fields that accept arbitrary text (train args, env values, the train command) reach the
    launcher byte for byte, and the script never executes them."""
    p = tmp_path / "site.toml"
    p.write_text(
        'launcher = "srun"\n'
        f"train_command = [{json.dumps('kfac-hpc')}, {json.dumps(PAYLOAD)}]\n"
        f"[env]\nEVIL = {json.dumps(PAYLOAD)}\n"
    )
    s = spec(nodes="1", profile=str(p), extra_args=["--note", PAYLOAD, 'it\'s "quoted"'])
    [(name, points)] = plan_arrays(expand_points(s), s.nodes, 1000)
    script = tmp_path / "s.sbatch"
    script.write_text(render_array(load_template(), s, load_profile(str(p)), name, points).text)
    work = tmp_path / "work"
    work.mkdir()
    env = _stub_env(tmp_path, "srun", STUB_EXIT="0")
    out = subprocess.run(
        ["bash", str(script)], env=env, cwd=work, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("kfac-hpc") + 1] == PAYLOAD
    assert argv[-3:] == ["--note", PAYLOAD, 'it\'s "quoted"']
    assert f"EVIL={PAYLOAD}" in (tmp_path / "env.txt").read_text()
    assert not list(work.rglob("PWNED")) and not list(tmp_path.rglob("PWNED"))


def test_sweep_dir_with_shell_metacharacters_is_inert(tmp_path):
    sweep_dir = tmp_path / "a dir; $(touch PWNED)"
    out = cli(
        "sweep",
        "--nodes",
        "1,2",
        "--sweep-dir",
        str(sweep_dir),
        "--dry-run",
        "--backend",
        "local",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    snippet = "\n".join(out.stdout.splitlines()[1:])
    # The printed commands are a runnable shell snippet: cd into the dir, then sbatch lines.
    check = subprocess.run(
        ["bash", "-c", snippet.split("\n")[0] + " && pwd"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.stdout.strip() == str(sweep_dir)
    assert not list(tmp_path.rglob("PWNED"))


def test_toml_axes_take_booleans_and_numbers(tmp_path):
    """`kfac = [true, false]` and `grad_worker_fraction = [1.0, 0.5]` in a sweep file are the
    values the command line's `--kfac true,false` gives (the file `kfac-hpc plan` writes)."""
    sweep_file = tmp_path / "axes.toml"
    sweep_file.write_text(
        "nodes = [1, 2]\n[axes]\nkfac = [true, false]\ngrad_worker_fraction = [1.0, 0.5]\n"
    )
    points = expand_points(load_spec(sweep_file, {}))
    assert {p.params["kfac"] for p in points} == {True, False}
    assert {p.params.get("grad_worker_fraction") for p in points if p.params["kfac"]} == {1.0, 0.5}
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = [1]\n[axes]\nkfac = [1979-05-27]\n")
    with pytest.raises(SweepInputError, match="kfac"):
        load_spec(bad, {})
