"""Bad input to `kfac-hpc sweep`, the one rule: one line on stderr naming the field (and, where
the case says, what is wrong), exit 2, no traceback, nothing written or submitted.

Flags (with --dry-run and the local backend, so no scheduler is asked) and TOML files, run in
this process through click's CliRunner: values generated from the option table (every train
setting and axis, with values `kfac-hpc train` rejects), the sweep's own counts, TOML values of
the wrong type, train values only the job judges at its world size, pass-through train
arguments, site profiles and templates that try to inject, and the sweep directory. (Text that
reaches a script as a literal: test_injection.py. What Slurm judges: test_scheduler_checks.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts.options import ALIASES, Option
from kfac_hpc.sweep.safety import TIME_FORMS
from kfac_hpc.sweep.spec import AXES, TRAIN_SETTINGS
from tests.helpers.sweeps import cli

HUGE = "99999999999999999999"
_COUNTS = {  # the sweep's own counts and their bad values (--time: test_a_time_limit_...)
    "nodes": ["0", "-1", "x", "1,x", "1.5", "inf", HUGE, "1,,2", "1,1"],
    "ranks_per_node": ["0", "-2", "two", "2.5", "nan", HUGE],
    "gpus_per_node": ["-1", "x", "0.5", HUGE],
    "cpus_per_task": ["0", "x", "1e3", HUGE],
    "repeats": ["0", "-1", "x", HUGE, "1e400"],
    "max_concurrent": ["0", "x", "-3", HUGE],
    "signal_seconds": ["0", "x", "-30", HUGE],
    "name": ["a;b", "$(id)", "a b", "-x"],
    "profile": ["nosuchsite"],
}


def _bad_values(option: Option) -> list[str]:
    """Values of ``option`` that `kfac-hpc train` rejects (from its kind, choices and range)."""
    if option.choices:
        return ["bogus", option.choices[0].upper() + "x"]
    if option.kind == "bool":
        return ["maybe", "2"]
    if option.check == "grad_workers":
        return ["2", "1.5", "bogus", "0", "-0.5"]
    if option.kind == "int":
        return ["x", "1.5"] + (["0", "-1", "inf"] if option.check == "positive" else [])
    if option.kind == "float":
        bad = {
            "positive": ["0", "-1", "nan", "inf"],
            "nonnegative": ["-1", "nan", "-inf"],
            "decay": ["1", "-0.1", "nan"],
            "fraction": ["0", "1.5", "nan"],
        }
        return ["x", *bad.get(option.check, [])]
    if option.kind == "ints":
        return ["1,x", "1.5", "0"] if option.check == "positive" else ["1,x"]
    if option.name == "init_factors":
        return ["", "does-not-exist.h5"]
    return []


def _flag_cases() -> list[tuple[list[str], str]]:
    cases: list[tuple[list[str], str]] = []
    for name, values in _COUNTS.items():
        for value in values:
            args = ["--nodes", "1"] if name != "nodes" else []
            cases.append(([*args, "--" + name.replace("_", "-"), value], name))
    options = {**{k: v for k, v in TRAIN_SETTINGS.items() if v is not None}, **AXES}
    for name, option in options.items():
        for value in _bad_values(option):
            cases.append((["--nodes", "1", option.flag, value], name))
    for alias in ALIASES:
        for value in ["x", "-5", "1:2:3:4:5"]:
            cases.append((["--nodes", "1", "--" + alias.replace("_", "-"), value], alias))
    cases += [
        (["--optimizer", "sgd"], "nodes"),
        (["--nodes", "1", "--steps", "5", "--epochs", "2"], "steps"),
        (["--nodes", "1", "--model", "mlp$(id)"], "model"),
        (["--nodes", "1", "--sbatch-arg", "rm -rf /"], "sbatch_args"),
        (["--nodes", "1", "--train-arg", "--lr\n0.1"], "extra_args"),
        (["--nodes", "1", "--stop-at-target", "true"], "stop_at_target"),
        (["--nodes", "1", "--dataset", "cifar10"], "data_path"),
        # checked by the job only at its world size: 128 does not split over 3 ranks, 0.3 of
        # 2 ranks is no whole number of grad workers
        (["--nodes", "3", "--batch-size", "128"], "batch_size"),
        (["--nodes", "1", "--grad-worker-fraction", "0.3", "--ranks-per-node", "2"], "grad_"),
    ]
    return cases


_WRONG_TYPES = ["[1]", "{a = 1}", "2024-01-01", "1979-05-27T07:32:00Z", "inf", "nan", "true"]
_TOP_TYPES = {  # the sweep file's top-level fields and the TOML values of the wrong type
    "nodes": ["[0]", "[1.5]", "[inf]", '["x"]', "{a = 1}", "2024-01-01", "[true]", "[[1]]"],
    "ranks_per_node": [*_WRONG_TYPES, '"two"', "-1", "-inf", "1.5"],
    "repeats": [*_WRONG_TYPES, "0", "1e400"],
    "max_concurrent": [*_WRONG_TYPES, "0"],
    "signal_seconds": [*_WRONG_TYPES, "-1"],
    "name": ["[1]", "{a = 1}", "2024-01-01", "true", '"a b"'],
    "time": ["[1]", "{a = 1}", "true", '"soon"'],
    "serial": ["[1]", "{a = 1}", '"maybe"'],
    "sbatch_args": ["5", "{a = 1}", '["rm -rf /"]'],
}
_TRAIN_TYPES = {
    "lr": ["[1]", "{a = 1}", "2024-01-01", "true", '"fast"', "-1.0", "nan", "inf"],
    "steps": ["inf", "1.5", "[1]", "true", "0", '"x"'],
    "lr_decay_epochs": ["[1.5]", "[true]", "[[1]]", "{a = 1}", "[0]"],
    "time_limit": ["[1]", "{a = 1}", "2024-01-01", "true", "nan", '"soon"'],
    "checkpoint_every": ["[1]", "true", "inf", "nan", '"x"'],
    "target_accuracy": ["5.0", "0", "[0.5]", "true"],
    "init_factors": ['""', "[1]"],
}


def _toml_cases() -> list[tuple[str, str]]:
    cases = []
    for name, values in _TOP_TYPES.items():
        for value in values:
            head = "" if name == "nodes" else "nodes = [1]\n"
            cases.append((f"{head}{name} = {value}\n", name))
    for name, values in _TRAIN_TYPES.items():
        for value in values:
            cases.append((f"nodes = [1]\n[train]\n{name} = {value}\n", name))
    cases += [
        ("nodes = [1]\ntrain = 5\n", "train"),
        ("nodes = [1]\naxes = [1]\n", "axes"),
        ("nodes = [1]\n[train]\nresume_from = 'x'\n", "train.resume_from"),
        ("nodes = [1]\n[train]\nresume_from = ''\n", "train.resume_from"),
        ("nodes = [1]\n[axes]\nseed = [1e400]\n", "seed"),
        ("nodes = [1]\n[axes]\nbatch_size = [{a = 1}]\n", "batch_size"),
        ("nodes = [1]\n[axes]\nkfac = []\n", "kfac"),
        ("nodes = [1]\n[axes]\nkfac = [1979-05-27]\n", "kfac"),
        ("nodes = [1\n", "sweep_file"),
    ]
    return cases


FLAG_CASES = _flag_cases()
TOML_CASES = _toml_cases()


def test_the_generated_cases_are_many_and_distinct():
    assert len(FLAG_CASES) + len(TOML_CASES) >= 150
    assert len({tuple(args) for args, _ in FLAG_CASES}) == len(FLAG_CASES)
    assert len({text for text, _ in TOML_CASES}) == len(TOML_CASES)


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def run_sweep(root: Path, *args: str, dry_run: bool = True, env: dict[str, str] | None = None):
    """`kfac-hpc sweep ARGS --sweep-dir sw --backend local [--dry-run]` in ``root`` (the
    current directory), in this process."""
    extra = ["--dry-run"] if dry_run else []
    argv = ["sweep", *args, "--sweep-dir", "sw", "--backend", "local", *extra]
    old = Path.cwd()
    os.chdir(root)
    try:
        return CliRunner().invoke(main, argv, env=env)
    finally:
        os.chdir(old)


def assert_bad_input(result, field: str, before: set[Path], root: Path, text: str = "") -> str:
    """Exit 2, one error line naming ``field`` (holding ``text``), no traceback, no file
    written under ``root``; the line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"error: {field}" in lines[0] or f"'{field}'" in lines[0], (field, lines[0])
    assert text in lines[0], (text, lines[0])
    assert "Traceback" not in result.output
    assert _files(root) == before, sorted(map(str, _files(root) - before))
    return lines[0]


