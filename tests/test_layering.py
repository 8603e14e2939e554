"""The layers of the package and the one direction of their imports (docs/contracts.md).

``BELOW`` and ``BOTTOM`` are the stack of docs/contracts.md, written once: a layer imports its
own modules, the layers below it on its branch (and what those import), and the bottom layers;
``cli_errors`` imports ``contracts``, and ``contracts`` nothing of the package. Every import
counts: at the top of a module, inside a function, under ``TYPE_CHECKING``, and a module named
in a string (``"kfac_hpc.x.y:attr"``: the command table of ``cli.py``, the sweep's backends).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "contracts.md"

# Each layer's files, as paths from the checkout's root; a folder holds everything under it.
LAYERS: dict[str, tuple[str, ...]] = {
    "cli": ("kfac_hpc/cli.py", "kfac_hpc/__main__.py", "kfac_hpc/__init__.py"),
    "sweep": ("kfac_hpc/sweep/", "workflows/"),
    "analysis": ("kfac_hpc/analysis/",),
    "plan": ("kfac_hpc/plan/",),
    "train": ("kfac_hpc/train/",),
    "checkpoint": ("kfac_hpc/checkpoint/",),
    "optim": ("kfac_hpc/optim/",),
    "comm": ("kfac_hpc/comm/",),
    "runtime": ("kfac_hpc/runtime/",),
    "cli_errors": ("kfac_hpc/cli_errors.py",),
    "contracts": ("kfac_hpc/contracts/",),
}

# The tree of the stack: each layer and the layers right below it.
BELOW: dict[str, tuple[str, ...]] = {
    "cli": ("sweep", "plan"),
    "sweep": ("analysis",),  # the workflow collects and reports when the sweep ends
    "analysis": (),
    "plan": ("train",),  # the cost model builds the job's models to count and time their layers
    "train": ("checkpoint", "optim"),
    "checkpoint": (),
    "optim": ("comm",),
    "comm": ("runtime",),
    "runtime": (),
}
# Under every layer, top to bottom: each imports only those after it.
BOTTOM = ("cli_errors", "contracts")

# Layers that never import torch, nor anything that does.
TORCH_FREE = ("sweep", "analysis", "cli_errors", "contracts")

# Imports against the direction, known and to be removed: module -> (layer it imports, why).
KNOWN_EXCEPTIONS: dict[str, tuple[str, str]] = {
    # The sweep checks each point with the job's own flag parser and config validation, and
    # builds its dataset and model before submitting: through one seam,
    # kfac_hpc.train.launch_checks, named in a string and imported lazily (the job's checks
    # need torch, which the sweep never loads at import).
    "kfac_hpc.sweep.job_checks": ("train", "runs the job's own checks before submitting"),
}

# ``from kfac_hpc import __version__`` reads a constant of the package's __init__, not the cli.
_ANYONE_MAY_IMPORT = {("kfac_hpc", "__version__")}
_NAMED = re.compile(r"kfac_hpc(?:\.\w+)+(?::\w+)?")


def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[0] == "workflows":  # installed as kfac_hpc.workflows (kfac_hpc/workflows links it)
        parts.insert(0, "kfac_hpc")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _files() -> dict[str, str]:
    """Module name -> path from the checkout's root, for every module of the package."""
    paths = [*(ROOT / "kfac_hpc").rglob("*.py"), *(ROOT / "workflows").rglob("*.py")]
    rel = [p.relative_to(ROOT).as_posix() for p in paths]
    return {_module_name(r): r for r in sorted(rel)}


def _layer(module: str) -> str:
    path = _files()[module]
    found = [
        name
        for name, held in LAYERS.items()
        for h in held
        if path == h or (h.endswith("/") and path.startswith(h))
    ]
    assert len(found) == 1, f"{path} is in {found or 'no layer'}: place it in LAYERS"
    return found[0]


def _allowed(layer: str) -> set[str]:
    """The layers ``layer`` may import: its own, those below it, and the bottom ones after it."""
    if layer in BOTTOM:
        return set(BOTTOM[BOTTOM.index(layer) :])
    allowed = {layer, *BOTTOM}
    for child in BELOW[layer]:
        allowed |= _allowed(child)
    return allowed


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The names ``node`` imports: modules, or a module and the name it takes from it."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        source = node.module or ""
        if node.level:  # relative: from the package holding ``module``, ``level - 1`` up
            parts = module.split(".")[: None if is_package else -1]
            parts = parts[: len(parts) - node.level + 1]
            source = ".".join([*parts, *([node.module] if node.module else [])])
        for alias in node.names:
            if (source, alias.name) not in _ANYONE_MAY_IMPORT:
                yield f"{source}.{alias.name}"
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        # a module named to be imported later; not a data package (``kfac_hpc.templates``)
        named = node.value.partition(":")[0]
        if _NAMED.fullmatch(node.value) and named in _files():
            yield named


