"""Real crawls with the writer thread: a callback runs only once its attempt (and its
journaled response) is durable, and pages share transactions."""

from __future__ import annotations

from typing import Any

from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, frontier_counts, run_crawl, stored_products
from helpers.stored import reading
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


class CheckingSpider(ShopSpider):
    """The shop spider, whose product callback reads, through a store of its own opened
    read-only (committed data only), what the database holds about the page being
    processed."""

    name = "checking"

    def __init__(self, db: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.db = db
        self.seen: list[tuple[int, int, int]] = []  # (attempts, unfinished, journaled)

    def parse_product(self, response: Any) -> Any:
        key = self.crawler.request_fingerprinter.fingerprint(response.request).hex()
        with reading(self.db) as store:
            entry = store.entry(key)
            assert entry is not None and entry.url == response.url
            journaled = int(store.journaled_response(key) is not None)
        self.seen.append((entry.attempts, entry.unfinished, journaled))
        yield from super().parse_product(response)


@deferred_f_from_coro_f
async def test_a_callback_runs_once_its_attempt_and_response_are_durable(
        shop: LocalSite, crawl_database: str) -> None:
    crawler = await run_crawl(CheckingSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                              url=shop.url, db=str(crawl_database))
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    seen = crawler.spider.seen
    assert len(seen) == 500
    # every product page found its attempt counted and its raw response journaled (a kill
    # in the callback would count the attempt, and replay the response without a download)
    assert set(seen) == {(1, 1, 1)}
    assert frontier_counts(crawl_database) == {"done": 525}
    assert len(stored_products(crawl_database)) == 500


@deferred_f_from_coro_f
async def test_pages_share_transactions(shop: LocalSite, crawl_database: str) -> None:
    crawler = await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                              url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/requests/done"] == 525
    # at most one write transaction per page, the journal's rows and the starts included
    assert stats["idempotent/transactions"] <= 525, stats["idempotent/transactions"]
