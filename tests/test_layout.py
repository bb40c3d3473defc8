"""The layout of the tests: no test module imports another test module (at the top or inside a
function); what several test modules share lives in the ``helpers`` package (sites, crawls,
store access), in ``conftest.py`` (fixtures) or in the helper modules beside them."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def names_of_test_modules() -> set[str]:
    """The names of the test modules (``tests/test_*.py``), as they are imported."""
    return {path.stem for path in TESTS.glob("test_*.py")}


def imported_test_modules(source: str, tests: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import of one of ``tests`` in ``source``, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] in tests]
    return sorted(found)


def test_the_rule_sees_every_form_of_import() -> None:
    source = (
        "import os\n"
        "import test_a\n"
        "import test_b as b, json\n"
        "from test_c import thing\n"
        "from helpers.stores import rec\n"
        "from . import test_d\n"
        "def f():\n"
        "    from test_e import other\n"
        "    import test_f.sub\n"
    )
    tests = {"test_a", "test_b", "test_c", "test_d", "test_e", "test_f"}
    assert imported_test_modules(source, tests) == [
        (2, "test_a"), (3, "test_b"), (4, "test_c"), (8, "test_e"), (9, "test_f.sub")]


def test_no_test_module_imports_another_test_module() -> None:
    tests = names_of_test_modules()
    assert "test_layout" in tests and len(tests) > 100
    modules = sorted(TESTS.glob("*.py")) + sorted((TESTS / "helpers").glob("*.py"))
    found = [
        f"{path.relative_to(TESTS)}:{line}: imports {name}"
        for path in modules
        for line, name in imported_test_modules(path.read_text(encoding="utf-8"), tests)
    ]
    assert not found, ("test modules imported (move what they share to tests/helpers/, or a "
                       "fixture to conftest.py):\n" + "\n".join(found))
