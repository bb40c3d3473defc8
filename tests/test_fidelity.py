"""Drop-in fidelity: with the add-on, a spider behaves as it does under plain Scrapy.

Each test runs real crawls in this process against :class:`paths_site.PathsSite` and checks
what a Scrapy user sees (requests sent and their order, ``item_scraped``, ``request_dropped``,
Scrapy's own stats and log lines) besides what the frontier stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import scrapy
from paths_site import PathsSite
from scrapy import signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, db_rows


@pytest.fixture
def site() -> Iterator[PathsSite]:
    with PathsSite() as paths_site:
        yield paths_site
    assert paths_site.errors == []


def settings(db_path: Path, **extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "key"},
        "DOWNLOAD_TIMEOUT": 5,
        "CONCURRENT_REQUESTS": 4,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "TELNETCONSOLE_ENABLED": False,
    }
    values.update(extra)
    return crawl_settings(db_path, **values)


class Observed:
    """What Scrapy's signals told a user about one crawl."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.scraped: list[Any] = []
        self.dropped: list[str] = []
        self.sent: list[str] = []
        crawler.signals.connect(self.on_scraped, signals.item_scraped)
        crawler.signals.connect(self.on_dropped, signals.request_dropped)
        crawler.signals.connect(self.on_sent, signals.request_reached_downloader)

    def on_scraped(self, item: Any) -> None:
        self.scraped.append(item)

    def on_dropped(self, request: Any) -> None:
        self.dropped.append(request.url)

    def on_sent(self, request: Any) -> None:
        self.sent.append(request.url)

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.crawler.stats.get_stats())

    @property
    def reason(self) -> str:
        return str(self.crawler.stats.get_value("finish_reason"))


async def crawl(spidercls: type, settings_dict: dict[str, Any], **kwargs: Any) -> Observed:
    crawler = get_crawler(spidercls, settings_dict)
    observed = Observed(crawler)
    await crawler.crawl_async(**kwargs)
    return observed


def records(db_path: Path) -> list[dict[str, Any]]:
    return [json.loads(data) for (data,) in db_rows(db_path, "SELECT data FROM records")]


def path_of(url: str) -> str:
    from urllib.parse import urlsplit

    split = urlsplit(url)
    return split.path + (f"?{split.query}" if split.query else "")


class SiteSpider(scrapy.Spider):
    name = "fidelity"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    def at(self, path: str) -> str:
        return self.base_url + path


# -- IDEMPOTENT_RECORD_ID_FIELD ----------------------------------------------------------------


