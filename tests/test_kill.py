"""Kill-and-resume with real processes: ``scrapy crawl`` of the example project, SIGKILLed
at moments given by the crawl's progress, then run to completion (the docs' demo, smaller;
``example_project/demo.py`` itself, which kills by time, is run by CI)."""

from __future__ import annotations

import random
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from local_site import LocalSite

from crawling import kill_shop_crawls
from helpers.stored import (
    frontier_counts,
    frontier_entries,
    journaled_responses,
    reading,
    stored_products,
    stored_runs,
)
from scrapy_idempotent.store.registry import sqlite_path

pytestmark = pytest.mark.slow


def assert_all_products_once(database: str, site: LocalSite) -> None:
    """One stored record per product of the shop, with its name and price."""
    expected = site.expected_products()
    records = stored_products(database)
    assert len(records) == len({r["sku"] for r in records}) == len(expected) == 500
    for record in records:
        want = expected[record["sku"]]
        assert (record["name"], record["price"]) == (want["name"], want["price"])


def repeated_paths(site: LocalSite) -> dict[str, int]:
    return {path: n for path, n in site.counts_by_path().items() if n > 1}


def test_sigkill_and_resume_stores_each_product_once(
    tmp_path: Path, crawl_database: str
) -> None:
    # One request at a time, a shop answering in 10 ms: a kill may repeat only the request on
    # the wire, so the bound is exact (525 + kills). One crawl per store, each store killed at
    # moments of its own (seed 1 on SQLite, 2 on PostgreSQL).
    kills = 4
    seed = 1 if sqlite_path(crawl_database) is not None else 2
    with LocalSite(delay=0.01) as site:
        kill_shop_crawls(site, crawl_database, tmp_path, random.Random(seed), kills,
                         "CONCURRENT_REQUESTS=1", "CONCURRENT_REQUESTS_PER_DOMAIN=1")
        requests = site.request_count
        assert_all_products_once(crawl_database, site)
        assert 525 <= requests <= 525 + kills, repeated_paths(site)
    assert frontier_counts(crawl_database) == {"done": 525}
    assert len(stored_runs(crawl_database)) == 1  # one run, resumed each time
    assert journaled_responses(crawl_database) == 0  # journal emptied


def test_sigkill_at_full_concurrency_repeats_at_most_what_was_on_the_wire(
    tmp_path: Path, crawl_database: str
) -> None:
    kills, concurrency = 3, 16
    with LocalSite(delay=0.01) as site:
        kill_shop_crawls(site, crawl_database, tmp_path, random.Random(3), kills,
                         f"CONCURRENT_REQUESTS={concurrency}",
                         f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}")
        requests = site.request_count
        served = site.counts_by_path()
        assert_all_products_once(crawl_database, site)
        assert requests <= 525 + kills * concurrency, repeated_paths(site)
    # The frontier's download counts are what the site answered: per page never more than
    # the site served it, in all short of it by at most what was on the wire at each kill.
    entries = frontier_entries(crawl_database)
    over = {e.url: (e.downloads, served.get(urlsplit(e.url).path, 0)) for e in entries
            if e.downloads > served.get(urlsplit(e.url).path, 0)}
    assert not over, over
    with reading(crawl_database) as store:
        summary = store.request_summary()
    twice = sum(1 for n in served.values() if n > 1)
    assert requests - kills * concurrency <= summary.downloads <= requests
    assert twice - kills * concurrency <= summary.downloaded_again <= twice, (summary, twice)
