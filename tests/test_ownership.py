"""Real ``scrapy crawl`` processes against one database file: a database knows whose it is,
and a crawl closed by a store error exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import (
    EXAMPLE_PROJECT,
    close_reason,
    db_rows,
    done_requests,
    start_shop_crawl,
    wait_for,
)

pytestmark = pytest.mark.slow



def crawl(*args: str, cwd: Path = EXAMPLE_PROJECT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scrapy", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


OTHER_SPIDER = textwrap.dedent('''
    import scrapy

    class ManySpider(scrapy.Spider):
        name = "many"
        custom_settings = {"ADDONS": {"scrapy_idempotent.Addon": 0}, "ROBOTSTXT_OBEY": False}

        def __init__(self, url, **kwargs):
            super().__init__(**kwargs)
            self.start_urls = [url + "/list/1"]

        def parse(self, response):
            yield {"url": response.url}
''')


def test_another_spider_or_project_on_the_database_is_refused_at_start(
    tmp_path: Path,
) -> None:
    db = tmp_path / "shared.sqlite3"
    with LocalSite() as site:
        first = crawl("crawl", "shop", "-a", f"url={site.url}",
                      "-s", f"IDEMPOTENT_DATABASE={db}", "-s", "LOG_LEVEL=INFO")
        assert first.returncode == 0, first.stderr[-3000:]
        before = db_rows(db, "SELECT count(*), sum(state = 'done') FROM requests")
        sessions = db_rows(db, "SELECT count(*) FROM sessions")
        fetched = site.request_count
        spider = tmp_path / "many.py"
        spider.write_text(OTHER_SPIDER)
        attempts = {
            "another spider": crawl("runspider", str(spider), "-a", f"url={site.url}",
                                    "-s", f"IDEMPOTENT_DATABASE={db}", cwd=tmp_path),
            "another project": crawl("crawl", "shop", "-a", f"url={site.url}",
                                     "-s", f"IDEMPOTENT_DATABASE={db}",
                                     "-s", "BOT_NAME=catalogue"),
        }
        assert site.request_count == fetched  # refused before any request
    for what, result in attempts.items():
        assert result.returncode != 0, what
        output = result.stdout + result.stderr
        assert "belongs to spider 'shop' of project 'shop'" in output, (what, output[-3000:])
        assert "IDEMPOTENT_DATABASE" in output, what
    assert db_rows(db, "SELECT count(*), sum(state = 'done') FROM requests") == before
    assert db_rows(db, "SELECT count(*) FROM sessions") == sessions


def test_a_crawl_closed_by_a_store_error_exits_non_zero_and_the_next_one_completes(
    tmp_path: Path,
) -> None:
    """The write-ahead log is deleted under a running crawl (an operator cleaning up "temp
    files"): the crawl stops writing, closes with ``idempotent_store_error``, says why, and
    ``scrapy crawl`` exits with 1. The next crawl resumes from what the database holds."""
    db = tmp_path / "shop.sqlite3"
    log = tmp_path / "first.log"
    with LocalSite(delay=0.01) as site:
        worker = start_shop_crawl(site.url, db, log, "CONCURRENT_REQUESTS=4",
                                  "LOG_LEVEL=INFO")
        try:
            wait_for(lambda: os.path.exists(f"{db}-wal") and site.request_count > 50, 120,
                     "the crawl to write")
            os.unlink(f"{db}-wal")
            assert worker.wait(timeout=120) == 1
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        assert close_reason(log) == "idempotent_store_error"
        text = log.read_text()
        assert "-wal was deleted" in text
        assert "retrying" not in text  # only a busy database is worth retrying
        second = start_shop_crawl(site.url, db, tmp_path / "second.log")
        assert second.wait(timeout=300) == 0
    assert close_reason(tmp_path / "second.log") == "finished"
    assert db_rows(db, "SELECT state, count(*) FROM requests GROUP BY state") == [("done", 525)]
    assert db_rows(db, "SELECT count(*) FROM records") == [(500,)]


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_file_deleted_or_replaced_under_a_running_crawl_stops_it(
    tmp_path: Path, how: str
) -> None:
    """The database file itself removed (or a backup renamed over it) while a crawl runs:
    SQLite in WAL mode writes on into the unlinked file, and the crawl used to log
    ``finished``, exit 0 and leave nothing behind. It now stops writing at its next
    transaction, names the path, closes with ``idempotent_store_error`` and exits 1."""
    import sqlite3

    db = tmp_path / "shop.sqlite3"
    log = tmp_path / "crawl.log"
    with LocalSite() as site:
        worker = start_shop_crawl(site.url, db, log, "CONCURRENT_REQUESTS=4", "LOG_LEVEL=INFO")
        try:
            wait_for(lambda: done_requests(db) >= 20, 120, "the crawl to commit pages", log)
            site.hold()  # the crawl cannot finish meanwhile
            if how == "deleted":
                os.unlink(db)
            else:
                backup = tmp_path / "backup.sqlite3"
                source = sqlite3.connect(db)
                target = sqlite3.connect(backup)
                source.backup(target)
                source.close()
                target.close()
                os.replace(backup, db)
            site.release()
            code = worker.wait(timeout=120)
        finally:
            site.release()
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert f"the database {db} was deleted or replaced" in text
    assert close_reason(log) == "idempotent_store_error"
    assert "(finished)" not in text
