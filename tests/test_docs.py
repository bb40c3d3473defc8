"""The docs site (``docs/``) documents every setting and every stat, and only those: the
settings reference is generated from the configuration's own definitions
(``SETTING_DEFINITIONS``), the stats reference is checked against the stats the package's
modules can set, and no page names a setting or a stat that does not exist."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from scrapy_idempotent import exceptions
from scrapy_idempotent.default_settings import SETTING_DEFINITIONS, SETTING_SECTIONS, SETTINGS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_idempotent"
DOCS = ROOT / "docs"
PAGES = {path.name: path.read_text(encoding="utf-8") for path in sorted(DOCS.glob("*.rst"))}
README = (ROOT / "README.md").read_text(encoding="utf-8")
sys.path.insert(0, str(DOCS / "_ext"))
from idempotent_docs import settings_reference  # noqa: E402

PREFIX = "idempotent/"
#: A constant that reads like the tail of a stat name (``requests/added``).
STAT_TAIL = re.compile(r"^[a-z_]+(/[a-z_]+)+$")


def documented_stats() -> set[str]:
    """The first column of the stats reference's table (``docs/stats.rst``: rows
    ``* - ``idempotent/...````)."""
    return set(re.findall(r"^   \* - ``(idempotent/[^`]+)``$", PAGES["stats.rst"], re.MULTILINE))


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


#: Names that look like settings and are not: the misspelling of the unknown-setting
#: warning's example, and the environment variable that rewrites the docs' samples.
NOT_SETTINGS = {"IDEMPOTENT_NATURAL_KEY", "IDEMPOTENT_UPDATE_SAMPLES"}
#: A setting's name in any text (``IDEMPOTENT_QUEUE_*``, a family, is not one).
SETTING_NAME = re.compile(r"\bIDEMPOTENT_[A-Z0-9_]*[A-Z0-9]\b(?!_?\*)")


def test_every_setting_is_in_the_reference() -> None:
    """The reference page renders the definitions, and the definitions are every setting."""
    assert ".. idempotent-settings::" in PAGES["settings.rst"]
    reference = "\n".join(settings_reference())
    targets = re.findall(r"^\.\. setting:: (\S+)$", reference, re.MULTILINE)
    assert sorted(targets) == sorted(SETTINGS), "settings missing from the reference"
    assert len(targets) == len(set(targets)) == len(SETTING_DEFINITIONS)


def test_every_setting_definition_is_complete() -> None:
    bad: dict[str, str] = {}
    for setting in SETTING_DEFINITIONS:
        if not setting.name.startswith("IDEMPOTENT_"):
            bad[setting.name] = "not an IDEMPOTENT_* name"
        elif setting.section not in SETTING_SECTIONS:
            bad[setting.name] = f"unknown section {setting.section!r}"
        elif not (setting.type.strip() and setting.doc.strip()):
            bad[setting.name] = "no type or no description"
        elif SETTINGS[setting.name] != setting.default:
            bad[setting.name] = "SETTINGS holds another default"
        else:
            try:
                ast.literal_eval(setting.example)
            except (ValueError, SyntaxError) as exc:
                bad[setting.name] = f"example {setting.example!r} is not a Python literal ({exc})"
    assert not bad, f"incomplete setting definitions in default_settings.py: {bad}"


def named_settings() -> dict[str, str]:
    """Every setting name the docs, the README and the definitions' texts mention, with where."""
    texts = {f"docs/{name}": text for name, text in PAGES.items()}
    texts["README.md"] = README
    texts.update({f"{s.name} (default_settings.py)": s.doc + s.default_text
                  for s in SETTING_DEFINITIONS})
    return {name: where for where, text in texts.items() for name in SETTING_NAME.findall(text)}


def test_the_docs_name_only_settings_that_exist() -> None:
    unknown = {name: where for name, where in named_settings().items()
               if name not in SETTINGS and name not in NOT_SETTINGS}
    assert not unknown, ("documented but not defined (default_settings.py "
                         f"SETTING_DEFINITIONS): {unknown}")
    assert "IDEMPOTENT_LEASE_SECONDS" in named_settings()  # the scan sees the pages


def test_every_stat_is_in_the_stats_reference() -> None:
    table = documented_stats()
    names, patterns = source_stats()
    assert "idempotent/requests/added" in names  # the collector sees through f"idempotent/{x}"
    assert any("failed" in p for p in patterns)  # and keeps f"idempotent/failed/{kind}"
    missing = {name: where for name, where in names.items() if name not in table}
    missing.update({
        pattern: where for pattern, where in patterns.items()
        if not any(re.fullmatch(pattern, stat) for stat in table)
    })
    assert not missing, f"stats missing from docs/stats.rst: {missing}"


def test_every_documented_stat_exists() -> None:
    """A row of the stats table names a stat the package sets (``<kind>`` stands for the
    placeholder of an f-string)."""
    names, patterns = source_stats()
    unknown = sorted(
        stat for stat in documented_stats() if stat not in names
        and not any(re.fullmatch(pattern, stat) for pattern in patterns))
    assert not unknown, f"stats in docs/stats.rst that no module sets: {unknown}"