@pytest.mark.parametrize(("args", "field"), FLAG_CASES)
def test_sweep_flags(tmp_path, args, field):
    before = _files(tmp_path)
    assert_bad_input(run_sweep(tmp_path, *args), field, before, tmp_path)


@pytest.mark.parametrize(("text", "field"), TOML_CASES)
def test_sweep_files(tmp_path, text, field):
    (tmp_path / "s.toml").write_text(text)
    before = _files(tmp_path)
    assert_bad_input(run_sweep(tmp_path, "-f", "s.toml"), field, before, tmp_path)


@pytest.mark.parametrize(
    ("text", "field", "says"),
    [
        ("nodes = [1]\n[axes]\nmomentum = [0.9]\n", "axes.momentum", "unknown axis"),
        ("nodes = [1]\nnode_count = 3\n", "node_count", "unknown sweep field"),
    ],
)
def test_an_unknown_name_in_a_sweep_file_is_named(tmp_path, text, field, says):
    (tmp_path / "s.toml").write_text(text)
    before = _files(tmp_path)
    assert_bad_input(run_sweep(tmp_path, "-f", "s.toml"), field, before, tmp_path, says)


def test_a_sweep_file_that_is_not_utf8(tmp_path):
    (tmp_path / "s.toml").write_bytes(b'name = "caf\xe9"\nnodes = [1]\n')
    before = _files(tmp_path)
    result = run_sweep(tmp_path, "-f", "s.toml")
    assert_bad_input(result, "sweep_file", before, tmp_path, "not UTF-8")


