"""Real crawls on PostgreSQL while the database server goes away: a restart mid-crawl is
waited for and the crawl finishes with every product once; a server that stays away closes
the spider cleanly, and the next crawl resumes from what was committed."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl, wait_for
from helpers.postgresql import crawl_rows
from shop.spiders.shop import ShopSpider

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.slow

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def done(url: str) -> int:
    rows = crawl_rows(url, "SELECT count(*) FROM requests WHERE state = 'done'")
    return int(rows[0][0]) if rows else 0


def assert_all_products_once(url: str, site: LocalSite) -> None:
    expected = site.expected_products()
    records = [json.loads(data) for (data,) in crawl_rows(url, "SELECT data FROM records")]
    assert len(records) == len({r["sku"] for r in records}) == 500
    for record in records:
        want = expected[record["sku"]]
        assert (record["name"], record["price"]) == (want["name"], want["price"])


@deferred_f_from_coro_f
async def test_a_server_restart_mid_crawl_is_waited_for(postgres_url: str,
                                                        postgres_cluster: Any) -> None:
    restarted = threading.Event()

    def restart_after_100_pages() -> None:
        wait_for(lambda: done(postgres_url) >= 100, 300, "100 pages done")
        postgres_cluster.stop("immediate")  # as a crash of the server
        postgres_cluster.start()
        restarted.set()

    with LocalSite(delay=0.01) as site:
        restarter = threading.Thread(target=restart_after_100_pages, daemon=True)
        restarter.start()
        settings = crawl_settings(postgres_url,  # type: ignore[arg-type]
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=120, **NATURAL_KEYS)
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        restarter.join(300)
        assert restarted.is_set()
        stats = crawler.stats.get_stats()
        assert stats["finish_reason"] == "finished"
        assert_all_products_once(postgres_url, site)
        # what was on the wire at the restart may be fetched again, nothing more
        assert 525 <= site.request_count <= 525 + 16
    assert crawl_rows(postgres_url, "SELECT state, count(*) FROM requests GROUP BY state") == [
        ("done", 525)]


@deferred_f_from_coro_f
async def test_a_server_that_stays_away_closes_the_spider_and_the_next_crawl_resumes(
        postgres_url: str, postgres_cluster: Any) -> None:
    stopped = threading.Event()

    def stop_after_100_pages() -> None:
        wait_for(lambda: done(postgres_url) >= 100, 300, "100 pages done")
        postgres_cluster.stop("immediate")
        stopped.set()

    with LocalSite(delay=0.01) as site:
        stopper = threading.Thread(target=stop_after_100_pages, daemon=True)
        stopper.start()
        settings = crawl_settings(postgres_url,  # type: ignore[arg-type]
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=2, **NATURAL_KEYS)
        try:
            crawler = await run_crawl(ShopSpider, settings, url=site.url)
            stopper.join(300)
            assert stopped.is_set()
            stats = crawler.stats.get_stats()
            assert stats["finish_reason"] == "idempotent_store_error"
            assert "connection" in stats["idempotent/error"]
            first = site.request_count
        finally:
            if not stopped.is_set():
                stopper.join(300)
            postgres_cluster.start()
        settings["IDEMPOTENT_BUSY_TIMEOUT_SECONDS"] = 10
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert crawler.stats.get_value("finish_reason") == "finished"
        assert_all_products_once(postgres_url, site)
        # the second crawl fetched what the first had not committed, not the whole shop
        assert site.request_count - first < 525 - 100 + 16 * 2
    assert crawl_rows(postgres_url, "SELECT count(*) FROM runs") == [(1,)]
