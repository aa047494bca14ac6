"""Imports point one way: `benchmarks -> serving -> jaxlora -> pallas_kernels`, and `jaxlora`'s
subpackages form no cycle, with the CLI on top.

What counts as an import, read from the source with `ast` (nothing is imported here):
- every `import x` and `from x import y` anywhere in a file: at module level, inside functions, under
  `if TYPE_CHECKING:`; `from pkg import name` also counts as importing `pkg.name` when that is a module;
- a call `importlib.import_module("x")` (or `import_module("x")`) with a literal name.
A package may import only the packages before it in `PACKAGES`, and none imports `tests`. The `jaxlora` package does not even hold a string naming a
module of `serving` or `benchmarks`: `jaxlora serve`, `client` and `bench` reach them through the
`jaxlora.commands` entry points that pyproject.toml declares. Inside `jaxlora`, a node is one direct
child (`jaxlora.engine`, `jaxlora.tokenizer`, ...); the edges between nodes must not form a cycle,
and nothing imports `jaxlora.cli` (the commands are on top).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each package may import the packages before it, never one after it (nor `tests`).
PACKAGES = ("pallas_kernels", "jaxlora", "serving", "benchmarks")
TOP_OF_JAXLORA = "jaxlora.cli"  # the commands: above every other part of jaxlora


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module that holds the import
    imported: str  # dotted module it names
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _import_module_target(node: ast.Call) -> str | None:
    """The literal name of an `importlib.import_module("x")` / `import_module("x")` call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def file_imports(root: Path, path: Path, known_modules: set[str]) -> list[Import]:
    """Every import in one file (module level and nested), as absolute module names."""
    importer = module_name(root, path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(importer, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = (
                _resolve_relative(importer, is_package, node.level, node.module) if node.level else node.module or ""
            )
            found.append(Import(importer, module, node.lineno))
            found += [
                Import(importer, f"{module}.{alias.name}", node.lineno)
                for alias in node.names
                if f"{module}.{alias.name}" in known_modules
            ]
        elif isinstance(node, ast.Call) and (target := _import_module_target(node)) is not None:
            found.append(Import(importer, target, node.lineno))
    return found


def project_imports(root: Path, packages: Iterable[str]) -> list[Import]:
    """Every import in the .py files under root/<package> for each package."""
    files = [f for p in packages for f in sorted((root / p).rglob("*.py"))]
    known = {module_name(root, f) for f in files}
    return [imp for f in files for imp in file_imports(root, f, known)]


def _top(module: str) -> str:
    return module.split(".")[0]


def wrong_way_imports(
    imports: Iterable[Import], order: tuple[str, ...], allowed: set[tuple[str, str]] = frozenset()
) -> list[Import]:
    """Imports from a package of `order` to itself-or-earlier are fine; one to a later package in
    `order`, or to `tests`, is returned unless (importer, imported) is in `allowed`."""
    rank = {p: i for i, p in enumerate(order)}
    bad = []
    for imp in imports:
        src, dst = _top(imp.importer), _top(imp.imported)
        wrong = dst == "tests" or (dst in rank and rank[dst] > rank[src])
        if src in rank and wrong and (imp.importer, imp.imported) not in allowed:
            bad.append(imp)
    return bad


def module_name_strings(root: Path, package: str, named: set[str]) -> list[str]:
    """`file:line 'text'` for every string literal in `package` equal to one of `named` (module
    names): a module reached by `importlib.import_module(variable)` still shows up here."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.split(":")[0]  # "module:attribute", as entry points write it
                if text in named:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
    return found


def subpackage(module: str, package: str) -> str | None:
    """`package.child` for a module inside `package` (the package itself: None)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == package and len(parts) > 1 else None


def subpackage_edges(imports: Iterable[Import], package: str) -> dict[tuple[str, str], list[Import]]:
    """(importer child, imported child) -> the imports behind that edge, between different children."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        src, dst = subpackage(imp.importer, package), subpackage(imp.imported, package)
        if src and dst and src != dst:
            edges.setdefault((src, dst), []).append(imp)
    return edges


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe_cycle(component: list[str], edges: dict[tuple[str, str], list[Import]]) -> str:
    inside = [imps[0] for (a, b), imps in sorted(edges.items()) if a in component and b in component]
    return f"cycle between {', '.join(component)}: " + "; ".join(map(str, inside))


# The project.


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return project_imports(ROOT, PACKAGES)


def test_packages_import_one_way(imports):
    bad = wrong_way_imports(imports, PACKAGES)
    assert not bad, "imports against " + " -> ".join(reversed(PACKAGES)) + ":\n" + "\n".join(map(str, bad))


def test_jaxlora_names_no_module_of_serving_or_benchmarks():
    later = {module_name(ROOT, f) for p in ("serving", "benchmarks") for f in (ROOT / p).rglob("*.py")}
    assert "serving.cli" in later and "benchmarks.engine.e2e" in later
    found = module_name_strings(ROOT, "jaxlora", later)
    assert not found, "\n".join(found)


def test_jaxlora_subpackages_have_no_cycle(imports):
    edges = subpackage_edges(imports, "jaxlora")
    found = cycles(edges)
    assert not found, "\n".join(describe_cycle(c, edges) for c in found)


def test_nothing_in_jaxlora_imports_the_cli(imports):
    bad = [imp for imp in imports if imp.imported.startswith(TOP_OF_JAXLORA) and subpackage(imp.importer, "jaxlora")]
    bad = [imp for imp in bad if subpackage(imp.importer, "jaxlora") != TOP_OF_JAXLORA]
    assert not bad, "\n".join(map(str, bad))


# The kernel choice is read by the model and the engine, so it may lean on nothing of jaxlora but
# the plain config records.
GROUND_FLOOR = {"jaxlora.kernels": {"jaxlora.config"}}


def test_ground_floor_modules_import_nothing_above_them(imports):
    for module, allowed in GROUND_FLOOR.items():
        above = [
            imp
            for imp in imports
            if imp.importer == module and _top(imp.imported) == "jaxlora" and imp.imported not in allowed
        ]
        assert not above, "\n".join(map(str, above))
    seen = {(imp.importer, imp.imported) for imp in imports}
    assert ("jaxlora.kernels", "jaxlora.config") in seen and ("jaxlora.engine.runner", "jaxlora.kernels") in seen


def test_the_scan_sees_the_project(imports):
    """The checks above are vacuous if the scan finds nothing: it must see known edges of each kind."""
    seen = {(imp.importer, imp.imported) for imp in imports}
    assert ("jaxlora.lora.apply", "pallas_kernels") in seen  # module level
    assert ("jaxlora.engine.engine", "jaxlora.engine.runner") in seen
    assert any(_top(a) == "serving" and _top(b) == "jaxlora" for a, b in seen)
    assert any(_top(a) == "benchmarks" and _top(b) == "jaxlora" for a, b in seen)


# The checker itself, on planted trees.


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_wrong_way_import_inside_a_function(tmp_path):
    root = _plant(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/k.py": "import numpy\n",
            "mid/__init__.py": "",
            "mid/a.py": "from low import k\n",
            "mid/b.py": "def f():\n    from high.server import run\n    return run\n",
            "high/__init__.py": "",
            "high/server.py": "import mid.a\n",
        },
    )
    bad = wrong_way_imports(project_imports(root, ("low", "mid", "high")), ("low", "mid", "high"))
    assert [str(b) for b in bad] == ["mid.b:2 imports high.server"]


def test_checker_finds_module_names_in_strings(tmp_path):
    root = _plant(
        tmp_path,
        {
            "low/__init__.py": 'COMMANDS = {"serve": "high.cli:SERVE"}\nDOC = "high.cli is elsewhere"\n',
            "high/__init__.py": "",
            "high/cli.py": "",
        },
    )
    assert module_name_strings(root, "low", {"high", "high.cli"}) == ["low/__init__.py:1 'high.cli:SERVE'"]


def test_checker_finds_import_module_calls_and_imports_of_tests(tmp_path):
    root = _plant(
        tmp_path,
        {
            "low/__init__.py": "import importlib\nX = importlib.import_module('high')\n",
            "high/__init__.py": "from tests.helpers import f\n",
        },
    )
    imports = project_imports(root, ("low", "high"))
    bad = wrong_way_imports(imports, ("low", "high"))
    assert sorted(str(b) for b in bad) == ["high:1 imports tests.helpers", "low:2 imports high"]
    assert [str(b) for b in wrong_way_imports(imports, ("low", "high"), {("high", "tests.helpers")})] == [
        "low:2 imports high"
    ]


def test_checker_finds_a_subpackage_cycle_through_relative_and_type_checking_imports(tmp_path):
    root = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/model/__init__.py": "from .llama import Llama\n",
            "pkg/model/llama.py": "from ..parallel import layers\n",
            "pkg/parallel/__init__.py": "",
            "pkg/parallel/layers.py": "",
            "pkg/parallel/sharding.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.model.llama import Llama\n"
            ),
            "pkg/engine.py": "import pkg.model\nimport pkg.parallel.sharding\n",
        },
    )
    imports = project_imports(root, ("pkg",))
    edges = subpackage_edges(imports, "pkg")
    assert ("pkg.model", "pkg.parallel") in edges and ("pkg.parallel", "pkg.model") in edges
    assert cycles(edges) == [["pkg.model", "pkg.parallel"]]
    assert "pkg.model.llama:1 imports pkg.parallel" in describe_cycle(["pkg.model", "pkg.parallel"], edges)


def test_checker_passes_a_graph_without_cycles(tmp_path):
    root = _plant(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "import pkg.b\n",
            "pkg/b.py": "from pkg import c\n",
            "pkg/c.py": "",
        },
    )
    edges = subpackage_edges(project_imports(root, ("pkg",)), "pkg")
    assert set(edges) == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.c")}
    assert cycles(edges) == []


def module_edges(imports: Iterable[Import], known: set[str]) -> dict[tuple[str, str], list[Import]]:
    """(importer, imported) -> the imports behind it, between two different modules of the project; a
    name that is a package's attribute, not a module, counts as its package (`__init__`)."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        dst = imp.imported
        while dst and dst not in known:
            dst = dst.rpartition(".")[0]
        if dst and dst != imp.importer:
            edges.setdefault((imp.importer, dst), []).append(imp)
    return edges


def test_no_module_imports_itself_through_others(imports):
    """No circle between modules (serving.server <-> serving.http_server over their options, say):
    each module of a package can be read, and imported, before the ones that use it. A package's
    `__init__` re-exporting its children is the one allowed loop, package -> child -> package."""
    known = {module_name(ROOT, f) for p in PACKAGES for f in (ROOT / p).rglob("*.py")}
    edges = module_edges(imports, known)
    parent_loops = {(a, b) for a, b in edges if b.startswith(f"{a}.") or a.startswith(f"{b}.")}
    found = cycles(e for e in edges if e not in parent_loops)
    assert not found, "\n".join(describe_cycle(c, edges) for c in found)
