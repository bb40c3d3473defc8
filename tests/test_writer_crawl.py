"""Real crawls with the writer thread: a callback runs only once its attempt (and its
journaled response) is durable, and pages share transactions."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, frontier_counts, run_crawl, stored_products
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


class CheckingSpider(ShopSpider):
    """The shop spider, whose product callback reads, from a connection of its own, what the
    database holds about the page being processed."""

    name = "checking"

    def __init__(self, db: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.db = db
        self.seen: list[tuple[int, int, int]] = []  # (attempts, unfinished, journaled)

    def parse_product(self, response: Any) -> Any:
        conn = sqlite3.connect(self.db)
        try:
            attempts, unfinished = conn.execute(
                "SELECT attempts, unfinished FROM requests WHERE url = ?",
                (response.url,)).fetchone()
            (journaled,) = conn.execute(
                "SELECT count(*) FROM responses WHERE key = "
                "(SELECT key FROM requests WHERE url = ?)", (response.url,)).fetchone()
        finally:
            conn.close()
        self.seen.append((attempts, unfinished, journaled))
        yield from super().parse_product(response)


@deferred_f_from_coro_f
async def test_a_callback_runs_once_its_attempt_and_response_are_durable(
        shop: LocalSite, db_path: Path) -> None:
    crawler = await run_crawl(CheckingSpider, crawl_settings(db_path, **NATURAL_KEYS),
                              url=shop.url, db=str(db_path))
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    seen = crawler.spider.seen
    assert len(seen) == 500
    # every product page found its attempt counted and its raw response journaled (a kill
    # in the callback would count the attempt, and replay the response without a download)
    assert set(seen) == {(1, 1, 1)}
    assert frontier_counts(db_path) == {"done": 525}
    assert len(stored_products(db_path)) == 500


@deferred_f_from_coro_f
async def test_pages_share_transactions(shop: LocalSite, db_path: Path) -> None:
    crawler = await run_crawl(ShopSpider, crawl_settings(db_path, **NATURAL_KEYS),
                              url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/requests/done"] == 525
    # at most one write transaction per page, the journal's rows and the starts included
    assert stats["idempotent/transactions"] <= 525, stats["idempotent/transactions"]
