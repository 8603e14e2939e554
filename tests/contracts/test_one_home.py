"""One home for every fact: the option table (contracts/options.py) is the only source of the
options' names, kinds, defaults, ranges and help for the library's constructors
(``KFACPreconditioner``, ``FOSI``), the job's flags (``kfac-hpc train``), the sweep's flags and
``kfac-hpc plan``'s flags; where a default differs on purpose the table says why. The choices
are the library's enums, defined once (contracts/choices.py). Every command leaves on bad input
by one exit path (cli_errors.py) with one line ``kfac-hpc CMD: error: FIELD: reason``."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import typing
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from kfac_hpc import FOSI, KFACPreconditioner
from kfac_hpc.cli import main
from kfac_hpc.contracts import choices
from kfac_hpc.contracts.grad_workers import GRAD_WORKER_NAMES
from kfac_hpc.contracts.option_values import validity_problem
from kfac_hpc.contracts.options import (
    ALIASES,
    LIBRARY_ONLY,
    LIBRARY_PARAMETERS,
    OPTIONS,
    Option,
    library_default,
)
from kfac_hpc.optim import KFACOptions
from kfac_hpc.optim.fosi import FOSIOptions
from kfac_hpc.optim.fosi.hvp import HvpMode
from kfac_hpc.plan import cli as plan_cli
from kfac_hpc.sweep.cli import run as sweep_run
from kfac_hpc.sweep.cli import sweep as sweep_group
from kfac_hpc.sweep.spec import AXES, TRAIN_SETTINGS
from kfac_hpc.train.cli import train

PACKAGE = Path(__file__).resolve().parents[2] / "kfac_hpc"
_KINDS = {"int": "integer", "float": "float", "str": "text", "strs": "text", "ints": "text"}


def _plain(value: Any) -> Any:
    """An enum member as its value (the table holds the values)."""
    return value.value if isinstance(value, enum.Enum) else value


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


# --- the library's constructors ------------------------------------------------------------


def _library_defaults(method: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, {parameter: default}) of every place the library spells its defaults."""
    if method == "kfac":
        signature = inspect.signature(KFACPreconditioner)
        return [
            ("KFACOptions", {f.name: f.default for f in dataclasses.fields(KFACOptions)}),
            ("KFACPreconditioner", {n: p.default for n, p in signature.parameters.items()}),
        ]
    signature = inspect.signature(FOSI)
    return [
        ("FOSIOptions", {f.name: f.default for f in dataclasses.fields(FOSIOptions)}),
        ("FOSI", {n: p.default for n, p in signature.parameters.items()}),
    ]


@pytest.mark.parametrize("method", ["kfac", "fosi"])
def test_library_defaults_are_the_tables(method: str) -> None:
    for where, defaults in _library_defaults(method):
        for parameter, default in defaults.items():
            name = LIBRARY_PARAMETERS[method].get(parameter)
            if name is not None:
                assert _plain(default) == library_default(name), (where, parameter)


@pytest.mark.parametrize(("method", "options"), [("kfac", KFACOptions), ("fosi", FOSIOptions)])
def test_every_library_parameter_is_an_option_or_says_why_not(method: str, options: type) -> None:
    fields = {f.name for f in dataclasses.fields(options)}
    shared, own = set(LIBRARY_PARAMETERS[method]), set(LIBRARY_ONLY[method])
    assert fields == shared | own and not shared & own
    assert all(LIBRARY_ONLY[method].values())
    assert set(LIBRARY_PARAMETERS[method].values()) <= set(OPTIONS)


def test_a_library_default_differs_from_the_jobs_and_says_why() -> None:
    parameters = {n for names in LIBRARY_PARAMETERS.values() for n in names.values()}
    differing = {n: o for n, o in OPTIONS.items() if o.library_default is not None}
    assert set(differing) == {"inv_update_steps", "damping"}  # kfac_pytorch's 1 and 0.001
    for name, option in differing.items():
        other = option.library_default
        assert other is not None and name in parameters
        assert other.value != option.default and len(other.why) > 20, name
        assert validity_problem(option, other.value) is None, name


_INVALID = {"positive": 0, "nonnegative": -1, "decay": 1.0, "fraction": 0, "at_least_one": 0.5}


def _invalid_cases(method: str) -> list[tuple[str, Any]]:
    cases = []
    for parameter, name in LIBRARY_PARAMETERS[method].items():
        option = OPTIONS[name]
        if option.choices:
            cases.append((parameter, "bogus"))
        elif option.check in _INVALID and parameter != "seed":  # any integer seeds FOSI
            cases.append((parameter, _INVALID[option.check]))
    return cases


