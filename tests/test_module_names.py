"""No two modules of one package have names a reader mixes up: one letter apart (an edit of one
character: added, removed or changed) or a word and its plural (``command``, ``commands``)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The package (workflows/ is installed as kfac_hpc.workflows) and the tests.
TREES = ("kfac_hpc", "workflows", "tests")


def _one_edit_apart(a: str, b: str) -> bool:
    if len(a) > len(b):
        a, b = b, a
    if len(b) - len(a) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    return any(b[:i] + b[i + 1 :] == a for i in range(len(b)))


def _plural(a: str, b: str) -> bool:
    def forms(word: str) -> set[str]:
        plurals = {word + "s", word + "es"}
        if word.endswith("y"):
            plurals.add(word[:-1] + "ies")
        return plurals

    return b in forms(a) or a in forms(b)


def confusable(a: str, b: str) -> bool:
    return _one_edit_apart(a, b) or _plural(a, b)


def _packages() -> list[Path]:
    dirs = [ROOT / tree for tree in TREES]
    dirs += [d for tree in TREES for d in (ROOT / tree).rglob("*") if d.is_dir()]
    # kfac_hpc/workflows links workflows/: each folder once
    unique = {d.resolve() for d in dirs if "__pycache__" not in d.parts and any(d.glob("*.py"))}
    return sorted(unique)


def _module_names(package: Path) -> list[str]:
    modules = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
    subpackages = [d.name for d in package.iterdir() if (d / "__init__.py").is_file()]
    return sorted(set(modules) | set(subpackages))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("command", "commands", True),
        ("backend", "backends", True),
        ("summary", "summaries", True),
        ("match", "matches", True),
        ("report", "reports", True),
        ("plots", "plot", True),
        ("spec", "spy", False),
        ("layer", "player", True),
        ("test_cli", "test_clip", True),
        ("files", "fila", False),
        ("cli", "cli_errors", False),
        ("factors", "factor_reduction", False),
        ("slurm", "slurm_commands", False),
    ],
)
def test_the_rule(a: str, b: str, expected: bool) -> None:
    assert confusable(a, b) is expected


def test_no_two_modules_of_a_package_are_one_letter_or_a_plural_apart() -> None:
    found = [
        f"{package.relative_to(ROOT)}: {a}, {b}"
        for package in _packages()
        for a, b in itertools.combinations(_module_names(package), 2)
        if confusable(a, b)
    ]
    assert not found, "module names a reader mixes up (rename one):\n" + "\n".join(found)