# Pass-through train arguments go through `kfac-hpc train`'s own parser and validation.
@pytest.mark.parametrize(
    ("arg", "field", "says"),
    [
        ("--damping=0", "damping", "0.0 must be a finite number > 0"),
        ("--dampin=1", "extra_args", "kfac-hpc train refuses"),
        ("--steps=abc", "extra_args", "'abc' is not a valid integer"),
        ("stray", "extra_args", "unexpected extra argument (stray)"),
        ("--help", "extra_args", "No such option '--help'"),
        ("--run-dir=elsewhere", "extra_args", "--run-dir is the sweep's"),
    ],
)
def test_train_args_are_checked_as_train_checks_them(tmp_path, arg, field, says):
    before = _files(tmp_path)
    result = run_sweep(tmp_path, "--nodes", "1", f"--train-arg={arg}")
    assert_bad_input(result, field, before, tmp_path, says)


def test_train_args_train_accepts_pass(tmp_path):
    args = ["--nodes", "1", "--train-arg=--log-every=5", "--train-arg=--no-progress"]
    result = run_sweep(tmp_path, *args)
    assert result.exit_code == 0, result.output
    assert "--log-every=5" in (tmp_path / "sw" / "scripts" / "n1-0.sbatch").read_text()


@pytest.mark.parametrize(
    "value",
    ["0", "00:00:00", "0-0", "99:99:99", "1:60", "1-02:60", "1:2:3:4", "1h; reboot", "soon"],
)
def test_a_time_limit_slurm_would_misread_is_refused(tmp_path, value):
    before = _files(tmp_path)
    result = run_sweep(tmp_path, "--nodes", "1", "--time", value)
    line = assert_bad_input(result, "time", before, tmp_path, "--time")
    assert TIME_FORMS in line


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
def test_injection_in_profile_fields_is_refused(tmp_path, line, field):
    (tmp_path / "site.toml").write_text(line + "\n")
    before = _files(tmp_path)
    result = run_sweep(tmp_path, "--nodes", "1", "--profile", str(tmp_path / "site.toml"))
    assert_bad_input(result, field, before, tmp_path)


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("{{ not_a_variable }}", "'not_a_variable' is undefined"),
        ("{{ 1 // 0 }}", ""),
        ("{{ nodes + 'x' }}", ""),
        ("{{ cases[99] }}", ""),
        ("{{ '%d' % 'x' }}", ""),
    ],
)
def test_a_template_that_cannot_render(tmp_path, expression, says):
    (tmp_path / "t.j2").write_text(f"#!/bin/bash\n#SBATCH --nodes={{{{ nodes }}}}\n{expression}\n")
    before = _files(tmp_path)
    result = run_sweep(tmp_path, "--nodes", "1", "--template", "t.j2")
    assert_bad_input(result, "template", before, tmp_path, says)


def test_a_sweep_dir_that_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("")
    before = _files(tmp_path)
    argv = ["sweep", "--nodes", "1", "--sweep-dir", "file/sw", "--backend", "local"]
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        result = CliRunner().invoke(main, argv)
    finally:
        os.chdir(old)
    assert_bad_input(result, "sweep_dir", before, tmp_path)


@pytest.mark.parametrize("sub", ["scripts", "logs", "runs"])
def test_a_file_where_a_sweep_folder_goes(tmp_path, sub):
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / sub).write_text("not a folder")
    before = _files(tmp_path)
    assert_bad_input(run_sweep(tmp_path, "--nodes", "1"), "sweep_dir", before, tmp_path)


def test_sbatch_missing_from_path(tmp_path):
    argv = ["sweep", "--nodes", "1", "--sweep-dir", str(tmp_path / "sw")]
    result = CliRunner().invoke(main, argv, env={"PATH": "/nonexistent"})
    assert_bad_input(result, "backend", set(), tmp_path, "sbatch is not on PATH")


@pytest.mark.parametrize("dataset", ["cifar10", "imagefolder"])
def test_a_dataset_that_cannot_load_stops_the_sweep_before_anything_starts(tmp_path, dataset):
    (tmp_path / "data").mkdir()  # a folder, so the job's validation passes; but no data in it
    args = ["--nodes", "1", "--model", "mlp", "--dataset", dataset, "--data-path", "data"]
    before = _files(tmp_path)
    result = run_sweep(tmp_path, *args, dry_run=False)
    says = f"--dataset {dataset} cannot be loaded here"
    assert_bad_input(result, "data_path", before, tmp_path, says)


def test_in_a_real_process_too(tmp_path):
    """The installed entry point ends the same way (one line, exit 2, nothing written)."""
    profile = tmp_path / "site.toml"
    profile.write_text('account = "a b"\n')
    args = ["--nodes", "1", "--profile", str(profile), "--backend", "local", "--dry-run"]
    out = cli("sweep", *args, "--sweep-dir", str(tmp_path / "sw"))
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("kfac-hpc sweep: error: profile.account:"), line
    assert not (tmp_path / "sw").exists()