@pytest.mark.parametrize(("parameter", "value"), _invalid_cases("kfac"))
def test_kfac_refuses_what_the_table_calls_invalid(parameter: str, value: Any) -> None:
    with pytest.raises(ValueError, match=parameter):
        KFACPreconditioner(nn.Linear(2, 2), **{parameter: value})


@pytest.mark.parametrize(("parameter", "value"), _invalid_cases("fosi"))
def test_fosi_refuses_what_the_table_calls_invalid(parameter: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"FOSI option {parameter}="):
        FOSIOptions(**{parameter: value})


@pytest.mark.parametrize("method", ["kfac", "fosi"])
def test_the_library_leaves_the_jobs_operational_bounds_to_the_job(method: str) -> None:
    """A value past an option's ``maximum`` but mathematically valid is the caller's choice."""
    big = {
        p: int(OPTIONS[n].maximum) + 1 if OPTIONS[n].kind == "int" else OPTIONS[n].maximum * 10
        for p, n in LIBRARY_PARAMETERS[method].items()
        if OPTIONS[n].maximum is not None and p != "seed"
    }
    assert big
    if method == "fosi":
        FOSIOptions(**big)
    else:
        KFACPreconditioner(nn.Linear(2, 2), **big)


# --- the job's, the sweep's and plan's flags ------------------------------------------------

_ALIASED = {name for names, _ in ALIASES.values() for name in names}


def _params(command: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in command.params if p.name}


def _check_kind(param: click.Parameter, option: Option) -> None:
    if option.kind == "bool":
        assert isinstance(param, click.Option) and param.is_flag and param.secondary_opts
    else:
        assert param.type.name == _KINDS[option.kind], (option.name, param.type.name)


@pytest.mark.parametrize("name", [n for n in OPTIONS if n not in _ALIASED])
def test_train_flag_is_the_tables(name: str) -> None:
    option, param = OPTIONS[name], _params(train)[name]
    assert isinstance(param, click.Option) and param.opts == [option.flag]
    _check_kind(param, option)
    assert param.default is None  # not given: the job takes the table's default
    assert param.help is not None and param.help.startswith(option.describe())
    if option.default not in (None, ()):
        assert f"[default: {option.default}]" in param.help


@pytest.mark.parametrize("command", [sweep_group, sweep_run], ids=["sweep", "sweep run"])
def test_sweep_flags_are_the_tables(command: click.Command) -> None:
    params = _params(command)
    for name, option in AXES.items():
        assert params[name].opts == [option.flag] and option.describe() in str(params[name].help)
    for name, setting in TRAIN_SETTINGS.items():
        text = str(params[name].help)
        if setting is None:  # an alias: its own help
            assert text == ALIASES[name][1]
            continue
        assert text.startswith(setting.describe()), name
        if setting.default not in (None, ()):
            assert f"[train: {setting.default}]" in text, name


def test_plan_flags_of_job_options_are_the_tables() -> None:
    params = _params(plan_cli.plan)
    assert set(params) & set(OPTIONS) <= set(plan_cli._JOB_OPTIONS)  # none written by hand
    for field, name in plan_cli._JOB_OPTIONS.items():
        option, param = OPTIONS[name], params[field]
        _check_kind(param, option)
        assert option.describe() in str(param.help), field
        other = option.plan_default
        if other is None:
            assert param.default == option.default, field
            continue
        assert param.default == other.value != option.default and len(other.why) > 20, field
        assert f"kfac-hpc train's default: {_shown(option.default)}" in str(param.help) or (
            option.default is None and "kfac-hpc train's default: none" in str(param.help)
        )


def test_units_say_what_the_code_means() -> None:
    assert OPTIONS["allreduce_bucket_cap_mb"].unit == "MiB"  # the code multiplies by 2**20
    assert not [n for n, o in OPTIONS.items() if o.unit in ("MB", "GB", "KB")]


# --- choices: the library's enums, defined once ---------------------------------------------

_ENUMS = {
    "compute_method": choices.ComputeMethod,
    "kfac_approx": choices.KFACApprox,
    "assignment_strategy": choices.AssignmentStrategy,
}


def test_choices_are_the_library_enums() -> None:
    from kfac_hpc import comm, optim
    from kfac_hpc.optim import layers, options

    for name, kind in _ENUMS.items():
        assert OPTIONS[name].choices == choices.values(kind), name
    assert optim.ComputeMethod is choices.ComputeMethod
    assert optim.KFACApprox is layers.KFACApprox is choices.KFACApprox
    assert optim.AssignmentStrategy is comm.AssignmentStrategy is choices.AssignmentStrategy
    assert comm.DistributionStrategy is choices.DistributionStrategy
    assert options.DampingMode is choices.DampingMode
    assert choices.values(choices.DistributionStrategy) == GRAD_WORKER_NAMES
    assert OPTIONS["fosi_hvp"].choices == choices.HVP_MODES == typing.get_args(HvpMode)


