"""Real crawls of the local test shop through Scrapy's engine with the add-on."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import (
    crawl_settings,
    crawl_to_end,
    frontier_counts,
    run_crawl,
    stored_products,
)
from helpers.stored import stored_records, stored_rejects
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def assert_catalogue(database: str | Path, site: LocalSite) -> None:
    expected = site.expected_products()
    rows = stored_products(database)
    assert len(rows) == len(expected)
    for row in rows:
        want = expected[row["sku"]]
        assert (row["sku"], row["name"], row["price"]) == (want["sku"], want["name"],
                                                            want["price"])


@deferred_f_from_coro_f
async def test_full_crawl_stores_each_product_once(shop: LocalSite, crawl_database: str) -> None:
    crawler = await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                              url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert shop.request_count == 525
    assert_catalogue(crawl_database, shop)
    assert stats["idempotent/records/inserted"] == 500
    assert stats["idempotent/requests/done"] == 525
    assert stats["idempotent/requests/leased"] == 525
    assert frontier_counts(crawl_database) == {"done": 525}
    # the record ID is stamped into the item (ProductItem has no record_id field: not stamped)
    assert stats["item_scraped_count"] == 500


@deferred_f_from_coro_f
async def test_crawl_again_after_finish_is_a_new_run_without_duplicates(
    shop: LocalSite, crawl_database: str
) -> None:
    settings = crawl_settings(crawl_database, **NATURAL_KEYS)
    await run_crawl(ShopSpider, settings, url=shop.url)
    first = {r.record_id: r.first_seen for r in stored_records(crawl_database)}
    shop.reset_counts()
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["idempotent/run_id"] == 2
    assert shop.request_count == 525  # a new run fetches the listings again
    assert stats["idempotent/records/unchanged"] == 500
    assert "idempotent/records/inserted" not in stats
    assert {r.record_id: r.first_seen for r in stored_records(crawl_database)} == first
    assert_catalogue(crawl_database, shop)


@deferred_f_from_coro_f
async def test_changed_price_updates_record_and_keeps_first_seen(
    shop: LocalSite, crawl_database: str
) -> None:
    settings = crawl_settings(crawl_database, **NATURAL_KEYS)
    await run_crawl(ShopSpider, settings, url=shop.url)
    before = {r.record_id: r for r in stored_records(crawl_database)}
    with LocalSite(price_version=1) as repriced:
        crawler = await run_crawl(ShopSpider, settings, url=repriced.url)
        assert_catalogue(crawl_database, repriced)
    stats = crawler.stats.get_stats()
    assert stats["idempotent/records/updated"] == 500
    after = {r.record_id: r for r in stored_records(crawl_database)}
    assert after.keys() == before.keys()
    for record_id, record in after.items():
        assert record.first_seen == before[record_id].first_seen
        assert record.last_changed > before[record_id].last_changed
        assert record.content_hash != before[record_id].content_hash


@dataclasses.dataclass
class Variant:
    sku: str
    colour: str


class MixedItemsSpider(scrapy.Spider):
    """Dict items (room for a record_id field) and dataclass items (no room)."""

    name = "mixed"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base_url}/list/1", dont_filter=True)

    def parse(self, response: Any) -> Any:
        for href in response.css("a.product::attr(href)").getall()[:5]:
            sku = href.rsplit("/", 1)[1]
            yield {"sku": sku, "source_page": response.url}
            yield Variant(sku=sku, colour="red")
            yield {"sku": " ", "why": "blank key"}


@deferred_f_from_coro_f
async def test_item_types_record_ids_and_rejects(shop: LocalSite, crawl_database: str) -> None:
    settings = crawl_settings(crawl_database, IDEMPOTENT_NATURAL_KEYS={
        "dict": "sku", f"{__name__}.Variant": ["sku", "colour"]})
    scraped: list[Any] = []
    from scrapy import signals
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(MixedItemsSpider, settings)

    def on_item(item: Any) -> None:
        scraped.append(item)

    crawler.signals.connect(on_item, signals.item_scraped)
    await crawl_to_end(crawler, url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["idempotent/records/inserted"] == 10
    assert stats["idempotent/records/rejected"] == 5
    assert stats["item_dropped_count"] == 5
    dict_items = [i for i in scraped if isinstance(i, dict)]
    assert len(dict_items) == 5
    assert all(len(i["record_id"]) == 32 for i in dict_items)  # stamped where there is room
    stored_ids = {r.record_id for r in stored_records(crawl_database)}
    assert {i["record_id"] for i in dict_items} <= stored_ids
    rejects = stored_rejects(crawl_database)
    assert len(rejects) == 5
    assert all(r.item_type == "dict" and "'sku'" in r.reason and r.request_key
               for r in rejects)
    assert frontier_counts(crawl_database) == {"done": 1}


class UnstorableSpider(scrapy.Spider):
    name = "unstorable"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url
        self.lambda_calls = 0

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base_url}/list/1", dont_filter=True)

    def parse(self, response: Any) -> Any:
        yield response.follow("/list/2", callback=lambda r: self.called())
        yield response.follow("/list/3", callback=self.parse_rows,
                              cb_kwargs={"rows": (x for x in range(3))})
        yield response.follow("/list/4", callback=self.parse_ok)

    def called(self) -> None:
        self.lambda_calls += 1

    def parse_rows(self, response: Any, rows: Any) -> Any:
        yield {"url": response.url, "rows": list(rows)}

    def parse_ok(self, response: Any) -> Any:
        yield {"url": response.url}


@deferred_f_from_coro_f
async def test_unstorable_requests_are_fetched_from_memory_and_the_crawl_goes_on(
    shop: LocalSite, crawl_database: str, caplog: Any
) -> None:
    crawler = await run_crawl(UnstorableSpider, crawl_settings(crawl_database), url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/requests/unstorable"] == 2
    assert stats["idempotent/requests/from_memory"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("list/2" in m and "callback" in m and "cb_kwargs" in m for m in warnings)
    assert any("list/3" in m and "cb_kwargs['rows']" in m and "generator" in m
               for m in warnings)
    # fetched as Scrapy fetches them, each once, with their callbacks
    assert shop.counts_by_path() == {"/list/1": 1, "/list/2": 1, "/list/3": 1, "/list/4": 1}
    assert crawler.spider.lambda_calls == 1
    # nothing of them is in the frontier; the page that yielded them is done after them
    assert frontier_counts(crawl_database) == {"done": 2}
    assert sorted(r["url"].removeprefix(shop.url) for r in stored_products(crawl_database)) == [
        "/list/3", "/list/4"]
    assert stats["idempotent/records/inserted"] == 2


@deferred_f_from_coro_f
async def test_item_less_pages_are_done_and_listings_are_fetched_again(
    tmp_path: Path,
) -> None:
    """Marking pages done because "they produced items" (as delta-fetch add-ons do) never
    records item-less pages, and listings marked done forever never show new products."""
    db = tmp_path / "itemless.sqlite3"
    # the two shops run on different ports: the url field changes, and is volatile here
    settings = crawl_settings(db, IDEMPOTENT_VOLATILE_FIELDS=["url"], **NATURAL_KEYS)
    with LocalSite(listing_pages=1, products_per_page=10) as site:
        await run_crawl(ShopSpider, settings, url=site.url)
    assert frontier_counts(db) == {"done": 11}  # the item-less listing page too
    with LocalSite(listing_pages=1, products_per_page=11) as site:  # a new product
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert site.counts_by_path()["/list/1"] == 1  # the listing is fetched again
    stats = crawler.stats.get_stats()
    assert (stats["idempotent/records/inserted"], stats["idempotent/records/unchanged"]) == (
        1, 10)
    assert sorted(r["sku"] for r in stored_products(db)) == [f"SKU-{i:05d}" for i in range(1, 12)]


@deferred_f_from_coro_f
async def test_a_crawl_with_only_the_add_on_logs_no_warning(
    db_path: Path, caplog: Any
) -> None:
    # components that are off unless configured (queue input, outbox delivery) are not added,
    # so Scrapy logs no "Disabled ..." warning for them
    with LocalSite(listing_pages=1, products_per_page=2) as site, caplog.at_level("WARNING"):
        crawler = await run_crawl(ShopSpider, crawl_settings(db_path, **NATURAL_KEYS),
                                  url=site.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert [r.getMessage() for r in caplog.records if r.levelname != "INFO"
            and r.levelno >= 30] == []
