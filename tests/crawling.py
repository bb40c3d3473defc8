"""Helpers for the tests: real crawls in this process and reads of frontier databases."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import scrapy

from helpers.stored import frontier_counts as frontier_counts
from helpers.stored import request_keys as request_keys
from helpers.stored import stored_products as stored_products


@contextlib.contextmanager
def small_file_system(mount: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (a tmpfs, ``256k``) mounted at ``mount`` for the block
    (the test is skipped where none can be mounted)."""
    import pytest

    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        # lazily when a file is still open in it (a failed test's store): a mount left
        # behind would break every later pytest's clean-up of its old temporary directories
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_up(mount: Path) -> Path:
    """Fill the file system at ``mount`` with one file (returned: delete it to free the
    space)."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    return filler


def crawl_settings(db_path: str | Path, **extra: Any) -> dict[str, Any]:
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


@contextlib.contextmanager
def db_rows_connection(db_path: Path) -> Any:
    """A write connection to the test's database, committed and closed after."""
    conn = sqlite3.connect(db_path)
    try:
        with conn:
            yield conn
    finally:
        conn.close()


EXAMPLE_PROJECT = Path(__file__).resolve().parent.parent / "example_project"


def start_shop_crawl(site_url: str, db_path: str | Path, log_path: Path, *settings: str) -> Any:
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


def kill_shop_crawls(site: Any, database: str | Path, log_dir: Path, rng: Any, kills: int,
                     *settings: str) -> None:
    """``scrapy crawl shop`` on ``database`` (passed through unchanged: a SQLite path or a
    PostgreSQL URL) started ``kills`` times, each SIGKILLed once the site has served 5 to 120
    more requests (drawn from ``rng``: a moment given by the crawl's progress, never by
    time), then run once more to its end; logs ``log_dir/run<n>.log`` and ``final.log``.
    Every kill must hit a crawl still running, and the last crawl must finish."""
    import sys

    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site.url}",
               "-s", f"IDEMPOTENT_DATABASE={database}"]
    for setting in settings:
        command += ["-s", setting]
    kill_crawls(site, command, log_dir, rng, kills, more=(5, 120), cwd=EXAMPLE_PROJECT)


def kill_crawls(site: Any, command: list[str], log_dir: Path, rng: Any, kills: int, *,
                more: tuple[int, int] = (5, 15), env: dict[str, str] | None = None,
                cwd: Path | None = None) -> Path:
    """``command`` (a crawl of ``site`` in a subprocess, run in ``cwd``, default
    ``log_dir``, logging to ``log_dir/run<n>.log``) started ``kills`` times, each SIGKILLed
    once the site has served ``more`` more requests (a number drawn from ``rng`` between the
    two: a moment given by the crawl's progress, never by time), then run once more to its
    end, which must exit 0
    with reason ``finished``; returns that run's log (``final.log``)."""
    import signal
    import subprocess

    for run in range(kills):
        log = log_dir / f"run{run}.log"
        target = site.request_count + rng.randint(*more)
        process = subprocess.Popen([*command, "-s", f"LOG_FILE={log}"], cwd=cwd or log_dir,
                                   env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT)
        try:
            wait_for(lambda t=target, p=process: site.request_count >= t  # type: ignore[misc]
                     or p.poll() is not None, 300, f"request {target}", log)
        finally:
            process.kill()
            process.wait()
        assert process.returncode == -signal.SIGKILL, (
            f"run {run} ended by itself ({process.returncode}) before its kill:\n"
            + (log.read_text(errors="replace")[-3000:] if log.exists() else "no log"))
    log = log_dir / "final.log"
    final = subprocess.run([*command, "-s", f"LOG_FILE={log}"], cwd=cwd or log_dir, env=env,
                           stdin=subprocess.DEVNULL, timeout=300, check=False)
    assert final.returncode == 0, log.read_text(errors="replace")[-3000:]
    assert close_reason(log) == "finished"
    return log


POISON_SPIDER = Path(__file__).resolve().parent / "poison_spider.py"


