"""Text a user gives that reaches a script (train arguments, environment values, the train
command, the sweep directory) arrives byte for byte as an inert literal: the script never
executes it. (Text a field must not hold is refused: test_bad_input.py.)"""

from __future__ import annotations

import json
import subprocess

from kfac_hpc.sweep.prepare import plan_arrays
from kfac_hpc.sweep.profile import load_profile
from kfac_hpc.sweep.render import load_template, render_array
from kfac_hpc.sweep.spec import expand_points
from tests.helpers.sweeps import cli, spec
from tests.sweep.test_render import _stub_env

PAYLOAD = "$(touch PWNED); `touch PWNED`; touch PWNED"


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
