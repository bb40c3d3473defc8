"""The package's modules stand on floors: each imports only modules below it, so no import
cycle runs through them, and none imports the package itself (its ``__init__`` imports them
all).

Every import statement counts: at module level, inside functions and methods, under ``if
TYPE_CHECKING`` (an import delayed into a function, or kept for the type checker, still ties
the two modules: it only hides the cycle from Python). Modules loaded by name through
``importlib`` (the store and queue registries) are not imports of a module's text, and are
not read.
"""

from __future__ import annotations

import ast
import shutil
from itertools import pairwise
from pathlib import Path

import scrapy_idempotent

PACKAGE = Path(scrapy_idempotent.__file__).parent

#: module -> {imported module: line of the first import of it}
Graph = dict[str, dict[str, int]]


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], package_dir: Path = PACKAGE) -> dict[str, int]:
    """The package's modules that ``path`` imports anywhere in its text, each with the line
    of its first import."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: set[str] = set()
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            named = {f"{target}.{alias.name}" for alias in node.names} & modules
            # ``from . import x`` imports module x; ``from .x import name`` imports x
            targets = named | ({target} & modules if len(named) < len(node.names) else set())
        elif isinstance(node, ast.Import):
            targets = {alias.name for alias in node.names} & modules
        for target in targets - {name}:
            found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def import_graph(package_dir: Path = PACKAGE) -> Graph:
    paths = {module_name(path, package_dir): path for path in package_dir.rglob("*.py")}
    return {name: imports_of(path, set(paths), package_dir) for name, path in paths.items()}


def cycles_of(graph: Graph) -> list[str]:
    """Each import cycle found by a walk of ``graph``, as ``a:LINE -> b:LINE -> a`` (the line
    of each module that imports the next)."""
    state: dict[str, str] = {}
    cycles: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                loop = [*path[path.index(target):], target]
                cycles.append(" -> ".join(
                    [f"{a}:{graph[a][b]}" for a, b in pairwise(loop)] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "closed"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_module_imports_the_package_itself() -> None:
    graph = import_graph()
    assert [name for name, imports in graph.items()
            if "scrapy_idempotent" in imports and name != "scrapy_idempotent"] == []


def test_no_import_cycle() -> None:
    cycles = cycles_of(import_graph())
    assert not cycles, "import cycles (module:line -> ...):\n" + "\n".join(cycles)


def test_every_import_is_read(tmp_path: Path) -> None:
    """Imports in functions, methods and under TYPE_CHECKING are read, absolute and
    relative, of modules and of names."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    for leaf in ("a", "b", "c", "d", "e"):
        (package / f"{leaf}.py").write_text("")
    (package / "sub" / "f.py").write_text("")
    (package / "top.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import a\n"
        "if TYPE_CHECKING:\n"
        "    from .b import Thing\n"
        "def run():\n"
        "    from pkg.c import other\n"
        "class Holder:\n"
        "    def method(self):\n"
        "        import pkg.d\n"
        "        from .sub.f import name\n"
        "        from .sub import f\n")
    assert import_graph(package)["pkg.top"] == {
        "pkg.a": 2, "pkg.b": 4, "pkg.c": 6, "pkg.d": 9, "pkg.sub.f": 10}


def test_a_planted_cycle_fails(tmp_path: Path) -> None:
    """A copy of the package with one import planted inside a function of a low module
    (the kind of import Python lets pass) shows the cycle it closes."""
    copy = tmp_path / "scrapy_idempotent"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cycles_of(import_graph(copy)) == []
    low = copy / "_order.py"
    low.write_text(low.read_text(encoding="utf-8")
                   + "\n\ndef _planted() -> None:\n    from .scheduler import worker\n",
                   encoding="utf-8")
    cycles = cycles_of(import_graph(copy))
    assert cycles, "the planted import closes no cycle"
    assert any(cycle.startswith("scrapy_idempotent._order:") and
               "scrapy_idempotent.scheduler:" in cycle for cycle in cycles), cycles
