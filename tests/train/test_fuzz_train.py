"""Generated bad input for `kfac-hpc train` and `kfac-hpc checkpoint inspect|verify`, run in
process (click's CliRunner): each case exits 2 with one line on stderr naming the field, shows
no traceback and writes nothing (neither the run dir nor anything in the working directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.checkpoint.inspect import checkpoint
from kfac_hpc.contracts.options import ALIASES, OPTIONS
from kfac_hpc.train.cli import train

_ALIASED = {name for names, _ in ALIASES.values() for name in names}
# Not a valid value of any numeric option: not a number, not finite, negative, too large,
# Unicode digits that are no ASCII number.
_BAD_NUMBERS = (
    "nan",
    "inf",
    "-inf",
    "-1",
    "-1e308",
    "1e308",
    "99999999999999999999",
    "²",
    "abc",
    "",
)
_BAD_DURATIONS = ("²", "-1", "nan", "1e400", "abc", "", "10x", "0", "99999999999999999999h")


def _cases() -> list[tuple[list[str], str]]:
    cases: list[tuple[list[str], str]] = []
    for option in OPTIONS.values():
        if option.name in _ALIASED:
            continue
        if option.kind in ("int", "float"):
            cases += [([option.flag, value], option.flag) for value in _BAD_NUMBERS]
        elif option.choices:
            cases += [([option.flag, v], option.flag) for v in ("nonsense", "", "SGD ")]
    for alias in ALIASES:
        flag = "--" + alias.replace("_", "-")
        cases += [([flag, value], flag) for value in _BAD_DURATIONS]
    cases += [(["--lr-decay-epochs", v], "--lr-decay-epochs") for v in ("1.5", "0", "-1", "a")]
    gwf = "--grad-worker-fraction"
    cases += [([gwf, v], gwf) for v in ("0", "1.5", "nan", "abc", "", "-0.5")]
    cases += [
        (["--dataset", "cifar10"], "--data-path"),
        (["--resume-from", "nope.h5"], "--resume-from"),
        (["--init-factors", "."], "--init-factors"),
        (["--stop-at-target"], "--stop-at-target"),
    ]
    return cases


CASES = _cases()


def _snapshot(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _assert_bad_input(result, name: str, before: set[str], root: Path) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert len(lines) == 1 and name in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert _snapshot(root) == before


def test_the_fuzz_covers_enough_cases():
    assert len(CASES) >= 150


@pytest.mark.parametrize(("args", "flag"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flag(tmp_path, monkeypatch, args, flag):
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(train, ["--run-dir", "run", *args])
    _assert_bad_input(result, flag, before, tmp_path)


def _run_dirs(root: Path) -> dict[str, str]:
    (root / "file").write_text("x")
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{not json")
    (root / "listjson").mkdir()
    (root / "listjson" / "config.json").write_text("[1, 2]")
    (root / "binjson").mkdir()
    (root / "binjson" / "config.json").write_bytes(b"\xff\xfe\x00")
    (root / "ckfile").mkdir()
    (root / "ckfile" / "checkpoints").write_text("x")
    return {
        "empty": "",
        "blank": "  ",
        "parent_is_file": "file/run",
        "is_file": "file",
        "too_long": "a" * 300,
        "too_long_inside": "x/" + "b" * 256 + "/run",
        "config_not_json": "badjson",
        "config_not_object": "listjson",
        "config_not_utf8": "binjson",
        "checkpoints_is_file": "ckfile",
    }


@pytest.mark.parametrize(
    "kind",
    [
        "empty",
        "blank",
        "parent_is_file",
        "is_file",
        "too_long",
        "too_long_inside",
        "config_not_json",
        "config_not_object",
        "config_not_utf8",
        "checkpoints_is_file",
    ],
)
def test_unusable_run_dir(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    run_dir = _run_dirs(tmp_path)[kind]
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(train, ["--run-dir", run_dir, "--model", "mlp", "--steps", "1"])
    _assert_bad_input(result, "--run-dir", before, tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_run_dir_in_a_read_only_folder(tmp_path, monkeypatch):
    (tmp_path / "ro").mkdir(mode=0o555)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(train, ["--run-dir", "ro/run", "--steps", "1"])
    _assert_bad_input(result, "--run-dir", before, tmp_path)


def _checkpoint_paths(root: Path) -> list[str]:
    (root / "emptydir").mkdir()
    (root / "latestdir" / "checkpoints" / "latest").mkdir(parents=True)
    (root / "dangling" / "checkpoints").mkdir(parents=True)
    (root / "dangling" / "checkpoints" / "latest").write_text("ckpt-00000009.h5\n")
    (root / "badlatest" / "checkpoints").mkdir(parents=True)
    (root / "badlatest" / "checkpoints" / "latest").write_bytes(b"\xff\xfe")
    return [
        "",
        " ",
        "missing.h5",
        "emptydir",
        "latestdir",
        "latestdir/checkpoints",
        "dangling",
        "badlatest",
        "nope/nope/ckpt-00000001.h5",
        "a" * 300,
    ]


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("index", range(10))
def test_checkpoint_bad_path(tmp_path, monkeypatch, command, index):
    monkeypatch.chdir(tmp_path)
    path = _checkpoint_paths(tmp_path)[index]
    before = _snapshot(tmp_path)
    result = CliRunner().invoke(checkpoint, [command, path])
    _assert_bad_input(result, "PATH", before, tmp_path)
