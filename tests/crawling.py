"""Helpers for the tests: real crawls in this process and reads of frontier databases."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any


def crawl_settings(db_path: Path, **extra: Any) -> dict[str, Any]:
    """Settings of a real crawl with the add-on, quiet and fast."""
    settings: dict[str, Any] = {
        "ADDONS": {"scrapy_idempotent.Addon": 0},
        "IDEMPOTENT_DATABASE": str(db_path),
        "ROBOTSTXT_OBEY": False,
        "LOG_LEVEL": "WARNING",
        "CONCURRENT_REQUESTS": 16,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
        "MEMUSAGE_ENABLED": False,
        "RETRY_ENABLED": False,
        "TELNETCONSOLE_ENABLED": False,  # no fixed port range shared with other processes
    }
    settings.update(extra)
    return settings


async def run_crawl(spidercls: type, settings: dict[str, Any], **kwargs: Any) -> Any:
    """Run one real crawl in this process (Scrapy's engine, downloader, middlewares) and
    return the crawler, whose ``stats`` hold the result."""
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(spidercls, settings)
    await crawl_to_end(crawler, **kwargs)
    return crawler


async def crawl_to_end(crawler: Any, **kwargs: Any) -> None:
    """``await crawler.crawl_async(**kwargs)``: ``Crawler.crawl_async`` is new in Scrapy 2.14;
    on 2.13 the Deferred of ``Crawler.crawl`` is awaited instead."""
    crawl_async = getattr(crawler, "crawl_async", None)
    if crawl_async is not None:
        await crawl_async(**kwargs)
        return
    from scrapy.utils.defer import maybe_deferred_to_future

    await maybe_deferred_to_future(crawler.crawl(**kwargs))


def db_rows(db_path: Path, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db_path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def stored_products(db_path: Path) -> list[dict[str, Any]]:
    """Every record's data, as dicts."""
    return [json.loads(data) for (data,) in db_rows(db_path, "SELECT data FROM records")]


def frontier_counts(db_path: Path) -> dict[str, int]:
    return dict(db_rows(db_path, "SELECT state, count(*) FROM requests GROUP BY state"))


EXAMPLE_PROJECT = Path(__file__).resolve().parent.parent / "example_project"


def start_shop_crawl(site_url: str, db_path: Path, log_path: Path, *settings: str) -> Any:
    """``scrapy crawl shop`` of the example project in a subprocess (a real worker process),
    logging to ``log_path``; ``settings`` are extra ``NAME=value`` strings for ``-s``."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
               "-s", f"IDEMPOTENT_DATABASE={db_path}", "-s", f"LOG_FILE={log_path}"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def close_reason(log_path: Path) -> str | None:
    """The reason of the last ``Spider closed (...)`` line of a crawl log."""
    import re

    if not log_path.exists():  # killed before it logged anything
        return None
    reasons = re.findall(r"Spider closed \(([^)]*)\)", log_path.read_text(errors="replace"))
    return reasons[-1] if reasons else None


def wait_for(condition: Any, timeout: float, what: str) -> None:
    """Poll a state (never a duration); ``timeout`` only ends a test that would hang."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def done_requests(db: Path) -> int:
    """Frontier entries done so far (0 while the database does not exist yet)."""
    try:
        return int(db_rows(db, "SELECT count(*) FROM requests WHERE state = 'done'")[0][0])
    except Exception:  # not created yet
        return 0