class OneItemSpider(SiteSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/one"))

    def parse(self, response: Any) -> Any:
        yield {"key": "one"}


@pytest.mark.parametrize("value", [None, ""])
@deferred_f_from_coro_f
async def test_record_id_field_none_or_empty_leaves_items_unchanged(
    site: PathsSite, db_path: Path, value: str | None
) -> None:
    observed = await crawl(OneItemSpider, settings(
        db_path, IDEMPOTENT_RECORD_ID_FIELD=value), url=site.url)
    assert observed.reason == "finished"
    assert observed.scraped == [{"key": "one"}]
    assert records(db_path) == [{"key": "one"}]


@deferred_f_from_coro_f
async def test_record_id_field_default_stamps_dict_items(site: PathsSite, db_path: Path) -> None:
    observed = await crawl(OneItemSpider, settings(db_path), url=site.url)
    [item] = observed.scraped
    [(record_id,)] = db_rows(db_path, "SELECT record_id FROM records")
    assert item == {"key": "one", "record_id": record_id}


# -- request order (upstream tests/test_engine_loop.py, TestRequestSendOrder) ------------------


class OrderSpider(SiteSpider):
    """Yields start requests and, between them, puts requests into the scheduler directly
    (``plan``: ``("yield" | "enqueue", number, priority)``); one request at a time."""

    plan: tuple[tuple[str, int, int], ...] = ()

    def request(self, number: int, priority: int = 0) -> scrapy.Request:
        return scrapy.Request(self.at(f"/ok/order?n={number}"), priority=priority,
                              dont_filter=True)

    async def start(self) -> Any:
        for how, number, priority in self.plan:
            if how == "yield":
                yield self.request(number, priority)
            else:
                self.crawler.engine.scheduler.enqueue_request(self.request(number, priority))

    def parse(self, response: Any) -> Any:
        return None


def sent_numbers(observed: Observed) -> list[int]:
    return [int(url.rsplit("=", 1)[1]) for url in observed.sent]


ONE_AT_A_TIME = {"CONCURRENT_REQUESTS": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1}


@pytest.mark.parametrize(("queue_settings", "plan"), [
    # by default, start requests in the order yielded; at equal priority other requests
    # (here put into the scheduler directly) first
    ({}, (("yield", 1, 0), ("enqueue", 2, 1), ("enqueue", 5, 0), ("yield", 6, 0),
          ("yield", 3, 1), ("yield", 4, 1))),
    # LIFO start queue: start requests newest first, still after other requests
    ({"SCHEDULER_START_MEMORY_QUEUE": "scrapy.squeues.LifoMemoryQueue"},
     (("yield", 1, 0), ("enqueue", 2, 1), ("enqueue", 5, 0), ("yield", 6, 0),
      ("yield", 4, 1), ("yield", 3, 1))),
    # no start queue: start requests share the (LIFO) queue of the others
    ({"SCHEDULER_START_MEMORY_QUEUE": None},
     (("yield", 1, 0), ("enqueue", 7, 1), ("enqueue", 6, 1), ("enqueue", 13, 0),
      ("enqueue", 12, 0), ("yield", 11, 0), ("yield", 10, 0), ("yield", 5, 1),
      ("yield", 4, 1), ("enqueue", 3, 1), ("enqueue", 2, 1), ("enqueue", 9, 0),
      ("enqueue", 8, 0))),
], ids=["default", "lifo-start", "shared-queues"])
@deferred_f_from_coro_f
async def test_requests_are_sent_in_scrapys_order(
    site: PathsSite, db_path: Path, queue_settings: dict[str, Any],
    plan: tuple[tuple[str, int, int], ...],
) -> None:
    spidercls = type("PlannedSpider", (OrderSpider,), {"plan": plan})
    plain = await crawl(spidercls, {**ONE_AT_A_TIME, **queue_settings,
                                    "TELNETCONSOLE_ENABLED": False}, url=site.url)
    expected = sorted(number for _, number, _ in plan)
    assert sent_numbers(plain) == expected  # what Scrapy itself does
    observed = await crawl(spidercls, settings(db_path, **ONE_AT_A_TIME, **queue_settings),
                           url=site.url)
    assert observed.reason == "finished"
    assert sent_numbers(observed) == expected


class DepthFirstSpider(SiteSpider):
    """Start requests ``s1..s3``; each page links two children (``/ok/<name>a``,
    ``/ok/<name>b``) down to depth 2."""

    async def start(self) -> Any:
        for name in ("s1", "s2", "s3"):
            yield scrapy.Request(self.at(f"/ok/{name}"))

    def parse(self, response: Any) -> Any:
        name = path_of(response.url).rsplit("/", 1)[1]
        if len(name) < 4:
            for suffix in "ab":
                yield scrapy.Request(self.at(f"/ok/{name}{suffix}"))


@pytest.mark.parametrize("queue_settings", [
    {}, {"SCHEDULER_MEMORY_QUEUE": "scrapy.squeues.FifoMemoryQueue", "DEPTH_PRIORITY": 1}],
    ids=["default", "breadth-first"])
@deferred_f_from_coro_f
async def test_crawl_order_matches_scrapy_one_request_at_a_time(
    site: PathsSite, db_path: Path, queue_settings: dict[str, Any]
) -> None:
    plain = await crawl(DepthFirstSpider, {**ONE_AT_A_TIME, **queue_settings,
                                           "TELNETCONSOLE_ENABLED": False}, url=site.url)
    observed = await crawl(DepthFirstSpider, settings(
        db_path, **ONE_AT_A_TIME, **queue_settings), url=site.url)
    assert observed.reason == "finished"
    assert [path_of(u) for u in observed.sent] == [path_of(u) for u in plain.sent]
