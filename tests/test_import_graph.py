"""The package's modules import each other without a cycle (imports for type checking
aside), and none imports the package itself (its ``__init__`` imports them all)."""

from __future__ import annotations

import ast
from pathlib import Path

import scrapy_idempotent

PACKAGE = Path(scrapy_idempotent.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports when it is imported (module level, not under
    ``if TYPE_CHECKING``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = (".".join([*base, node.module] if node.module else base)
                          if node.level else node.module or "")
                names = {f"{target}.{alias.name}" for alias in node.names} & modules
                found.update(names or ({target} & modules))
            elif isinstance(node, ast.Import):
                found.update({alias.name for alias in node.names} & modules)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit([child for child in ast.iter_child_nodes(node)
                       if isinstance(child, ast.stmt)])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: runtime_imports(path, set(paths)) for name, path in paths.items()}


def test_no_module_imports_the_package_itself() -> None:
    graph = import_graph()
    assert [name for name, imports in graph.items()
            if "scrapy_idempotent" in imports and name != "scrapy_idempotent"] == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "closed"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_check_sees_a_cycle(tmp_path: Path) -> None:
    """The walk finds the imports that make a cycle (so the tests above can fail)."""
    module = PACKAGE / "scheduler.py"
    modules = set(import_graph())
    assert {"scrapy_idempotent.commits", "scrapy_idempotent.leases"} <= runtime_imports(
        module, modules)
    assert "scrapy_idempotent.scheduler" not in runtime_imports(PACKAGE / "commits.py", modules)