@functools.cache
def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_enum_or_list_of_its_values_is_written_twice() -> None:
    """The library's enums and their values live in contracts/choices.py only (a ``Literal``
    of them for type checkers excepted: test_choices_are_the_library_enums)."""
    owner = PACKAGE / "contracts"
    kinds = [c for c in vars(choices).values() if isinstance(c, type) and issubclass(c, enum.Enum)]
    sets = {frozenset(choices.values(kind)) for kind in kinds} | {frozenset(choices.HVP_MODES)}
    found = []
    for path, tree in _modules():
        if path.is_relative_to(owner):
            continue
        literals = {
            id(node.slice)
            for node in ast.walk(tree)
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Literal"
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in {k.__name__ for k in kinds}:
                found.append(f"{path}: class {node.name}")
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and id(node) not in literals:
                strings = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if len(strings) == len(node.elts) and frozenset(strings) in sets:
                    found.append(f"{path}:{node.lineno}: {strings}")
    assert not found, found


# --- one error type, one exit path ----------------------------------------------------------


def test_no_command_exits_on_bad_input_by_its_own_path() -> None:
    """Only cli_errors.py exits 2; no other module prints its own ``error:`` line."""
    allowed = {PACKAGE / "cli_errors.py", PACKAGE / "contracts" / "exit_codes.py"}
    found = []
    for path, tree in _modules():
        if path in allowed:
            continue
        for node in ast.walk(tree):
            text = ast.unparse(node) if isinstance(node, ast.Call) else ""
            exits = text.startswith(("sys.exit(", "SystemExit(", "exit(", "os._exit("))
            if exits and ("BAD_INPUT" in text or text.endswith(("(2)", "(2))"))):
                found.append(f"{path}:{node.lineno}: {text}")
            if text.startswith("click.echo(") and "'error: " in text.replace('"', "'")[:30]:
                found.append(f"{path}:{node.lineno}: {text[:60]}")
            if isinstance(node, ast.Name) and node.id.startswith("EXIT_BAD"):
                found.append(f"{path}:{node.lineno}: {node.id}")
    assert not found, found


def test_one_module_is_the_error_type() -> None:
    claims = [
        path
        for path, tree in _modules()
        if "the one error type" in (ast.get_docstring(tree) or "").lower()
    ]
    assert claims == [PACKAGE / "contracts" / "errors.py"]


def _bad(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, the line's start) of bad input to every command."""
    missing, run = str(tmp / "missing"), str(tmp / "run")
    return [
        (["train", "--run-dir", run, "--batch-size", "0"], "train: error: --batch-size: "),
        (["train", "--run-dir", run, "--epochs", "x"], "train: error: --epochs: "),
        (["sweep", "--nodes", "1", "--backend", "bogus"], "sweep: error: --backend: "),
        (["sweep", "--nodes", "0", "--sweep-dir", str(tmp / "s")], "sweep: error: nodes: "),
        (["status", missing], "status: error: SWEEP_DIR: "),
        (["resume", missing], "resume: error: SWEEP_DIR: "),
        (["cancel", missing], "cancel: error: SWEEP_DIR: "),
        (["sweep", "status", missing], "status: error: SWEEP_DIR: "),  # the same command
        (["plan", "--ranks", "0"], "plan: error: --ranks: "),
        (["plan", "--batch-size", "x"], "plan: error: --batch-size: "),
        (["collect", missing], "collect: error: SWEEP_DIR: "),
        (["report", missing], "report: error: SWEEP_DIR: "),
        (["report", "--target-accuracy", "2", missing], "report: error: --target-accuracy: "),
        (["checkpoint", "verify", missing], "checkpoint verify: error: PATH: "),
        (["checkpoint", "inspect", ""], "checkpoint inspect: error: PATH: "),
        (["doctor", "--bogus"], "doctor: error: --bogus: no such option"),
    ]


def test_every_command_says_bad_input_in_one_line_and_exits_2(tmp_path: Path) -> None:
    for argv, start in _bad(tmp_path):
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 2, (argv, result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kfac-hpc {start}"), (argv, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_library_default_reaches_a_plain_constructor() -> None:
    """What a user gets from ``KFACPreconditioner(model)`` is the table's library default."""
    pre = KFACPreconditioner(nn.Linear(2, 2))
    assert pre.options.value("damping", 0) == library_default("damping")
    assert pre.options.value("inv_update_steps", 0) == library_default("inv_update_steps")
    model = nn.Linear(8, 2)  # more parameters than the default k + l
    fosi = FOSI(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert fosi.options.k == library_default("fosi_k") and fosi.options.hvp == "auto"
