"""Generated bad input to `sweep` (flags with --dry-run, and TOML files), `collect` and `report`
(issue 14), in process through click's CliRunner: each exits 2 with one error line naming the
field, no traceback, and writes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts.options import ALIASES, Option
from kfac_hpc.sweep.spec import AXES, TRAIN_SETTINGS

HUGE = "99999999999999999999"
_COUNTS = {  # the sweep's own counts and their bad values
    "nodes": ["0", "-1", "x", "1.5", "inf", HUGE, "1,,2", "1,1"],
    "ranks_per_node": ["0", "-2", "two", "2.5", "nan", HUGE],
    "gpus_per_node": ["-1", "x", "0.5", HUGE],
    "cpus_per_task": ["0", "x", "1e3", HUGE],
    "repeats": ["0", "-1", "x", HUGE, "1e400"],
    "max_concurrent": ["0", "x", "-3", HUGE],
    "signal_seconds": ["0", "x", "-30", HUGE],
    "time": ["1h; reboot", "soon", "1:2:3:4"],
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
        return ["2", "bogus", "0", "-0.5"]
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
        (["--nodes", "1", "--steps", "5", "--epochs", "2"], "steps"),
        (["--nodes", "3", "--batch-size", "128"], "batch_size"),
        (["--nodes", "1", "--stop-at-target", "true"], "stop_at_target"),
        (["--nodes", "1", "--dataset", "cifar10"], "data_path"),
        (["--nodes", "1", "--sbatch-arg", "rm -rf /"], "sbatch_args"),
        (["--nodes", "1", "--train-arg", "--lr\n0.1"], "extra_args"),
        (["--optimizer", "sgd"], "nodes"),
    ]
    return cases


_WRONG_TYPES = ["[1]", "{a = 1}", "2024-01-01", "1979-05-27T07:32:00Z", "inf", "nan", "true"]
_TOP_TYPES = {  # the sweep file's top-level fields and the TOML values of the wrong type
    "nodes": ["[0]", "[1.5]", "[inf]", '["x"]', "{a = 1}", "2024-01-01", "[true]", "[[1]]"],
    "ranks_per_node": [*_WRONG_TYPES, '"two"', "-1", "1.5"],
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
    "checkpoint_every": ["[1]", "true", "inf", '"x"'],
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
        ("nodes = [1]\n[axes]\nmomentum = [0.9]\n", "axes.momentum"),
        ("nodes = [1]\n[train]\nresume_from = 'x'\n", "train.resume_from"),
        ("nodes = [1]\n[axes]\nseed = [1e400]\n", "seed"),
        ("nodes = [1]\n[axes]\nbatch_size = [{a = 1}]\n", "batch_size"),
        ("nodes = [1]\n[axes]\nkfac = []\n", "kfac"),
        ("nodes = [1\n", "sweep_file"),
    ]
    return cases


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def _assert_bad_input(result, field: str, before: set[Path], root: Path) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1, result.stderr
    assert f"error: {field}" in errors[0] or f"'{field}'" in errors[0], (field, errors[0])
    assert "Traceback" not in result.output
    assert _files(root) == before, sorted(map(str, _files(root) - before))


FLAG_CASES = _flag_cases()
TOML_CASES = _toml_cases()


def test_the_fuzz_covers_at_least_150_cases():
    assert len(FLAG_CASES) + len(TOML_CASES) + len(COLLECT_CASES) >= 150


@pytest.mark.parametrize(("args", "field"), FLAG_CASES)
def test_sweep_flags(tmp_path, monkeypatch, args, field):
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    argv = ["sweep", *args, "--sweep-dir", "sw", "--backend", "local", "--dry-run"]
    _assert_bad_input(CliRunner().invoke(main, argv), field, before, tmp_path)


@pytest.mark.parametrize(("text", "field"), TOML_CASES)
def test_sweep_files(tmp_path, monkeypatch, text, field):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text(text)
    before = _files(tmp_path)
    argv = ["sweep", "-f", "s.toml", "--sweep-dir", "sw", "--backend", "local", "--dry-run"]
    _assert_bad_input(CliRunner().invoke(main, argv), field, before, tmp_path)


def _collect_cases() -> list[tuple[list[str], str]]:
    cases: list[tuple[list[str], str]] = []
    for command in ("collect", "report"):
        for value in ["5", "-1", "nan", "x", "inf", "-inf", "1.5", "", "1e400"]:
            cases.append(([command, "sweep", "--target-accuracy", value], "--target-accuracy"))
        for value in ["bogus", "TABLE", "", "csv2"]:
            cases.append(([command, "sweep", "--format", value], "--format"))
        for source in ["nope", "afile", "empty", "junk"]:
            field = "SWEEP_DIR"
            cases.append(([command, source], field))
        cases.append(([command, "sweep", "--out", "afile"], "--out"))
    for value in ["2", "-1", "x", "nan"]:
        cases.append(
            (["report", "sweep", "--regression-threshold", value], "--regression-threshold")
        )
    for baseline in ["nope", "afile", "empty"]:
        cases.append((["report", "sweep", "--baseline", baseline], "--baseline"))
    return cases


COLLECT_CASES = _collect_cases()


@pytest.mark.parametrize(("args", "field"), COLLECT_CASES)
def test_collect_and_report(tmp_path, monkeypatch, args, field):
    from tests.synthetic_runs import SyntheticRun, write_sweep

    monkeypatch.chdir(tmp_path)
    write_sweep(tmp_path / "sweep", [SyntheticRun("r", 1, 0.1, {"forward": 0.01}, steps=20)])
    (tmp_path / "afile").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a run\n")
    os.utime(tmp_path / "afile")
    before = _files(tmp_path)
    _assert_bad_input(CliRunner().invoke(main, args), field, before, tmp_path)
