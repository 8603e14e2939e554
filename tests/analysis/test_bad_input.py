"""Generated bad input to `collect` and `report` (issue 14), in this process through click's
CliRunner: each exits 2 with one error line naming the field, no traceback, and writes
nothing. (Moved from tests/sweep/test_fuzz_bad_input.py, whose sweep cases are
tests/sweep/test_bad_input.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from tests.helpers.synthetic_runs import SyntheticRun, write_sweep


def _cases() -> list[tuple[list[str], str]]:
    cases: list[tuple[list[str], str]] = []
    for command in ("collect", "report"):
        for value in ["5", "-1", "nan", "x", "inf", "-inf", "1.5", "", "1e400"]:
            cases.append(([command, "sweep", "--target-accuracy", value], "--target-accuracy"))
        for value in ["0", "-1", "nan", "x", "inf", "", "1e400"]:
            cases.append(([command, "sweep", "--target-loss", value], "--target-loss"))
        both = ["--target-accuracy", "0.9", "--target-loss", "1.5"]
        cases.append(([command, "sweep", *both], "--target-loss"))
        for value in ["bogus", "TABLE", "", "csv2"]:
            cases.append(([command, "sweep", "--format", value], "--format"))
        for source in ["nope", "afile", "empty", "junk"]:
            cases.append(([command, source], "SWEEP_DIR"))
        cases.append(([command, "sweep", "--out", "afile"], "--out"))
    for value in ["2", "-1", "x", "nan"]:
        cases.append(
            (["report", "sweep", "--regression-threshold", value], "--regression-threshold")
        )
    for baseline in ["nope", "afile", "empty"]:
        cases.append((["report", "sweep", "--baseline", baseline], "--baseline"))
    return cases


CASES = _cases()


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize(("args", "field"), CASES)
def test_collect_and_report(tmp_path, monkeypatch, args, field):
    monkeypatch.chdir(tmp_path)
    write_sweep(tmp_path / "sweep", [SyntheticRun("r", 1, 0.1, {"forward": 0.01}, steps=20)])
    (tmp_path / "afile").write_text("")
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a run\n")
    os.utime(tmp_path / "afile")
    before = _files(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1, result.stderr
    assert f"error: {field}" in errors[0] or f"'{field}'" in errors[0], (field, errors[0])
    assert "Traceback" not in result.output
    assert _files(tmp_path) == before, sorted(map(str, _files(tmp_path) - before))
