"""Resume at full speed, with real processes: the requests in flight at a SIGKILL are replayed
at normal concurrency, a page that kills the worker every time is still quarantined within
IDEMPOTENT_MAX_ATTEMPTS deaths (and nothing else is), and a restarted ``start()`` over a
start list that is mostly done costs a read per start request, not a transaction."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from local_site import LocalSite

from crawling import (
    close_reason,
    crawl_poison_until_finished,
    start_shop_crawl,
    stored_products,
    wait_for,
)
from helpers.stored import frontier_counts, frontier_entries, requests_done

pytestmark = pytest.mark.slow




def test_requests_in_flight_at_a_kill_are_replayed_at_full_concurrency(
    tmp_path: Path, crawl_database: str
) -> None:
    """Killed with about 24 product pages on the wire, the next crawl replays them among the
    other requests: when a replayed page reaches the site, other requests are in flight
    (before, each ran alone, with nothing else in flight, one after the other)."""
    db = crawl_database
    settings = ("CONCURRENT_REQUESTS=24", "CONCURRENT_REQUESTS_PER_DOMAIN=24")

    def suspects() -> set[str]:
        """URL paths of the requests leased with their start written (an attempt begun)."""
        return {urlsplit(entry.url).path.lstrip("/") for entry in frontier_entries(db)
                if entry.state == "leased" and entry.unfinished > 0}

    with LocalSite(delay=0.2) as site:
        first = start_shop_crawl(site.url, db, tmp_path / "first.log", *settings)
        try:
            wait_for(lambda: requests_done(db) >= 30, 120, "30 requests done")
            # no request is answered from now on: the requests on the wire stay there, and
            # their starts are written with the next transaction (the completion of a page
            # answered before, or the lease renewal's flush)
            site.hold()
            wait_for(lambda: site.in_flight >= 16 and len(suspects()) >= 8, 120,
                     "many requests on the wire, their starts written")
            first.kill()
            first.wait()
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
            site.release()
        begun = suspects()
        assert len(begun) >= 8
        wait_for(lambda: site.in_flight == 0, 60, "the killed crawl's requests to end")
        site.reset_counts()
        second = start_shop_crawl(site.url, db, tmp_path / "second.log", *settings)
        assert second.wait(timeout=300) == 0
        replayed = [(path, others) for path, others in site.arrivals()
                    if path.lstrip("/") in begun]
    assert close_reason(tmp_path / "second.log") == "finished"
    assert len(stored_products(db)) == 500
    # the replayed pages that were downloaded again ran beside other requests
    assert replayed, "no replayed page was downloaded again"
    beside_others = [path for path, others in replayed if others > 0]
    assert len(beside_others) * 2 >= len(replayed), replayed


def test_a_page_that_kills_every_crawl_at_full_concurrency_is_quarantined_alone(
    tmp_path: Path, crawl_database: str
) -> None:
    """Sixteen requests in flight when the poison page kills the worker: the first replay
    runs at full concurrency; what was in flight at two deaths runs alone; the poison page is
    quarantined after IDEMPOTENT_MAX_ATTEMPTS (4) deaths, and no other page is."""
    db = crawl_database
    with LocalSite(listing_pages=3, products_per_page=20, delay=0.05) as site:
        codes = crawl_poison_until_finished(
            site.url, db, tmp_path, "CONCURRENT_REQUESTS=16", "CONCURRENT_REQUESTS_PER_DOMAIN=16",
            "IDEMPOTENT_MAX_ATTEMPTS=4")
    assert codes == [-signal.SIGKILL] * 4 + [0]
    assert [(entry.url, entry.error_kind) for entry in frontier_entries(db)
            if entry.state != "done"] == [(f"{site.url}/product/SKU-00013", "quarantined")]
    assert len(stored_products(db)) == 59


START_LIST_CRAWL = """
import json, sys

import scrapy
from scrapy.crawler import CrawlerProcess


class ManyStarts(scrapy.Spider):
    name = "starts"

    def __init__(self, url, count, **kwargs):
        super().__init__(**kwargs)
        self.urls = [f"{url}/product/SKU-{i:05d}" for i in range(1, count + 1)]

    async def start(self):
        for url in self.urls:
            yield scrapy.Request(url, dont_filter=True)

    def parse(self, response):
        yield {"sku": response.css("span.sku::text").get()}


url, db, pages, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
process = CrawlerProcess({
    "ADDONS": {"scrapy_idempotent.Addon": 0}, "IDEMPOTENT_DATABASE": db,
    "IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}, "ROBOTSTXT_OBEY": False,
    "LOG_LEVEL": "WARNING", "CONCURRENT_REQUESTS": 16, "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
    "CLOSESPIDER_PAGECOUNT": pages})
crawler = process.create_crawler(ManyStarts)
process.crawl(crawler, url=url, count=1000)
process.start()
with open(out, "w") as f:
    f.write(json.dumps(crawler.stats.get_stats(), default=str))
"""


def test_a_resume_over_a_mostly_done_start_list_writes_no_transaction_per_start_request(
    tmp_path: Path, crawl_database: str
) -> None:
    """1,000 start requests, 900 done when the first crawl stopped (CLOSESPIDER_PAGECOUNT
    leaves the run open). The next crawl's start() yields the 1,000 again: the 990 known ones
    cost a read each, not a write transaction each; the 10 others are fetched."""
    import json

    script = tmp_path / "crawl.py"
    script.write_text(START_LIST_CRAWL)
    db = crawl_database
    with LocalSite(listing_pages=50, products_per_page=20) as site:
        stats = []
        for run, pages in enumerate((990, 0)):
            out = tmp_path / f"stats{run}.json"
            subprocess.run([sys.executable, str(script), site.url, str(db), str(pages),
                            str(out)], cwd=tmp_path, check=True, timeout=600)
            stats.append(json.loads(out.read_text()))
    first, second = stats
    assert first["finish_reason"] == "closespider_pagecount"
    done_before = first["idempotent/requests/done"]
    assert second["finish_reason"] == "finished"
    assert frontier_counts(db) == {"done": 1000}
    assert second["idempotent/requests/already_done"] >= done_before
    # a transaction per page fetched (and a few more), none per known start request
    assert second["idempotent/transactions"] < (1000 - done_before) + 50, second
