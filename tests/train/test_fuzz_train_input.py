"""Generated bad input to `kfac-hpc train`: every numeric, choice and switch option of the one
option table (K-FAC and FOSI/DHO2 ones included), as a flag and as a key of a `--config` TOML
file, with values of the wrong kind, outside its valid range and past its operational bound.
In process through click's CliRunner: exit 2, one error line naming the option, nothing
written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kfac_hpc.cli import main
from kfac_hpc.contracts.option_values import FLOAT_MAX, INT_MAX
from kfac_hpc.contracts.options import ALIASES, OPTIONS, Option
from kfac_hpc.train.cli import train as train_command


def _limit(option: Option) -> float:
    return (
        option.maximum
        if option.maximum is not None
        else (INT_MAX if option.kind == "int" else FLOAT_MAX)
    )


def _bad_values(option: Option) -> list[tuple[str, str]]:
    """(flag text, TOML literal) pairs that `train` must refuse for ``option``."""
    if option.choices:
        return [("bogus", '"bogus"'), ("", '""')]
    if option.kind == "bool":
        return [("maybe", '"maybe"'), ("2", "2")]
    if option.kind == "int":
        past = str(int(_limit(option)) + 1)
        bad = [("x", '"x"'), ("1.5", "1.5"), (past, past), ("1e400", "inf")]
        if option.check in ("positive", "nonnegative"):
            bad.append(("-1", "-1"))
        return bad
    if option.kind == "float":
        past = repr(_limit(option) * 10)
        bad = [("x", '"x"'), ("nan", "nan"), (past, past), ("inf", "inf")]
        if option.check in ("positive", "nonnegative", "decay", "fraction"):
            bad.append(("-1", "-1.0"))
        return bad
    if option.kind == "ints":
        return [("1,x", '[1, "x"]')]
    return []


CASES = [
    pytest.param(option, flag, literal, id=f"{option.name}={flag or 'empty'}")
    for option in OPTIONS.values()
    for flag, literal in _bad_values(option)
    if not option.optional or option.kind != "str"
]


def test_the_generated_cases_cover_every_fosi_and_kfac_option() -> None:
    covered = {case.values[0].name for case in CASES}
    for method in ("fosi", "kfac"):
        numeric = {
            o.name for o in OPTIONS.values() if o.method == method and o.kind in ("int", "float")
        }
        assert numeric and numeric <= covered, numeric - covered


def _assert_refused(result, option: Option, root: Path, before: set[Path]) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    names = {option.flag, option.name} | {
        "--" + alias.replace("_", "-")
        for alias, (fields, _) in ALIASES.items()
        if option.name in fields
    }
    assert any(name in lines[0] for name in names), (names, lines[0])
    assert "Traceback" not in result.output
    assert set(root.rglob("*")) == before, sorted(map(str, set(root.rglob("*")) - before))


TRAIN_FLAGS = {opt for param in train_command.params for opt in param.opts}
FLAG_CASES = [case for case in CASES if case.values[0].flag in TRAIN_FLAGS]


def test_only_aliased_options_have_no_flag_of_their_own() -> None:
    flagless = {case.values[0].name for case in CASES} - {c.values[0].name for c in FLAG_CASES}
    aliased = {field for fields, _ in ALIASES.values() for field in fields}
    assert flagless <= aliased, flagless - aliased  # --time-limit, --checkpoint-every


@pytest.mark.parametrize(("option", "flag", "literal"), FLAG_CASES)
def test_train_flag(tmp_path: Path, option: Option, flag: str, literal: str) -> None:
    before = set(tmp_path.rglob("*"))
    argv = ["train", "--run-dir", str(tmp_path / "run"), f"{option.flag}={flag}"]
    if option.method == "fosi":
        argv.append("--fosi")
    _assert_refused(CliRunner().invoke(main, argv), option, tmp_path, before)


@pytest.mark.parametrize(("option", "flag", "literal"), CASES)
def test_train_config_key(tmp_path: Path, option: Option, flag: str, literal: str) -> None:
    config = tmp_path / "train.toml"
    switch = "fosi = true\n" if option.method == "fosi" and option.name != "fosi" else ""
    config.write_text(f"{switch}{option.name} = {literal}\n")
    before = set(tmp_path.rglob("*"))
    argv = ["train", "--run-dir", str(tmp_path / "run"), "--config", str(config)]
    _assert_refused(CliRunner().invoke(main, argv), option, tmp_path, before)
