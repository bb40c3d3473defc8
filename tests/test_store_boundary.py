"""The store boundary holds no backend: only the SQLite backend's modules import ``sqlite3``,
and only the registry constructs a backend's store; everything else goes through
``scrapy_idempotent.store.open_store`` and the :class:`~.FrontierStore` interface."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scrapy_idempotent"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, or imports a name from (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_only_the_sqlite_backend_imports_sqlite3_or_builds_its_store() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith("store/sqlite"):  # the backend and its parts (sqlite_*.py)
            continue
        # keys.py spills its start-request rank counts to a scratch file of its own (removed
        # at close), never the frontier: sqlite3 as a data structure, not a store
        scratch = name == "keys.py"
        imports = imported_modules(path)
        leaks = sorted(m for m in imports
                       if not scratch and (m == "sqlite3" or m.startswith("sqlite3.")))
        if name not in ("store/__init__.py",):  # the public SQLiteStore export
            leaks += sorted(m for m in imports
                            if m.startswith("scrapy_idempotent.store.sqlite"))
        if leaks:
            offenders[name] = leaks
    assert offenders == {}
