"""Several worker processes on one database, graceful stops and lease renewal, with real
``scrapy crawl`` processes of the example project."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import close_reason, start_shop_crawl, wait_for
from helpers.stored import (
    frontier_counts,
    frontier_entries,
    stored_products,
    stored_runs,
    stored_sessions,
)

pytestmark = pytest.mark.slow

ONE_AT_A_TIME = ("CONCURRENT_REQUESTS=1", "CONCURRENT_REQUESTS_PER_DOMAIN=1")




def assert_catalogue(database: str, site: LocalSite) -> None:
    expected = site.expected_products()
    rows = stored_products(database)
    assert len(rows) == len(expected)
    assert {r["sku"]: (r["name"], r["price"]) for r in rows} == {
        sku: (p["name"], p["price"]) for sku, p in expected.items()}


def test_three_workers_with_random_kills_store_each_product_once(
    tmp_path: Path, crawl_database: str
) -> None:
    """Three workers on one database (on SQLite one file, on PostgreSQL one server database),
    a random one SIGKILLed and restarted at moments given by the requests served."""
    db = crawl_database
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
                # a moment drawn by requests served, not by time: a loaded machine cannot
                # let the crawl finish before its kills
                target = site.request_count + rng.randint(10, 50)
                wait_for(lambda t=target: site.request_count >= t, 120,  # type: ignore[misc]
                         f"request {target}")
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
    runs = stored_runs(db)
    assert [(len(runs), sum(run.done for run in runs))] == [(1, 525)]


def test_sigterm_releases_leases_and_the_next_crawl_resumes_at_once(
    tmp_path: Path, crawl_database: str
) -> None:
    db = crawl_database
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
    tmp_path: Path, slow_site: LocalSite, crawl_database: str
) -> None:
    url = slow_site.url
    spider = tmp_path / "slow_spider.py"
    spider.write_text(SLOW_SPIDER)
    db = crawl_database
    lease = 2.0

    def start(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "scrapy", "runspider", str(spider), "-a", f"url={url}",
             "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"IDEMPOTENT_LEASE_SECONDS={lease:g}",
             "-s", f"LOG_FILE={tmp_path / name}"],
            cwd=tmp_path, stdin=subprocess.DEVNULL)

    def slow_lease_until() -> float:
        leases = [entry.leased_until for entry in frontier_entries(db)
                  if entry.url.endswith("/slow") and entry.state == "leased"]
        assert leases, "the slow page lost its lease"
        return float(leases[0])  # type: ignore[arg-type]

    first = start("first.log")
    second = None
    try:
        wait_for(lambda: slow_site.hits("/slow") == 1, 120, "the slow page")
        second = start("second.log")  # a live worker: it must not take the slow page
        # The page is answered only once the second worker has joined the run and the first
        # has renewed its lease for more than a lease time since: waiting on state, not on
        # time, so a loaded machine cannot make the second worker arrive after the end.
        wait_for(lambda: len(stored_sessions(db)) == 2, 120,
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
    assert [product["id"] for product in stored_products(db)] == ["slow"]
    assert close_reason(tmp_path / "second.log") == "finished"