def _package_module(name: str) -> str | None:
    """``name`` if it is a module of the package, else its nearest enclosing one."""
    while name and name not in _files():
        name = name.rpartition(".")[0]
    return name if name.startswith("kfac_hpc") else None


@cache
def _edges() -> list[tuple[str, str, str, int]]:
    """(importing module, imported module, path, line) for every import within the package."""
    edges: set[tuple[str, str, str, int]] = set()
    for module, path in _files().items():
        tree = ast.parse((ROOT / path).read_text(), path)
        for node in ast.walk(tree):
            for name in _imported(node, module, path.endswith("__init__.py")):
                target = _package_module(name) if name.startswith("kfac_hpc") else None
                if target and target != module:
                    edges.add((module, target, path, getattr(node, "lineno", 0)))
    return sorted(edges)


def _torch_imports() -> list[tuple[str, str, int]]:
    found = []
    for module, path in _files().items():
        for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                found.append((module, path, node.lineno))
    return found


def test_every_module_is_in_one_layer() -> None:
    for module in _files():
        _layer(module)
    assert set(LAYERS) == set(BELOW) | set(BOTTOM)


def test_every_import_flows_down() -> None:
    wrong = [
        f"{path}:{line}: {importer} ({_layer(importer)}) imports {target} ({_layer(target)})"
        for importer, target, path, line in _edges()
        if _layer(target) not in _allowed(_layer(importer))
        and KNOWN_EXCEPTIONS.get(importer, ("",))[0] != _layer(target)
    ]
    assert not wrong, "imports against docs/contracts.md's stack:\n" + "\n".join(wrong)


def test_every_known_exception_is_still_needed() -> None:
    for module, (layer, why) in KNOWN_EXCEPTIONS.items():
        assert module in _files(), f"{module} is gone: remove it from KNOWN_EXCEPTIONS"
        assert layer not in _allowed(_layer(module)), f"{module} -> {layer} is allowed now"
        used = {_layer(t) for i, t, _, _ in _edges() if i == module}
        assert layer in used, f"{module} no longer imports {layer} ({why}): remove the exception"


def test_the_stack_has_no_cycle_and_the_torch_free_layers_import_none() -> None:
    for layer in LAYERS:
        below = _allowed(layer) - {layer}
        assert not any(layer in _allowed(other) for other in below), layer
    for layer in TORCH_FREE:
        assert _allowed(layer) <= set(TORCH_FREE), f"{layer} may import a layer that uses torch"
    direct = [f"{p}:{n}" for m, p, n in _torch_imports() if _layer(m) in TORCH_FREE]
    assert not direct, f"torch imported by a torch-free layer ({TORCH_FREE}): {direct}"


@pytest.mark.parametrize("layer", [*TORCH_FREE, "cli"])
def test_importing_a_layer_loads_no_torch_and_no_layer_above(layer: str) -> None:
    """What really loads: ``kfac-hpc --help``, the analysis tools and the sweep stay torch-free."""
    modules = [m for m in _files() if _layer(m) == layer and m != "kfac_hpc.__main__"]
    allowed = _allowed(layer) | {
        exc_layer for m, (exc_layer, _) in KNOWN_EXCEPTIONS.items() if _layer(m) == layer
    }
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kfac_hpc', 'torch')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] == "torch"], f"{layer} loads torch"
    wrong = [m for m in loaded if m != "kfac_hpc" and _layer(m) not in allowed]
    assert not wrong, f"importing {layer} loads {wrong}"


def _picture() -> list[tuple[int, str, str]]:
    """(column, layer, rest of the line) for each line of the stack in docs/contracts.md."""
    text = DOC.read_text()
    block = text.split("The stack", 1)[1].split("```", 2)[1]
    rows = []
    for line in block.splitlines():
        match = re.fullmatch(r"(?P<tree>[ │├└─]*)(?P<name>[a-z_]+) +(?P<rest>kfac_hpc/.*)", line)
        if match:
            rows.append((len(match["tree"]), match["name"], match["rest"]))
    return rows


def test_the_docs_picture_is_the_stack_the_tests_hold() -> None:
    rows = _picture()
    assert sorted(name for _, name, _ in rows) == sorted(LAYERS), "one line per layer"
    below: dict[str, list[str]] = {}
    parents: list[tuple[int, str]] = []
    roots = []
    for column, name, rest in rows:
        for path in LAYERS[name]:
            piece = Path(path).name + ("/" if path.endswith("/") else "")
            assert piece in rest, f"docs/contracts.md's line of {name} omits {path}"
        while parents and parents[-1][0] >= column:
            parents.pop()
        if parents:
            below.setdefault(parents[-1][1], []).append(name)
        else:
            roots.append(name)
        parents.append((column, name))
    assert roots[1:] == list(BOTTOM), "the bottom layers close the picture, in order"
    tree = {layer: tuple(below.get(layer, ())) for layer in BELOW}
    assert tree == BELOW
