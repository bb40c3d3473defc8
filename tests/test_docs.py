"""The README documents every setting (a ``### NAME`` heading with a one-line example) and
every stat the package can set (a row of the stats table)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from scrapy_idempotent.config import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_idempotent"
README = (ROOT / "README.md").read_text(encoding="utf-8")
PREFIX = "idempotent/"
#: A constant that reads like the tail of a stat name (``requests/added``).
STAT_TAIL = re.compile(r"^[a-z_]+(/[a-z_]+)+$")


def documented_stats() -> set[str]:
    """The first column of the table under ``## Stats``."""
    section = README.split("\n## Stats\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\|\s*`(idempotent/[^`]+)`\s*\|", section, re.MULTILINE))


def source_stats() -> tuple[dict[str, str], dict[str, str]]:
    """Stat names the package's modules can set, each with where it was found.

    Returns ``(names, patterns)``. ``names`` are literal strings starting with
    ``idempotent/``. An f-string starting with ``idempotent/`` (``f"idempotent/failed/{kind}"``)
    is a pattern whose placeholders stand for any text (the table documents it as
    ``idempotent/failed/<kind>``), except when its only placeholder ends it and the enclosing
    function holds constants that read like stat tails (``("requests/added", n)`` fed to
    ``f"idempotent/{name}"``): then each such constant makes a name.
    """
    names: dict[str, str] = {}
    patterns: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        in_fstrings = {id(value) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
                       for value in node.values}
        scopes: dict[int, ast.AST] = {}
        for scope in ast.walk(tree):
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(scope):
                    scopes[id(node)] = scope  # innermost function wins: walked last
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value.startswith(PREFIX) and id(node) not in in_fstrings):
                names[node.value] = where
            elif isinstance(node, ast.JoinedStr):
                parts = node.values
                if not (parts and isinstance(parts[0], ast.Constant)
                        and str(parts[0].value).startswith(PREFIX)):
                    continue
                scope = scopes.get(id(node))
                tails = sorted({
                    c.value for c in ast.walk(scope) if isinstance(c, ast.Constant)
                    and isinstance(c.value, str) and STAT_TAIL.match(c.value)
                    and not c.value.startswith(PREFIX)
                }) if scope is not None else []
                if len(parts) == 2 and isinstance(parts[1], ast.FormattedValue) and tails:
                    for tail in tails:
                        names[f"{parts[0].value}{tail}"] = where
                else:
                    patterns["".join(
                        re.escape(str(p.value)) if isinstance(p, ast.Constant) else ".+"
                        for p in parts)] = where
    return names, patterns


def test_every_setting_has_a_heading() -> None:
    headings = set(re.findall(r"^### (\w+)\s*$", README, re.MULTILINE))
    missing = sorted(set(SETTINGS) - headings)
    assert not missing, f"settings without a '### NAME' heading in README.md: {missing}"


def setting_section(name: str) -> str:
    """The text under ``### NAME``, up to the next heading."""
    found = re.search(rf"^### {name}\s*$\n(.*?)(?=^#{{1,3}} |\Z)", README,
                      re.MULTILINE | re.DOTALL)
    assert found is not None, f"no '### {name}' heading in README.md"
    return found.group(1)


def test_every_setting_has_a_one_line_example() -> None:
    """Each setting's section starts with ``Example: `NAME = value` `` (a Python literal, as
    written in ``settings.py``)."""
    bad: dict[str, str] = {}
    for name in sorted(SETTINGS):
        example = re.search(rf"^Example: `{name} = (.+)`$", setting_section(name), re.MULTILINE)
        if example is None:
            bad[name] = "no 'Example: `NAME = value`' line"
            continue
        try:
            ast.literal_eval(example.group(1))
        except (ValueError, SyntaxError) as exc:
            bad[name] = f"{example.group(1)!r} is not a Python literal ({exc})"
    assert not bad, f"settings without a valid one-line example in README.md: {bad}"


def test_every_stat_is_in_the_stats_table() -> None:
    table = documented_stats()
    names, patterns = source_stats()
    assert "idempotent/requests/added" in names  # the collector sees through f"idempotent/{x}"
    assert any("failed" in p for p in patterns)  # and keeps f"idempotent/failed/{kind}"
    missing = {name: where for name, where in names.items() if name not in table}
    missing.update({
        pattern: where for pattern, where in patterns.items()
        if not any(re.fullmatch(pattern, stat) for stat in table)
    })
    assert not missing, f"stats missing from the README's stats table: {missing}"
