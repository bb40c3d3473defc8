"""Scrapy's development commands (``scrapy fetch``, ``shell``, ...) run without the add-on,
however the ``scrapy`` tool is started: the console script, ``python -m scrapy`` or
``python -m scrapy.cmdline`` (how Scrapy's own tests run it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE_PROJECT
from local_site import LocalSite

from scrapy_idempotent.addon import development_command


@pytest.mark.parametrize("module", ["scrapy", "scrapy.cmdline"])
def test_fetch_runs_without_the_addon(module: str, shop: LocalSite, tmp_path: Path) -> None:
    db_path = tmp_path / "frontier.sqlite3"
    done = subprocess.run(
        [sys.executable, "-m", module, "fetch",
         "-s", "LOG_LEVEL=INFO", "-s", f"IDEMPOTENT_DATABASE={db_path}", shop.url + "/"],
        cwd=EXAMPLE_PROJECT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "scrapy_idempotent is off for `scrapy fetch`" in done.stderr
    assert "<html" in done.stdout.lower()  # the page was fetched and printed
    assert not db_path.exists()  # the crawl's database was neither created nor written


@pytest.mark.parametrize(("argv", "command"), [
    (["scrapy", "crawl", "shop"], None),
    (["/usr/bin/scrapy", "runspider", "spider.py"], None),
    (["scrapy", "crawl", "-s", "X=1", "shop"], None),
    (["scrapy", "savefixture", "shop.pages.ProductPage", "https://shop.example/p/1"],
     "savefixture"),
    (["scrapy.cmdline", "shell", "https://shop.example/"], "shell"),
    (["scrapy", "bench"], "bench"),
    (["scrapyd.runner", "crawl", "shop"], None),
    (["myscript.py"], None),
])
def test_only_crawl_commands_of_the_scrapy_tool_get_the_addon(argv, command):
    """A plugin's command running spiders for a developer (scrapy-poet's savefixture) is
    not a crawl: what a command is decides, not a list of Scrapy's own commands."""
    assert development_command(argv) == command