@pytest.mark.parametrize("name", sorted(exceptions.__all__))
def test_troubleshooting_names_every_error(name: str) -> None:
    assert re.search(rf"``(scrapy_idempotent\.)?{name}``", PAGES["troubleshooting.rst"]), (
        f"{name} is not explained in docs/troubleshooting.rst")


def package_trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8"))
            for path in sorted(PACKAGE.rglob("*.py"))}


def live_nodes(trees: dict[Path, ast.Module]) -> dict[int, ast.AST]:
    """The nodes of ``trees`` (by id) outside functions that nothing names yet (a function
    defined ahead of the change that calls it reads nothing)."""
    used = {node.id if isinstance(node, ast.Name) else node.attr
            for tree in trees.values() for node in ast.walk(tree)
            if isinstance(node, (ast.Name, ast.Attribute))}
    live: dict[int, ast.AST] = {}
    for tree in trees.values():
        scope: dict[int, str] = {}  # node -> the name of its innermost function
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    scope[id(node)] = function.name
        live.update({id(node): node for node in ast.walk(tree)
                     if id(node) not in scope or scope[id(node)] in used})
    return live


def test_every_setting_the_package_names_is_defined() -> None:
    """A setting read anywhere in the package (a string constant ``IDEMPOTENT_*`` outside a
    function that nothing calls yet) is defined, and so documented."""
    trees = package_trees()
    live = live_nodes(trees)
    read: dict[str, str] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"IDEMPOTENT_[A-Z0-9_]+", node.value) and id(node) in live):
                read.setdefault(node.value, f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert "IDEMPOTENT_DATABASE" in read
    undefined = {name: where for name, where in read.items() if name not in SETTINGS}
    assert not undefined, f"settings without a definition in SETTING_DEFINITIONS: {undefined}"


def _bound(node: ast.expr, names: dict[str, float]) -> float:
    """A ``minimum=``/``maximum=`` argument of a range check: a number, a constant of
    config.py (``_WEEK``) or arithmetic of those (``10 * _YEAR``)."""
    return float(eval(compile(ast.Expression(node), "config.py", "eval"), {}, dict(names)))


def test_the_documented_ranges_are_the_checked_ones() -> None:
    """Each range check of config.py (``_number(settings, "NAME", minimum=..., maximum=...)``)
    names bounds that the setting's ``allowed`` text states."""
    from scrapy_idempotent import config

    names = {name: value for name, value in vars(config).items()
             if isinstance(value, (int, float)) and not isinstance(value, bool)}
    trees = package_trees()
    live = live_nodes(trees)
    tree = trees[PACKAGE / "config.py"]
    allowed = {setting.name: setting.allowed for setting in SETTING_DEFINITIONS}
    checked, bad = 0, {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == "_number" and len(call.args) >= 2
                and isinstance(call.args[1], ast.Constant) and id(call) in live):
            continue
        name = call.args[1].value
        for keyword in call.keywords:
            if keyword.arg in ("minimum", "maximum"):
                value = _bound(keyword.value, names)
                shown = f"{value:.15g}"
                checked += 1
                if not re.search(rf"(?<![\d.]){re.escape(shown)}(?![\d.])", allowed.get(name, "")):
                    bad[f"{name} {keyword.arg}"] = f"{shown} not in {allowed.get(name)!r}"
    assert checked > 20
    assert not bad, f"ranges checked in config.py but not in the settings' allowed text: {bad}"


def test_the_broker_example_is_the_tested_target() -> None:
    """The outbox page's Redis Streams target is the class the outbox tests deliver through
    (``tests/outbox_targets.py``), as written there."""
    tested = (ROOT / "tests" / "outbox_targets.py").read_text(encoding="utf-8")
    node = next(node for node in ast.parse(tested).body
                if isinstance(node, ast.ClassDef) and node.name == "RedisStreamTarget")
    source = ast.get_source_segment(tested, node)
    assert source is not None
    page = PAGES["outbox.rst"]
    block = page.split("   # myproject/targets.py\n", 1)[1].split("\n\n.. ", 1)[0]
    shown = "\n".join(line[3:] for line in block.splitlines())
    assert source in shown, "docs/outbox.rst's RedisStreamTarget differs from the tested one"


#: The README's two commands, which work from a fresh clone (CI runs both).
README_COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python "
    "example_project/demo.py",
    "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    " -n 3",
)


def test_the_readme_is_short_and_links_into_the_docs() -> None:
    assert len(README.splitlines()) <= 250
    for command in README_COMMANDS:
        assert f"\n{command}\n" in README
        assert f"\n   {command}\n" in PAGES["getting-started.rst"]
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    toctree = PAGES["index.rst"]
    unlinked = [name for name in PAGES if name != "index.rst"
                and f"docs/{name}" not in links]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    assert all(name[:-4] in toctree for name in PAGES if name != "index.rst")


