"""Rules of the repository's own text: nothing cites an issue number or a file outside the
repository, and the tests crawl one local site (``local_site.py``) and start no HTTP server of
their own."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
#: Where the repository's text lives (generated and downloaded folders are left out).
TEXT_ROOTS = ("scrapy_idempotent", "tests", "benchmarks", "example_project", "compat", ".ci",
              "docs")
TEXT_FILES = ("README.md", "CHANGELOG.md", "setup.cfg", "pyproject.toml")
SUFFIXES = {".py", ".md", ".rst", ".txt", ".cfg", ".toml", ".sh", ""}
SKIPPED_PARTS = {".cache", "__pycache__", ".matrix", ".hypothesis", "_build"}

#: A tracker reference (a repository or project name, a hash sign and a number), the words
#: issue or pull request followed by a number, and the team's own notes documents, which are not
#: in the repository.
OUTSIDE_REFERENCE = re.compile(
    r"\b[A-Za-z][\w.-]*#\d+\b"
    r"|(?i:\b(?:issue|pull request)s?\s+#?\d+)"
    r"|\b(?:shared|notes)/[\w.-]+\.md\b|\bcases\.md\b|\bDESIGN\.md\b|\bSTYLE\.md\b"
)
#: What starting an HTTP server of one's own looks like in a test module.
OWN_SERVER = re.compile(r"\bhttp\.server\b|\bHTTPServer\b|\bShopSite\b")
#: Modules not moved to the local site yet, with why.
NOT_YET_MOVED: dict[str, str] = {}


def repository_text_files() -> list[Path]:
    files = [ROOT / name for name in TEXT_FILES if (ROOT / name).is_file()]
    for top in TEXT_ROOTS:
        for path in sorted((ROOT / top).rglob("*")):
            if (path.is_file() and path.suffix in SUFFIXES
                    and not SKIPPED_PARTS.intersection(path.relative_to(ROOT).parts)
                    and ".egg-info" not in str(path)):
                files.append(path)
    return files


def test_no_reference_to_issue_numbers_or_files_outside_the_repository() -> None:
    files = repository_text_files()
    assert ROOT / "README.md" in files and Path(__file__) in files
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace")
                                      .splitlines(), 1)
        for match in OUTSIDE_REFERENCE.finditer(line)
        if path != Path(__file__)
    ]
    assert not found, "references outside the repository:\n" + "\n".join(found)


def test_tests_crawl_the_one_local_site() -> None:
    """Every test module uses ``local_site.LocalSite`` (fixtures ``shop`` and ``site``): none
    starts an HTTP server of its own, or the example project's demo shop."""
    modules = sorted(TESTS.glob("*.py"))
    assert TESTS / "local_site.py" in modules
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in modules
        if path.name not in ("local_site.py", Path(__file__).name, *NOT_YET_MOVED)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OWN_SERVER.search(line)
    ]
    assert not found, "test modules with an HTTP server of their own:\n" + "\n".join(found)
