"""Every module and class of the package stays small enough for a reader to hold: no module
over :data:`MODULE_LINES` lines, no class over :data:`CLASS_LINES`. A part that grows past
its bound is split by concern (as the store is: ``sql_*.py``, ``sqlite_*.py`` and
``postgresql_*.py`` are parts mixed into the backends' classes)."""

from __future__ import annotations

import ast
from pathlib import Path

import scrapy_idempotent

PACKAGE = Path(scrapy_idempotent.__file__).parent
MODULE_LINES = 900
CLASS_LINES = 600


def oversize(package: Path = PACKAGE) -> list[str]:
    """``path: N lines`` of each module over :data:`MODULE_LINES`, ``path:LINE class Name: N
    lines`` of each class (nested ones too) over :data:`CLASS_LINES`."""
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(package.parent).as_posix()
        lines = len(source.splitlines())
        if lines > MODULE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                size = (node.end_lineno or node.lineno) - start + 1
                if size > CLASS_LINES:
                    found.append(f"{name}:{node.lineno} class {node.name}: {size} lines")
    return found


def test_no_module_or_class_over_its_bound() -> None:
    found = oversize()
    assert not found, (f"over {MODULE_LINES} lines a module, {CLASS_LINES} a class (split it "
                       "by concern):\n" + "\n".join(found))


def _class(name: str, lines: int, indent: str = "") -> str:
    """A class of ``lines`` lines (its ``class`` line included)."""
    return f"{indent}class {name}:\n" + "".join(f"{indent}    x{i} = {i}\n"
                                                 for i in range(lines - 1))


def test_the_bounds_are_read_from_every_module_and_class(tmp_path: Path) -> None:
    """Modules in sub-packages, classes nested in functions; a bound itself is allowed."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "at_bounds.py").write_text(
        _class("Held", CLASS_LINES) + "\n" * (MODULE_LINES - CLASS_LINES))
    (package / "sub" / "over.py").write_text(
        "def make() -> None:\n" + _class("Inner", CLASS_LINES + 1, "    ")
        + _class("Big", CLASS_LINES + 1))
    assert oversize(package) == [
        f"pkg/sub/over.py: {2 * CLASS_LINES + 3} lines",
        f"pkg/sub/over.py:{CLASS_LINES + 3} class Big: {CLASS_LINES + 1} lines",
        f"pkg/sub/over.py:2 class Inner: {CLASS_LINES + 1} lines",
    ]
