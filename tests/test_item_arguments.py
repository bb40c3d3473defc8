"""Items in a request's ``cb_kwargs`` and ``meta`` (``scrapy.Item``, dataclass, attrs item):
stored with the request as items of their class, so a request that carries one is stored,
not fetched from memory, and its callback gets equal items back after a kill."""

from __future__ import annotations

import dataclasses
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import scrapy
from item_args_spider import ItemArgsSpider, Listing, Origin, Seed, seed_of
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, kill_crawls, run_crawl
from helpers.stored import stored_products
from scrapy_idempotent import UnstorableRequest
from scrapy_idempotent.codec import RequestCodec, dumps, loads

ITEM_ARGS_SPIDER = Path(__file__).parent / "item_args_spider.py"


@pytest.fixture
def small_shop() -> Any:
    with LocalSite(listing_pages=3, products_per_page=20) as site:
        yield site


def _request(spider: ItemArgsSpider, **kwargs: Any) -> scrapy.Request:
    return scrapy.Request("https://example.com/product/SKU-1", callback=spider.parse_product,
                          **kwargs)


def test_items_in_cb_kwargs_and_meta_come_back_equal_and_of_their_class() -> None:
    spider = ItemArgsSpider(url="https://example.com")
    codec = RequestCodec(spider)
    listing = Listing(page="https://example.com/list/1", rank=3)
    seed = seed_of("https://example.com/product/SKU-1")
    origin = Origin(listing=Listing(listing), hops=2)
    request = _request(spider, cb_kwargs={"listing": listing},
                       meta={"seed": seed, "origin": origin, "many": [Listing(rank=1)]})
    again = codec.decode(codec.encode(request))
    assert type(again.cb_kwargs["listing"]) is Listing
    assert again.cb_kwargs["listing"] == listing
    assert again.cb_kwargs["listing"] is not listing  # a copy, as every stored value
    assert type(again.meta["seed"]) is Seed and again.meta["seed"] == seed
    assert again.meta["seed"].seen == seed.seen  # a field the constructor does not take
    assert type(again.meta["origin"]) is Origin and again.meta["origin"] == origin
    assert type(again.meta["origin"].listing) is Listing
    assert again.meta["many"] == [Listing(rank=1)]
    # an item's unset fields stay unset
    assert "page" not in again.meta["many"][0]


class _Opaque:
    pass


@dataclasses.dataclass
class _Wrapped:
    value: Any


class _Built(scrapy.Item):
    """An item whose constructor does not take its fields."""

    name = scrapy.Field()

    def __init__(self, spider_name: str) -> None:
        super().__init__(name=spider_name.upper())


def test_items_that_cannot_come_back_keep_the_request_unstorable() -> None:
    spider = ItemArgsSpider(url="https://example.com")
    codec = RequestCodec(spider)

    @dataclasses.dataclass
    class Local:  # defined in a function: no module path leads to it
        value: int

    local = f"meta['local']: {Local.__qualname__}"
    for meta, where in (({"local": Local(1)}, local),
                        ({"wrapped": _Wrapped(_Opaque())}, "meta['wrapped']['value']: _Opaque"),
                        ({"built": _Built("x")}, "meta['built']: _Built")):
        with pytest.raises(UnstorableRequest, match=re.escape(f"{where} cannot be stored")):
            codec.encode(_request(spider, meta=meta))


def test_a_stored_item_class_that_is_gone_makes_the_request_unloadable() -> None:
    text = dumps({"seed": Seed(sku="x", floor=1)})
    assert loads(text) == {"seed": Seed(sku="x", floor=1)}
    moved = text.replace('"Seed"', '"Moved"')
    with pytest.raises(ValueError, match=r"stored item class item_args_spider\.Moved is not an "
                       r"item class of the modules loaded"):
        loads(moved)
    unloaded = text.replace('"item_args_spider"', '"not_imported_module"')
    with pytest.raises(ValueError, match=r"not_imported_module\.Seed"):
        loads(unloaded)
    assert "not_imported_module" not in sys.modules  # named by the database: not imported


@deferred_f_from_coro_f
async def test_a_request_carrying_items_is_stored_not_fetched_from_memory(
        small_shop: LocalSite, crawl_database: str) -> None:
    crawler = await run_crawl(ItemArgsSpider, crawl_settings(crawl_database),
                              url=small_shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert "idempotent/requests/unstorable" not in stats
    assert "idempotent/requests/from_memory" not in stats
    records = stored_products(crawl_database)
    assert len(records) == 60
    assert all(record["args_equal"] for record in records)


@pytest.mark.slow
def test_after_kills_each_callback_gets_its_items_back(
        small_shop: LocalSite, crawl_database: str, tmp_path: Path) -> None:
    """5 SIGKILLs at moments given by the crawl's progress, then a resume to the end: the
    requests carrying items were stored (none fetched from memory), and every product's
    callback, also those of requests loaded by a later process, got back items equal to
    those its request was given."""
    command = [sys.executable, "-m", "scrapy", "runspider", str(ITEM_ARGS_SPIDER),
               "-a", f"url={small_shop.url}", "-s", f"IDEMPOTENT_DATABASE={crawl_database}",
               "-s", 'ADDONS={"scrapy_idempotent.Addon": 0}', "-s", "ROBOTSTXT_OBEY=False",
               "-s", "TELNETCONSOLE_ENABLED=False", "-s", "CONCURRENT_REQUESTS=8"]
    small_shop.delay = 0.05
    final = kill_crawls(small_shop, command, tmp_path, random.Random(44), 5, more=(4, 10))
    records = stored_products(crawl_database)
    assert len(records) == 60
    assert [r["url"] for r in records if not r["args_equal"]] == []
    logs = [final, *(tmp_path / f"run{n}.log" for n in range(5))]
    for log in logs:
        text = log.read_text(errors="replace")
        assert "fetched from memory" not in text, log
        assert "cannot load stored request" not in text, log
    # the final crawl loaded product requests stored by the killed ones
    assert "'idempotent/requests/leased'" in final.read_text()
