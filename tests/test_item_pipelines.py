"""Item pipelines before ours, in real crawls of the local site: ``DropItem`` and errors in a
pipeline before ``UpsertPipeline``, and pipelines that return a new item object; the records
stored are what reached ours, under the page that yielded them."""

from __future__ import annotations

import dataclasses
from typing import Any

import scrapy
from local_site import LocalSite
from scrapy.exceptions import DropItem
from scrapy.utils.defer import deferred_f_from_coro_f

from helpers.site_crawls import (
    PathSpider,
    assert_nothing_leased,
    crawl,
    finish_reason,
    frontier,
    istats,
    path_of,
    record_owner,
    records,
    settings,
)
from helpers.stored import stored_products, stored_rejects

# -- pipelines: DropItem and errors before ours -------------------------------------------------


class PickyPipeline:
    """Before ours: drops items marked ``drop``, fails on items marked ``boom``."""

    def process_item(self, item: Any, spider: Any = None) -> Any:
        if item.get("drop"):
            raise DropItem("not wanted")
        if item.get("boom"):
            raise ValueError("pipeline bug")
        return item


class PipelineSpider(PathSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/pipes"))

    def parse(self, response: Any) -> Any:
        yield {"key": "kept"}
        yield {"key": "dropped", "drop": True}
        yield {"key": "broken", "boom": True}
        yield response.follow("/ok/after-pipes", callback=self.parse_after)

    def parse_after(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_drop_item_and_pipeline_error_before_ours(site: LocalSite,
                                                       crawl_database: str) -> None:
    crawler = await crawl(PipelineSpider, settings(
        crawl_database, ITEM_PIPELINES={f"{__name__}.PickyPipeline": 100}), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/ok/pipes": ("done", None, 1),  # the request still ends done
        "/ok/after-pipes": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    assert record_owner(crawl_database, site) == {"kept": "/ok/pipes",
                                           "/ok/after-pipes": "/ok/after-pipes"}
    assert stored_rejects(crawl_database) == []
    stats = istats(crawler)
    assert stats["records/inserted"] == 2
    assert stats["requests/done"] == 2
    assert crawler.stats.get_value("item_dropped_count") == 1
    assert crawler.stats.get_value("item_scraped_count") == 2


class CopyingPipeline:
    """Before ours: returns a new item object (a common habit), not the one it got."""

    def process_item(self, item: Any, spider: Any = None) -> Any:
        return {**item, "copied": True}


@deferred_f_from_coro_f
async def test_pipeline_returning_a_new_item_object(site: LocalSite, crawl_database: str) -> None:
    crawler = await crawl(PipelineSpider, settings(
        crawl_database, ITEM_PIPELINES={f"{__name__}.CopyingPipeline": 100}), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/ok/pipes": ("done", None, 1),
        "/ok/after-pipes": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    stored = records(crawl_database)
    assert set(stored) == {"kept", "dropped", "broken", "/ok/after-pipes"}
    assert all(record["copied"] for record in stored.values())
    # still stored with the request that produced it
    assert record_owner(crawl_database, site) == {
        "kept": "/ok/pipes", "dropped": "/ok/pipes", "broken": "/ok/pipes",
        "/ok/after-pipes": "/ok/after-pipes"}
    assert istats(crawler)["records/inserted"] == 4


@dataclasses.dataclass
class Page:
    """An item type without a configured natural key (the page URL is its key) and without
    room for a record ID field."""

    title: str
    price: int


class RepricingPipeline:
    """Before ours: returns a changed copy of a dataclass item (``dataclasses.replace``)."""

    def process_item(self, item: Any, spider: Any = None) -> Any:
        if isinstance(item, Page):
            return dataclasses.replace(item, price=item.price * 2)
        return item


class PageItemSpider(PathSpider):
    async def start(self) -> Any:
        for name in ("pa", "pb"):
            yield scrapy.Request(self.at(f"/ok/{name}"))

    def parse(self, response: Any) -> Any:
        yield Page(title=path_of(response), price=10)


@deferred_f_from_coro_f
async def test_pipeline_returning_a_new_url_keyed_item_is_stored_under_its_page(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(PageItemSpider, settings(
        crawl_database, ITEM_PIPELINES={f"{__name__}.RepricingPipeline": 100}), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {"/ok/pa": ("done", None, 1),
                                       "/ok/pb": ("done", None, 1)}
    assert_nothing_leased(crawl_database)
    stored = sorted(record["title"] for record in stored_products(crawl_database)
                    if record["price"] == 20)
    assert stored == ["/ok/pa", "/ok/pb"], [r.reason for r in stored_rejects(crawl_database)]
    stats = istats(crawler)
    assert stats["records/inserted"] == 2
    assert "records/rejected" not in stats
