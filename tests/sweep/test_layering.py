"""The import direction inside the sweep and its workflows (docs/sweep.md, "Modules"): every
module imports only modules below it, with no cycle (the backend registry's names counted);
the backends drive the workflows, never the reverse, and never reach the commands; and the
sweep knows the job only through the contracts and one seam (sweep/job_checks.py).

Imports are read from the source: those at the top of a module and those inside functions
(a lazy import still makes a cycle); those under ``if TYPE_CHECKING:`` only name types.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import kfac_hpc
from kfac_hpc.sweep import backends
from kfac_hpc.sweep.job_checks import JOB_CHECKS, JobChecks

PACKAGE = Path(kfac_hpc.__file__).parent

# Bottom to top: a module imports only modules above it in this list.
ORDER = [
    "kfac_hpc.sweep",
    "kfac_hpc.sweep.errors",
    "kfac_hpc.sweep.safety",
    "kfac_hpc.sweep.slurm_commands",
    "kfac_hpc.sweep.spec",
    "kfac_hpc.sweep.profile",
    "kfac_hpc.sweep.train_args",
    "kfac_hpc.sweep.job_checks",
    "kfac_hpc.sweep.render",
    "kfac_hpc.sweep.manifest",
    "kfac_hpc.sweep.prepare",
    # the Parsl workflows that run points: below the backends that call them
    "kfac_hpc.workflows",
    "kfac_hpc.workflows.configs",
    "kfac_hpc.workflows.local",
    "kfac_hpc.workflows.pilot",
    "kfac_hpc.sweep.backends.base",
    "kfac_hpc.sweep.backends",
    "kfac_hpc.sweep.backends.slurm",
    "kfac_hpc.sweep.backends.local",
    "kfac_hpc.sweep.backends.pilot",
    "kfac_hpc.sweep.follow",
    "kfac_hpc.sweep.waiting",
    "kfac_hpc.sweep.progress_line",
    # the workflow of a whole sweep (submit, wait, report), started by the command
    "kfac_hpc.workflows.sweep_flow",
    "kfac_hpc.sweep.cli",
]
BACKENDS = "kfac_hpc.sweep.backends"
WORKFLOWS = "kfac_hpc.workflows"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, ast.Module]:
    # kfac_hpc/workflows is the link to the top-level workflows/ folder
    paths = [*(PACKAGE / "sweep").rglob("*.py"), *(PACKAGE / "workflows").glob("*.py")]
    return {_name(p): ast.parse(p.read_text(), str(p)) for p in paths}


SOURCES = _sources()


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``."""
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def _imports(tree: ast.Module) -> list[tuple[str, bool, bool]]:
    """(module imported, type only, at module level) of every import statement."""
    type_only = _type_only(tree)
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, functions) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{alias.name}"
                names.append(sub if sub in SOURCES else node.module)
        found += [(name, id(node) in type_only, id(node) not in lazy) for name in names]
    return found


def _edges(*, registry: bool) -> dict[str, set[str]]:
    """Module -> the modules of the sweep and its workflows it imports at run time."""
    edges = {
        name: {m for m, type_only, _ in _imports(tree) if m in SOURCES and not type_only} - {name}
        for name, tree in SOURCES.items()
    }
    if registry:  # the backend registry imports its backends by name
        edges[BACKENDS] |= {target.split(":")[0] for target in backends._REGISTRY.values()}
    return edges


def test_every_module_has_its_place_in_the_order():
    assert sorted(SOURCES) == sorted(ORDER), "place a new module in ORDER (and docs/sweep.md)"


def test_modules_import_only_modules_below_them():
    wrong = [
        f"{name} imports {target}"
        for name, targets in _edges(registry=False).items()
        for target in targets
        if ORDER.index(target) > ORDER.index(name)
    ]
    assert not wrong, wrong


def test_no_import_cycle():
    """Tarjan's strongly connected components, the registry's names counted as imports."""
    edges = _edges(registry=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_the_backends_drive_the_workflows_never_the_reverse():
    for name, tree in SOURCES.items():
        imported = {m for m, type_only, _ in _imports(tree) if not type_only}
        if name.startswith(WORKFLOWS):
            assert not {m for m in imported if m.startswith(BACKENDS)}, name
            assert "kfac_hpc.sweep.cli" not in imported, name
        if name.startswith(BACKENDS):
            above = {"kfac_hpc.sweep.cli", "kfac_hpc.sweep.follow", "kfac_hpc.sweep.waiting"}
            assert not imported & above, (name, imported & above)
            # a workflow (and Parsl) only when points run: never at import time
            at_top = {m for m, type_only, top in _imports(tree) if top and not type_only}
            assert not {m for m in at_top if m.startswith(WORKFLOWS)}, name


def test_the_sweep_knows_the_job_through_contracts_and_one_seam():
    """No import of kfac_hpc.train; its one module name in code is the seam's."""
    named: dict[str, list[str]] = {}
    for name, tree in SOURCES.items():
        assert not [m for m, *_ in _imports(tree) if m.startswith("kfac_hpc.train")], name
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("kfac_hpc.train")
                and id(node) not in docstrings
            ):
                named.setdefault(name, []).append(node.value)
    assert named == {"kfac_hpc.sweep.job_checks": [JOB_CHECKS]}
    seam = importlib.import_module(JOB_CHECKS)
    for member in (*JobChecks.__annotations__, "check_train_args", "check_loadable"):
        assert hasattr(seam, member), member


def test_the_sweep_and_its_backends_import_no_train_torch_or_parsl():
    """`status`, `resume`, `cancel` and a dry run load neither the job nor Parsl: the job's
    seam when points are checked, a workflow when points run."""
    code = (
        "import sys\n"
        "import kfac_hpc.sweep.cli, kfac_hpc.sweep.prepare, kfac_hpc.sweep.waiting\n"
        "import kfac_hpc.sweep.backends.slurm, kfac_hpc.sweep.backends.local\n"
        "import kfac_hpc.sweep.backends.pilot\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'parsl')\n"
        "             or m.startswith(('kfac_hpc.train', 'kfac_hpc.workflows'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _one_edit_apart(a: str, b: str) -> bool:
    """One letter added, removed or changed."""
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return len(long) - len(short) == 1 and any(
        long[:i] + long[i + 1 :] == short for i in range(len(long))
    )


def test_no_two_module_names_differ_by_a_letter_or_a_plural():
    for package in ("kfac_hpc.sweep", BACKENDS, WORKFLOWS):
        names = sorted(
            n.rsplit(".", 1)[1] for n in SOURCES if n.rsplit(".", 1)[0] == package and n != package
        )
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                plural = a.rstrip("s") == b.rstrip("s") or a.rstrip("es") == b.rstrip("es")
                assert not _one_edit_apart(a, b) and not plural, (package, a, b)
    assert _one_edit_apart("command", "commands") and _one_edit_apart("slurm", "slurn")