def crawl_poison_until_finished(site_url: str, db: str | Path, log_dir: Path, *settings: str,
                                runs: int = 8) -> list[int]:
    """``scrapy runspider poison_spider.py`` on ``db`` again and again (logs
    ``log_dir/run<n>.log``), until a crawl exits 0 or ``runs`` crawls ran; their exit codes."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "scrapy", "runspider", str(POISON_SPIDER), "-a",
               f"url={site_url}", "-s", f"IDEMPOTENT_DATABASE={db}"]
    for setting in settings:
        command += ["-s", setting]
    codes = []
    for run in range(runs):
        crawl = subprocess.run([*command, "-s", f"LOG_FILE={log_dir / f'run{run}.log'}"],
                               cwd=log_dir, stdin=subprocess.DEVNULL, timeout=120, check=False)
        codes.append(crawl.returncode)
        if crawl.returncode == 0:
            break
    return codes


def close_reason(log_path: Path) -> str | None:
    """The reason of the last ``Spider closed (...)`` line of a crawl log."""
    import re

    if not log_path.exists():  # killed before it logged anything
        return None
    reasons = re.findall(r"Spider closed \(([^)]*)\)", log_path.read_text(errors="replace"))
    return reasons[-1] if reasons else None


def wait_for(condition: Any, timeout: float, what: str, log: Path | None = None) -> None:
    """Poll a state (never a duration); ``timeout`` only ends a test that would hang. The
    failure shows the text of ``log`` (a crawl's log file), when given."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            shown = ""
            if log is not None:
                shown = (f"; log:\n{log.read_text(errors='replace')}" if log.exists()
                         else f"; no log written at {log}")
            raise AssertionError(f"timed out waiting for {what}{shown}")
        time.sleep(0.01)


def done_requests(db: Path) -> int:
    """Frontier entries done so far (0 while the database does not exist yet)."""
    try:
        return int(db_rows(db, "SELECT count(*) FROM requests WHERE state = 'done'")[0][0])
    except Exception:  # not created yet
        return 0


# -- a spider fetching given paths, and log messages -----------------------------------------


class PagesSpider(scrapy.Spider):
    """Fetches the given paths; each page's output is ``make_output(response)``."""

    name = "pages"

    def __init__(self, url: str, paths: list[str],
                 make_output: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url
        self.paths = paths
        self.make_output = make_output

    async def start(self) -> Any:
        for path in self.paths:
            yield scrapy.Request(self.base_url + path, dont_filter=True)

    def parse(self, response: Any) -> Any:
        if self.make_output is not None:
            yield from self.make_output(response)



def pages(site: Any, count: int) -> list[str]:
    """Adds ``count`` small HTML pages ``/page/1`` .. to the site; returns their paths."""
    paths = [f"/page/{i}" for i in range(1, count + 1)]
    for path in paths:
        site.add(path, f"<html><body>{path}</body></html>")
    return paths


def package_messages(caplog: Any, level: int = logging.DEBUG, *,
                     tracebacks: bool = False) -> list[str]:
    """Messages of the package's own loggers (``scrapy_idempotent...``), optionally with the
    text of the traceback logged with them."""
    formatter = logging.Formatter()
    return [r.getMessage() + (("\n" + formatter.formatException(r.exc_info))
                              if tracebacks and r.exc_info else "")
            for r in caplog.records
            if r.name.startswith("scrapy_idempotent") and r.levelno >= level]


def all_messages(caplog: Any, level: int = logging.DEBUG) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


def kill_workers_at_random(
        served: Callable[[], int],
        launch: Callable[[int], tuple[subprocess.Popen[bytes], Path]], workers: int,
        kills: int, rng: Any, between: tuple[int, int]) -> None:
    """Start ``workers`` crawl processes (``launch(slot)``: the process and its log), then
    ``kills`` times: once the site has ``served`` ``between`` more requests (drawn by
    ``rng``), SIGKILL a random one and launch another in its slot (fewer kills when the crawl
    ends first). Then wait for every process to exit 0 with the close reason ``finished``."""
    running = [launch(slot) for slot in range(workers)]
    for _ in range(kills):
        target = served() + rng.randint(*between)
        wait_for(lambda t=target: served() >= t  # type: ignore[misc]
                 or all(p.poll() is not None for p, _ in running), 300,
                 f"request {target}")
        slot = rng.randrange(workers)
        process, _ = running[slot]
        if process.poll() is not None:
            break  # the crawl is over
        process.kill()
        process.wait()
        running[slot] = launch(slot)
    for process, log in running:
        assert process.wait(300) == 0, log.read_text()[-3000:]
        assert close_reason(log) == "finished", log.read_text()[-3000:]