def test_the_page_flow_picture_is_one() -> None:
    """The README's picture of a page's flow is the docs' (how-it-works.rst)."""
    readme = README.split("## How a page flows\n\n```text\n", 1)[1].split("\n```", 1)[0]
    page = PAGES["how-it-works.rst"].split(".. _page-flow:", 1)[1]
    block = page.split(".. code-block:: text\n\n", 1)[1].split("\n\n.. ", 1)[0]
    assert "\n".join(line[3:] for line in block.rstrip().splitlines()) == readme.rstrip()


#: Store messages that only a programming error produces (an API misused), not a user.
INTERNAL_MESSAGES = {"is already open", "cannot load rows of an unknown table",
                     "the store writer is not running",
                     "the frontier has no id yet: open the store first"}
#: The calls whose message a user meets: the package's errors (ConfigError has one form,
#: explained once) and Scrapy's at its boundary, and log lines of WARNING and above.
ERROR_CALLS = {"StoreError", "StoreBusy", "IdempotentError", "UnsupportedScrapy",
               "UnstorableRequest", "MissingNaturalKey", "DeliveryRefused", "CloseSpider",
               "DropItem", "UsageError"}
LOG_CALLS = {"warning", "error", "critical"}


def message_key(call: ast.Call) -> str:
    """The words that identify a message: the start of its longest fixed part (between the
    placeholders of an f-string or a %-format), without punctuation at its ends."""
    parts = [re.sub(r"\s+", " ", part).strip(" ;:)(,.")
             for node in call.args for constant in ast.walk(node)
             if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
             for part in re.split(r"%[-.\d]*[sdrgf]|scrapy_idempotent: ", constant.value)]
    return max(parts, key=len, default="")[:30]


def test_troubleshooting_explains_every_message() -> None:
    """Each message the package can raise or log at WARNING or above is quoted in
    docs/troubleshooting.rst (its longest fixed part), so a user who meets it finds what it
    means and what to do."""
    page = re.sub(r"\s+", " ", PAGES["troubleshooting.rst"]).replace("``", "")
    paths = sorted(PACKAGE.rglob("*.py"))
    missing: dict[str, str] = {}
    for path in paths:
        for call in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            raised = isinstance(func, ast.Name) and func.id in ERROR_CALLS
            logged = (isinstance(func, ast.Attribute) and func.attr in LOG_CALLS
                      and isinstance(func.value, ast.Name) and func.value.id == "logger")
            key = message_key(call) if raised or logged else ""
            if (len(key) >= 12 and key not in page
                    and key not in {message[:30] for message in INTERNAL_MESSAGES}):
                missing[f"{path.relative_to(PACKAGE)}:{call.lineno}"] = key
    assert len(missing) == 0, f"messages not explained in docs/troubleshooting.rst: {missing}"


def test_the_docs_use_no_api_roles() -> None:
    """The site has no API pages (no autodoc), so a Python-domain role (``:meth:``,
    ``:class:``...) cannot resolve and fails the ``-W`` build: name code as a literal."""
    found = {f"docs/{name}": role for name, text in PAGES.items()
             for role in re.findall(r":(?:py:)?(?:meth|class|func|mod|attr|exc|data):`", text)}
    assert not found, f"Python-domain roles in the docs (use ``literals``): {found}"


def test_the_install_commands_work_from_inside_the_clone() -> None:
    """``pip install <path>`` in the README and every docs page names a directory that is a
    project (it holds ``setup.cfg``) when run inside the clone: ``./scrapy_idempotent`` there
    is the package's own directory, which pip refuses."""
    texts = {"README.md": README, **PAGES}
    checked = 0
    for name, text in texts.items():
        for line in text.splitlines():
            match = re.match(r"\s*pip install (?:-e )?['\"]?([^\s'\"\[]+)", line)
            if match is None or not match.group(1).startswith("."):
                continue
            checked += 1
            assert (ROOT / match.group(1) / "setup.cfg").exists(), f"{name}: {line.strip()}"
    assert checked >= 3


@pytest.mark.parametrize("page", ["README.md", "getting-started.rst"])
def test_the_feeds_summary_says_local_feeds_stream(page: str) -> None:
    """On SQLite a local feed is written while the crawl runs (about every second), not
    only when a crawl process closes (docs/feeds.rst, ``STREAM_INTERVAL_SECONDS``)."""
    from scrapy_idempotent.feeds import STREAM_INTERVAL_SECONDS

    text = README if page == "README.md" else PAGES[page]
    start = text.index("**Feeds**")
    summary = re.sub(r"\s+", " ", text[start:text.index("\n*", start)])
    assert "while the crawl runs" in summary, summary
    assert STREAM_INTERVAL_SECONDS == 1.0 and "every second" in summary, summary
    assert "exit code 1" in summary, summary  # a feed that cannot be written is an error
