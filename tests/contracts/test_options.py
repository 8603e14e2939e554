"""The option table is the one definition of the job's options: the job's config and flags,
the sweep's flags, TOML tables and scripts all follow it, and a new option reaches them all."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import click
import pytest

from kfac_hpc.contracts.grad_workers import parse_grad_worker_fraction
from kfac_hpc.contracts.options import ALIASES, OPTIONS
from kfac_hpc.sweep.errors import SweepInputError
from kfac_hpc.sweep.spec import AXES, TRAIN_SETTINGS, expand_points, load_spec
from kfac_hpc.train.cli import train
from kfac_hpc.train.config import TrainConfig, load_config
from tests.conftest import REPO, clean_env

_ALIASED = {name for names, _ in ALIASES.values() for name in names}


def test_train_config_fields_are_the_option_table():
    config = TrainConfig()
    assert list(config.to_dict()) == list(OPTIONS)
    for name, option in OPTIONS.items():
        assert getattr(config, name) == option.default, name


def test_train_flags_and_sweep_settings_cover_the_same_options():
    flags = {p.name for p in train.params if isinstance(p, click.Option)} - {"config_file"}
    flags.discard("run_dir")
    assert flags == (set(OPTIONS) - _ALIASED) | set(ALIASES)
    swept = {n for n, o in OPTIONS.items() if o.sweep and n not in _ALIASED} | set(ALIASES)
    assert set(TRAIN_SETTINGS) | set(AXES) == swept
    assert not set(TRAIN_SETTINGS) & set(AXES)


@pytest.mark.parametrize("name", [n for n, o in OPTIONS.items() if o.sweep and o.default])
def test_a_value_the_sweep_accepts_is_the_value_train_reads(name):
    """Each option's default, given to the sweep as text, reaches the job unchanged (a method's
    option with that method switched on: other methods' points drop its axes)."""
    option = OPTIONS[name]
    default = option.default
    text = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
    switch = {} if option.method == "common" else {option.method: "true"}
    points = expand_points(load_spec(None, {"nodes": "1", name: text, **switch}))
    value = points[0].params[name]
    base = {} if option.method == "common" else {option.method: True}
    assert load_config(None, {name: value, **base}) == load_config(None, base)


def test_checkpoint_every_takes_steps_or_a_duration_in_the_sweep_as_in_train():
    for value in ("25", "10m"):
        spec = load_spec(None, {"nodes": "1", "checkpoint_every": value})
        assert spec.train.checkpoint_every == value
        load_config(None, {"checkpoint_every": value})
    with pytest.raises(SweepInputError, match="checkpoint_every"):
        load_spec(None, {"nodes": "1", "checkpoint_every": "soon"})


def test_hybrid_opt_means_one_thing_in_job_and_sweep():
    for world in (1, 2, 4):
        config = TrainConfig(grad_worker_fraction="hybrid-opt")
        assert config.grad_worker_share(world) == parse_grad_worker_fraction("hybrid-opt", world)
    spec = load_spec(None, {"nodes": "1", "grad_worker_fraction": "hybrid-opt,0.5"})
    assert spec.axes["grad_worker_fraction"] == ("hybrid-opt", 0.5)


_NEW_OPTION = """
import sys
from kfac_hpc.contracts import options
options.OPTIONS["{name}"] = options.Option(
    "{name}", "int", 7, "test knob", unit="steps", check="positive",
    method="kfac", axis={axis},
)
from kfac_hpc.cli import main
from kfac_hpc.train.config import TrainConfig
print("train default", TrainConfig().{name})
main(sys.argv[1:])
"""


def _with_new_option(name: str, axis: bool, *args: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(_NEW_OPTION.format(name=name, axis=axis))
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize("axis", [False, True])
def test_a_new_option_reaches_train_sweep_help_and_the_dry_run_script(axis, tmp_path):
    name, flag = "new_knob", "--new-knob"
    shown = _with_new_option(name, axis, "sweep", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "train default 7" in shown.stdout
    assert flag in shown.stdout and "test knob" in shown.stdout
    shown = _with_new_option(name, axis, "train", "--help")
    assert flag in shown.stdout
    values = "3,5" if axis else "3"
    ran = _with_new_option(
        name,
        axis,
        *("sweep", "--nodes", "1", flag, values, "--backend", "local", "--dry-run"),
        *("--sweep-dir", str(tmp_path / "sw")),
    )
    assert ran.returncode == 0, ran.stderr
    scripts = "".join(p.read_text() for p in (tmp_path / "sw" / "scripts").glob("*.sbatch"))
    for value in values.split(","):
        assert f"{flag} {value}" in scripts
    assert scripts.count(f"{flag} ") == len(values.split(","))
    bad = _with_new_option(name, axis, "sweep", "--nodes", "1", flag, "0", "--dry-run")
    assert bad.returncode == 2 and f"error: {name}" in bad.stderr


def test_a_new_option_is_a_key_of_the_sweep_file(tmp_path):
    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text("nodes = [1]\n[train]\nnew_knob = 4\n")
    ran = _with_new_option(
        "new_knob",
        False,
        *("sweep", "-f", str(sweep_file), "--backend", "local", "--dry-run"),
        *("--sweep-dir", str(tmp_path / "sw")),
    )
    assert ran.returncode == 0, ran.stderr
    assert "--new-knob 4" in (tmp_path / "sw" / "scripts" / "n1-0.sbatch").read_text()
