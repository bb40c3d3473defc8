"""Several worker processes on one database, graceful stops and lease renewal, with real
``scrapy crawl`` processes of the example project."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import (
    close_reason,
    db_rows,
    frontier_counts,
    start_shop_crawl,
    stored_products,
    wait_for,
)

pytestmark = pytest.mark.slow

ONE_AT_A_TIME = ("CONCURRENT_REQUESTS=1", "CONCURRENT_REQUESTS_PER_DOMAIN=1")




def assert_catalogue(db_path: Path, site: LocalSite) -> None:
    expected = site.expected_products()
    rows = stored_products(db_path)
    assert len(rows) == len(expected)
    assert {r["sku"]: (r["name"], r["price"]) for r in rows} == {
        sku: (p["name"], p["price"]) for sku, p in expected.items()}


def test_three_workers_with_random_kills_store_each_product_once(tmp_path: Path) -> None:
    db = tmp_path / "shop.sqlite3"
    rng = random.Random(4)
    kills = 6
    logs: list[Path] = []
    killed: list[Path] = []

    def start(site: LocalSite) -> subprocess.Popen[bytes]:
        log = tmp_path / f"worker{len(logs)}.log"
        logs.append(log)
        return start_shop_crawl(site.url, db, log, *ONE_AT_A_TIME)

    with LocalSite(delay=0.01) as site:
        workers = [start(site) for _ in range(3)]  # all at once on a new database
        current = list(logs)
        try:
            wait_for(lambda: site.request_count > 20, 60, "the first requests")
            for _ in range(kills):
                time.sleep(rng.uniform(0.3, 0.8))
                index = rng.randrange(len(workers))
                workers[index].kill()
                assert workers[index].wait() == -signal.SIGKILL
                killed.append(current[index])
                workers[index] = start(site)
                current[index] = logs[-1]
            for worker in workers:
                assert worker.wait(timeout=120) == 0
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        requests = site.request_count
        assert_catalogue(db, site)
    assert [close_reason(log) for log in killed] == [None] * kills
    assert {close_reason(log) for log in current} == {"finished"}
    assert not any("database is locked" in log.read_text() for log in logs if log.exists())
    assert requests <= 525 + kills
    assert frontier_counts(db) == {"done": 525}
    assert db_rows(db, "SELECT count(*), sum(done) FROM runs") == [(1, 525)]


def test_sigterm_releases_leases_and_the_next_crawl_resumes_at_once(tmp_path: Path) -> None:
    db = tmp_path / "shop.sqlite3"
    with LocalSite(delay=0.01) as site:
        crawl = start_shop_crawl(site.url, db, tmp_path / "first.log",
                                 "CONCURRENT_REQUESTS=4", "IDEMPOTENT_LEASE_SECONDS=600")
        try:
            wait_for(lambda: site.request_count > 100, 60, "100 requests")
            crawl.send_signal(signal.SIGTERM)  # Ctrl+C, scrapyd's cancel
            assert crawl.wait(timeout=60) == 0
        finally:
            if crawl.poll() is None:
                crawl.kill()
        assert close_reason(tmp_path / "first.log") == "shutdown"
        counts = frontier_counts(db)
        assert "leased" not in counts
        assert counts["pending"] > 0
        # finishes well within the 600 s leases: none of them was waited for
        second = start_shop_crawl(site.url, db, tmp_path / "second.log", "CONCURRENT_REQUESTS=4")
        assert second.wait(timeout=300) == 0
        assert_catalogue(db, site)
        assert site.request_count == 525  # a graceful stop repeats nothing
    assert close_reason(tmp_path / "second.log") == "finished"


SLOW_SPIDER = textwrap.dedent('''
    import scrapy

    class SlowSpider(scrapy.Spider):
        name = "slow"
        custom_settings = {"ADDONS": {"scrapy_idempotent.Addon": 0},
                           "IDEMPOTENT_NATURAL_KEYS": {"dict": "id"},
                           "DOWNLOAD_TIMEOUT": 30, "ROBOTSTXT_OBEY": False}

        def __init__(self, url, **kwargs):
            super().__init__(**kwargs)
            self.base_url = url

        async def start(self):
            yield scrapy.Request(self.base_url + "/start", dont_filter=True)

        def parse(self, response):
            yield response.follow("/slow", callback=self.parse_slow)

        def parse_slow(self, response):
            yield {"id": "slow", "body": response.text}
''')


@pytest.fixture
def slow_site() -> Iterator[LocalSite]:
    """``/start`` links ``/slow``, which is answered only when the test releases it (longer
    than the lease)."""
    with LocalSite(keep_alive=False) as site:
        site.add("/start", '<a href="/slow">slow</a>', "text/html")
        site.add("/slow", "slow page", "text/html", held=True)
        yield site


def test_a_page_slower_than_the_lease_keeps_its_lease_and_is_fetched_once(
    tmp_path: Path, slow_site: LocalSite
) -> None:
    url = slow_site.url
    spider = tmp_path / "slow_spider.py"
    spider.write_text(SLOW_SPIDER)
    db = tmp_path / "slow.sqlite3"
    lease = 2.0

    def start(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "scrapy", "runspider", str(spider), "-a", f"url={url}",
             "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"IDEMPOTENT_LEASE_SECONDS={lease:g}",
             "-s", f"LOG_FILE={tmp_path / name}"],
            cwd=tmp_path, stdin=subprocess.DEVNULL)

    def slow_lease_until() -> float:
        rows = db_rows(db, "SELECT leased_until FROM requests WHERE url LIKE '%/slow'"
                           " AND state = 'leased'")
        assert rows, "the slow page lost its lease"
        return float(rows[0][0])

    first = start("first.log")
    second = None
    try:
        wait_for(lambda: slow_site.hits("/slow") == 1, 120, "the slow page")
        second = start("second.log")  # a live worker: it must not take the slow page
        # The page is answered only once the second worker has joined the run and the first
        # has renewed its lease for more than a lease time since: waiting on state, not on
        # time, so a loaded machine cannot make the second worker arrive after the end.
        wait_for(lambda: len(db_rows(db, "SELECT 1 FROM sessions")) == 2, 120,
                 "the second worker")
        joined = slow_lease_until()
        wait_for(lambda: slow_lease_until() > joined + lease, 120, "renewals of the lease")
        assert second.poll() is None, (tmp_path / "second.log").read_text()
        slow_site.release()
        assert first.wait(timeout=120) == 0
        assert second.wait(timeout=120) == 0
    finally:
        slow_site.release()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
    assert slow_site.counts_by_path() == {"/start": 1, "/slow": 1}
    assert [json.loads(d)["id"] for (d,) in db_rows(db, "SELECT data FROM records")] == ["slow"]
    assert close_reason(tmp_path / "second.log") == "finished"
