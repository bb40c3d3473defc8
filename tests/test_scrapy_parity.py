"""Parity with plain Scrapy: with the add-on (a drop-in), a spider behaves as it does under
plain Scrapy.

Each test runs real crawls in this process against the local site (``site`` fixture) and
checks what a Scrapy user sees (requests sent and their order, ``item_scraped``,
``request_dropped``, Scrapy's own stats and log lines) besides what the frontier stored.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import pytest
import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_to_end
from helpers.observed_crawls import (
    ONE_AT_A_TIME,
    Observed,
    SiteSpider,
    crawl,
    path_of,
    records,
    settings,
)
from helpers.stored import frontier_entries, stored_records
from scrapy_idempotent import scrapy_compat

# -- IDEMPOTENT_RECORD_ID_FIELD ----------------------------------------------------------------


class OneItemSpider(SiteSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/one"))

    def parse(self, response: Any) -> Any:
        yield {"key": "one"}


@pytest.mark.parametrize("value", [None, ""])
@deferred_f_from_coro_f
async def test_record_id_field_none_or_empty_leaves_items_unchanged(
    site: LocalSite, crawl_database: str, value: str | None
) -> None:
    observed = await crawl(OneItemSpider, settings(
        crawl_database, IDEMPOTENT_RECORD_ID_FIELD=value), url=site.url)
    assert observed.reason == "finished"
    assert observed.scraped == [{"key": "one"}]
    assert records(crawl_database) == [{"key": "one"}]


@deferred_f_from_coro_f
async def test_record_id_field_default_stamps_dict_items(site: LocalSite,
                                                         crawl_database: str) -> None:
    observed = await crawl(OneItemSpider, settings(crawl_database), url=site.url)
    [item] = observed.scraped
    [record_id] = [r.record_id for r in stored_records(crawl_database)]
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
                scheduler = scrapy_compat.engine_scheduler(self.crawler)
                scheduler.enqueue_request(self.request(number, priority))

    def parse(self, response: Any) -> Any:
        return None


def sent_numbers(observed: Observed) -> list[int]:
    return [int(url.rsplit("=", 1)[1]) for url in observed.sent]


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
    site: LocalSite, crawl_database: str, queue_settings: dict[str, Any],
    plan: tuple[tuple[str, int, int], ...],
) -> None:
    spidercls = type("PlannedSpider", (OrderSpider,), {"plan": plan})
    plain = await crawl(spidercls, {**ONE_AT_A_TIME, **queue_settings,
                                    "TELNETCONSOLE_ENABLED": False}, url=site.url)
    expected = sorted(number for _, number, _ in plan)
    assert sent_numbers(plain) == expected  # what Scrapy itself does
    observed = await crawl(spidercls, settings(crawl_database, **ONE_AT_A_TIME, **queue_settings),
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
    site: LocalSite, crawl_database: str, queue_settings: dict[str, Any]
) -> None:
    plain = await crawl(DepthFirstSpider, {**ONE_AT_A_TIME, **queue_settings,
                                           "TELNETCONSOLE_ENABLED": False}, url=site.url)
    observed = await crawl(DepthFirstSpider, settings(
        crawl_database, **ONE_AT_A_TIME, **queue_settings), url=site.url)
    assert observed.reason == "finished"
    assert [path_of(u) for u in observed.sent] == [path_of(u) for u in plain.sent]


# -- duplicates (DUPEFILTER_CLASS, DUPEFILTER_DEBUG, request_dropped) ---------------------------


class DuplicateLinksSpider(SiteSpider):
    """``/ok/a`` links ``b`` twice and ``c``; ``b`` links ``a`` (already done) and ``c``;
    ``c`` links nothing."""

    links: ClassVar[dict[str, tuple[str, ...]]] = {"a": ("b", "b", "c"), "b": ("a", "c"),
                                                   "c": ()}

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/a"))

    def parse(self, response: Any) -> Any:
        name = path_of(response.url).rsplit("/", 1)[1]
        yield {"key": name}
        for link in self.links[name]:
            yield scrapy.Request(self.at(f"/ok/{link}"))


@deferred_f_from_coro_f
async def test_duplicates_are_dropped_and_counted_as_by_scrapys_dupefilter(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    plain = await crawl(DuplicateLinksSpider, {"TELNETCONSOLE_ENABLED": False}, url=site.url)
    site.reset_counts()
    caplog.set_level("DEBUG")
    caplog.clear()  # only this crawl's lines (Scrapy 2.13 lets the plain crawl's through)
    observed = await crawl(DuplicateLinksSpider, settings(crawl_database), url=site.url)
    assert observed.reason == "finished"
    assert site.counts_by_path() == {"/ok/a": 1, "/ok/b": 1, "/ok/c": 1}
    # the second b (buffered with the first, not yet written), a (done) and c (pending or
    # buffered): refused, as Scrapy refuses them
    assert sorted(map(path_of, observed.dropped)) == sorted(map(path_of, plain.dropped)) == [
        "/ok/a", "/ok/b", "/ok/c"]
    assert observed.stats["dupefilter/filtered"] == plain.stats["dupefilter/filtered"] == 3
    lines = [r.getMessage() for r in caplog.records if "Filtered duplicate" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].endswith("- no more duplicates will be shown (see DUPEFILTER_DEBUG to "
                             "show all duplicates)")


class HoldingPipeline:
    """Holds the item of ``/ok/p1`` (so that page is not finished) until the spider says
    ``/block/p2`` was parsed; releases ``/block/p2`` when it gets that item."""

    async def process_item(self, item: Any, spider: Any = None) -> Any:
        # ``spider``: Scrapy 2.13 still passes it
        from scrapy.utils.defer import maybe_deferred_to_future

        spider = self.crawler.spider  # type: ignore[attr-defined]
        if item["key"] == "p1":
            spider.release_p2()
            await maybe_deferred_to_future(spider.p2_parsed)
        return item

    @classmethod
    def from_crawler(cls, crawler: Any) -> HoldingPipeline:
        pipeline = cls()
        pipeline.crawler = crawler  # type: ignore[attr-defined]
        return pipeline


class TwoPagesOneLinkSpider(SiteSpider):
    """Two pages in flight at once link the same URL: the second link arrives while the
    first is only buffered (its page is not finished)."""

    def __init__(self, url: str, release_p2: Any, **kwargs: Any) -> None:
        from twisted.internet.defer import Deferred

        super().__init__(url, **kwargs)
        self.release_p2 = release_p2
        self.p2_parsed: Deferred[None] = Deferred()

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/p1"))
        yield scrapy.Request(self.at("/block/p2"))

    def parse(self, response: Any) -> Any:
        name = path_of(response.url).rsplit("/", 1)[1]
        if name in ("p1", "p2"):
            yield scrapy.Request(self.at("/ok/shared"))
        yield {"key": name}
        if name == "p2":
            self.p2_parsed.callback(None)


@deferred_f_from_coro_f
async def test_a_link_buffered_by_a_page_in_flight_is_a_duplicate_for_another_page(
    site: LocalSite, crawl_database: str
) -> None:
    site.block()
    observed = await crawl(TwoPagesOneLinkSpider, settings(
        crawl_database, ITEM_PIPELINES={f"{__name__}.HoldingPipeline": 500}),
        url=site.url, release_p2=site.release)
    assert observed.reason == "finished"
    assert list(map(path_of, observed.dropped)) == ["/ok/shared"]
    assert observed.stats["dupefilter/filtered"] == 1
    assert site.hits("/ok/shared") == 1
    entries = frontier_entries(crawl_database)
    owner = {e.key: e.url for e in entries}
    [parent_key] = [e.parent_key for e in entries if e.url == site.url + "/ok/shared"]
    assert owner[parent_key] == site.url + "/ok/p1"  # written by the page that yielded it first


@deferred_f_from_coro_f
async def test_dupefilter_debug_logs_every_duplicate_with_its_referer(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    caplog.set_level("DEBUG")
    observed = await crawl(DuplicateLinksSpider, settings(crawl_database, DUPEFILTER_DEBUG=True),
                           url=site.url)
    lines = [r.getMessage() for r in caplog.records if "Filtered duplicate" in r.getMessage()]
    assert len(lines) == observed.stats["dupefilter/filtered"] == 3
    assert all(f"(referer: {site.url}/ok/" in line for line in lines), lines


@deferred_f_from_coro_f
async def test_base_dupefilter_filters_nothing_as_in_scrapy(
    site: LocalSite, crawl_database: str
) -> None:
    class ShortSpider(DuplicateLinksSpider):
        links: ClassVar[dict[str, tuple[str, ...]]] = {"a": ("b", "b", "c"), "b": (), "c": ()}

    no_filter = {"DUPEFILTER_CLASS": "scrapy.dupefilters.BaseDupeFilter"}
    plain = await crawl(ShortSpider, {"TELNETCONSOLE_ENABLED": False, **no_filter},
                        url=site.url)
    expected = site.counts_by_path()
    assert expected == {"/ok/a": 1, "/ok/b": 2, "/ok/c": 1}
    site.reset_counts()
    observed = await crawl(ShortSpider, settings(crawl_database, **no_filter), url=site.url)
    assert observed.reason == "finished"
    assert site.counts_by_path() == expected
    assert observed.dropped == plain.dropped == []
    assert "dupefilter/filtered" not in observed.stats
    # each request is its own entry, keyed by its parent and rank: the finished run
    # resumed adds nothing
    assert len(frontier_entries(crawl_database)) == 4
    site.reset_counts()
    again = await crawl(ShortSpider, settings(crawl_database, IDEMPOTENT_RUN_MODE="resume",
                                              **no_filter), url=site.url)
    assert again.reason == "finished"
    assert site.counts_by_path() == {}
    assert len(frontier_entries(crawl_database)) == 4


@deferred_f_from_coro_f
async def test_another_dupefilter_class_is_refused_at_start(
    site: LocalSite, crawl_database: str
) -> None:
    from scrapy_idempotent.exceptions import ConfigError

    crawler = get_crawler(DuplicateLinksSpider, settings(
        crawl_database, DUPEFILTER_CLASS="test_scrapy_parity.CustomDupeFilter"))
    with pytest.raises(ConfigError) as raised:
        await crawl_to_end(crawler, url=site.url)
    assert raised.value.setting == "DUPEFILTER_CLASS"
    assert "REQUEST_FINGERPRINTER_CLASS" in str(raised.value)
    assert site.request_count == 0


class CustomDupeFilter:
    """A project's own duplicate filter (never consulted with the add-on)."""


# -- several dont_filter requests to one URL -----------------------------------------------------


class PollingSpider(SiteSpider):
    """``/ok/poll`` asks for itself three more times (``dont_filter``, told apart by meta),
    as a spider polling a page or paginating by POST does."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/poll"))

    def parse(self, response: Any) -> Any:
        for n in (1, 2, 3):
            yield scrapy.Request(response.url, dont_filter=True, meta={"n": n},
                                 callback=self.parse_poll)

    def parse_poll(self, response: Any) -> Any:
        yield {"key": f"poll-{response.meta['n']}"}


@deferred_f_from_coro_f
async def test_dont_filter_requests_to_the_pages_own_url_are_each_fetched(
    site: LocalSite, crawl_database: str
) -> None:
    plain = await crawl(PollingSpider, {"TELNETCONSOLE_ENABLED": False}, url=site.url)
    assert sorted(i["key"] for i in plain.scraped) == ["poll-1", "poll-2", "poll-3"]
    site.reset_counts()
    observed = await crawl(PollingSpider, settings(crawl_database), url=site.url)
    assert observed.reason == "finished"
    assert site.hits("/ok/poll") == 4
    assert sorted(i["key"] for i in observed.scraped) == ["poll-1", "poll-2", "poll-3"]
    assert sorted(r["key"] for r in records(crawl_database)) == ["poll-1", "poll-2", "poll-3"]
    assert Counter(e.state for e in frontier_entries(crawl_database)) == {"done": 4}
    assert "idempotent/requests/retried" not in observed.stats


# -- items from start() and from spider middlewares nearer the engine -----------------------------


@dataclasses.dataclass
class Note:
    title: str


def as_json(item: Any) -> str:
    from itemadapter import ItemAdapter

    return json.dumps(ItemAdapter(item).asdict(), sort_keys=True)


class StartItemsSpider(SiteSpider):
    """``start()`` yields items (one with its natural key, one of a type without a configured
    key) besides a request; the callback raises on ``/ok/boom``."""

    async def start(self) -> Any:
        yield {"key": "from-start"}
        yield Note(title="no key configured for this type")
        yield scrapy.Request(self.at("/ok/page"))
        yield scrapy.Request(self.at("/ok/boom"))

    def parse(self, response: Any) -> Any:
        if response.url.endswith("/boom"):
            raise ValueError("boom")
        yield {"key": "from-page"}


class AddingMiddleware:
    """A project's spider middleware nearer the engine than RecordIdMiddleware (priority 5):
    it adds an item to every page's output, one to start(), and recovers from a callback's
    exception with an item (as upstream's test_recovery does)."""

    async def process_start(self, start: Any) -> Any:
        async for output in start:
            yield output
        yield {"key": "added-to-start"}

    # ``spider``: Scrapy 2.13 passes it
    async def process_spider_output(self, response: Any, result: Any, spider: Any = None
                                    ) -> Any:
        async for output in result:
            yield output
        yield {"key": f"added-to-{path_of(response.url)}"}

    def process_spider_exception(self, response: Any, exception: Exception,
                                 spider: Any = None) -> Any:
        return [{"key": f"recovered-{path_of(response.url)}"}]


@deferred_f_from_coro_f
async def test_items_from_start_and_from_middlewares_are_stored_and_scraped(
    site: LocalSite, crawl_database: str
) -> None:
    middlewares = {"SPIDER_MIDDLEWARES": {f"{__name__}.AddingMiddleware": 5}}
    plain = await crawl(StartItemsSpider, {"TELNETCONSOLE_ENABLED": False, **middlewares},
                        url=site.url)
    expected = sorted(map(as_json, plain.scraped))
    assert len(expected) == 7
    observed = await crawl(StartItemsSpider, settings(
        crawl_database, IDEMPOTENT_RECORD_ID_FIELD=None, **middlewares), url=site.url)
    assert observed.reason == "finished"
    assert sorted(map(as_json, observed.scraped)) == expected
    assert sorted(json.dumps(r, sort_keys=True) for r in records(crawl_database)) == expected
    assert "idempotent/records/rejected" not in observed.stats
    # items of a page commit with it; items of start() with no page
    urls = {e.key: e.url for e in frontier_entries(crawl_database)}
    owners = {r.natural_key: urls.get(r.request_key) if r.request_key is not None else None
              for r in stored_records(crawl_database)}
    assert owners['["added-to-/ok/page"]'] == owners['["from-page"]'] == site.url + "/ok/page"
    assert owners['["recovered-/ok/boom"]'] == site.url + "/ok/boom"
    assert owners['["from-start"]'] is None and owners['["added-to-start"]'] is None

    # start() runs again on resume: its items are the same records (the keyless one is keyed
    # by its content), nothing is inserted twice
    again = await crawl(StartItemsSpider, settings(
        crawl_database, IDEMPOTENT_RECORD_ID_FIELD=None, IDEMPOTENT_RUN_MODE="resume",
        **middlewares), url=site.url)
    assert again.reason == "finished"
    assert len(records(crawl_database)) == 7
    assert again.stats["idempotent/records/unchanged"] == 3
    assert "idempotent/records/inserted" not in again.stats


@deferred_f_from_coro_f
async def test_middleware_outside_a_crawl_passes_output_through(db_path: Path) -> None:
    # as Scrapy's own middleware tests drive the spider middlewares: a crawler that never
    # crawls, so it has no engine and no scheduler
    from scrapy.core.spidermw import SpiderMiddlewareManager
    from scrapy.http import HtmlResponse

    crawler = get_crawler(OneItemSpider, settings(db_path))
    crawler.spider = crawler._create_spider(url="http://example.com")
    manager = SpiderMiddlewareManager.from_crawler(crawler)
    request = scrapy.Request("http://example.com/ok/one")
    response = HtmlResponse(request.url, body=b"<html></html>", request=request)

    def answer() -> list[Any]:
        return [{"key": "one"}, scrapy.Request("http://example.com/next")]

    async def callback(response: Any, request: Any) -> Any:  # Scraper.call_spider_async
        return answer()

    if hasattr(manager, "scrape_response_async"):
        output = await manager.scrape_response_async(callback, response, request)
    else:  # Scrapy 2.13: a Deferred, and the callback answers at once
        from scrapy.utils.defer import maybe_deferred_to_future

        output = await maybe_deferred_to_future(manager.scrape_response(
            lambda response, request: answer(), response, request, crawler.spider))
    results = [o async for o in output]
    assert results[0] == {"key": "one"}  # not stamped
    assert isinstance(results[1], scrapy.Request)
    assert not db_path.exists()


@deferred_f_from_coro_f
async def test_middleware_and_pipeline_with_an_engine_but_no_scheduler_raise(
    db_path: Path,
) -> None:
    # the crawl's engine is built but its scheduler cannot be found: storing nothing
    # silently would lose the crawl's work; a clear error instead
    from scrapy.core.spidermw import SpiderMiddlewareManager
    from scrapy.http import HtmlResponse

    from scrapy_idempotent import IdempotentError
    from scrapy_idempotent.pipeline import UpsertPipeline

    crawler = get_crawler(OneItemSpider, settings(db_path))
    crawler.spider = crawler._create_spider(url="http://example.com")
    crawler.engine = crawler._create_engine()
    assert scrapy_compat.engine_scheduler(crawler) is None
    manager = SpiderMiddlewareManager.from_crawler(crawler)
    request = scrapy.Request("http://example.com/ok/one")
    response = HtmlResponse(request.url, body=b"<html></html>", request=request)

    async def callback(response: Any, request: Any) -> Any:
        return [{"key": "one"}]

    with pytest.raises(IdempotentError, match="RecordIdMiddleware found the crawl's engine "
                                              "but no scheduler"):
        if hasattr(manager, "scrape_response_async"):
            output = await manager.scrape_response_async(callback, response, request)
        else:  # Scrapy 2.13
            from scrapy.utils.defer import maybe_deferred_to_future

            output = await maybe_deferred_to_future(manager.scrape_response(
                lambda response, request: [{"key": "one"}], response, request,
                crawler.spider))
        [o async for o in output]
    pipeline = UpsertPipeline.from_crawler(crawler)
    with pytest.raises(IdempotentError, match="UpsertPipeline found the crawl's engine"):
        pipeline.open_spider(crawler.spider)


# -- errors name their cause ---------------------------------------------------------------------


class PickyFingerprinter:
    """Scrapy's fingerprinter, except that it raises for URLs containing ``bad``."""

    def __init__(self, crawler: Any = None) -> None:
        from scrapy.utils.request import RequestFingerprinter

        self.default = RequestFingerprinter(crawler)

    @classmethod
    def from_crawler(cls, crawler: Any) -> PickyFingerprinter:
        return cls(crawler)

    def fingerprint(self, request: Any) -> bytes:
        if "bad" in request.url:
            raise ValueError(f"cannot fingerprint {request.url}")
        fingerprint: bytes = self.default.fingerprint(request)
        return fingerprint


class LinkingSpider(SiteSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/home"))
        yield scrapy.Request(self.at("/ok/bad-start"))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response.url)}
        if response.url.endswith("/home"):
            yield scrapy.Request(self.at("/ok/good"))
            yield scrapy.Request(self.at("/ok/bad-child"))


@deferred_f_from_coro_f
async def test_a_fingerprinter_error_refuses_the_request_and_names_the_fingerprinter(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    observed = await crawl(LinkingSpider, settings(
        crawl_database, REQUEST_FINGERPRINTER_CLASS=f"{__name__}.PickyFingerprinter"),
        url=site.url)
    # not a store error: the crawl goes on and finishes
    assert observed.reason == "finished"
    assert "idempotent/error" not in observed.stats
    assert sorted(map(path_of, observed.dropped)) == ["/ok/bad-child", "/ok/bad-start"]
    assert observed.stats["idempotent/requests/unidentified"] == 2
    assert site.counts_by_path() == {"/ok/home": 1, "/ok/good": 1}
    # the page whose child could not be identified stays visible (failed, retryable)
    states = {path_of(e.url): (e.state, e.error_kind) for e in frontier_entries(crawl_database)}
    assert states == {"/ok/home": ("failed", "fingerprint_error_child"),
                      "/ok/good": ("done", None)}
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors  # once per cause
    assert f"{__name__}.PickyFingerprinter raised ValueError" in errors[0]


# -- requests that cannot be stored ------------------------------------------------------------


class ChainSpider(SiteSpider):
    """Each request carries the next one in its meta (as upstream's test_referer_header
    spider does): none can be stored as data."""

    async def start(self) -> Any:
        third = scrapy.Request(self.at("/ok/chain3"))
        second = scrapy.Request(self.at("/ok/chain2"), meta={"next": third})
        yield scrapy.Request(self.at("/ok/chain1"), meta={"next": second})
        yield scrapy.Request(self.at("/ok/plain"))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response.url)}
        if "next" in response.meta:
            yield response.meta["next"]


@deferred_f_from_coro_f
async def test_unstorable_start_requests_and_their_children_are_fetched_as_in_scrapy(
    site: LocalSite, crawl_database: str
) -> None:
    plain = await crawl(ChainSpider, {"TELNETCONSOLE_ENABLED": False}, url=site.url)
    expected = sorted(map(path_of, plain.sent))
    assert expected == ["/ok/chain1", "/ok/chain2", "/ok/chain3", "/ok/plain"]
    site.reset_counts()
    observed = await crawl(ChainSpider, settings(crawl_database), url=site.url)
    assert observed.reason == "finished"
    assert sorted(map(path_of, observed.sent)) == expected
    assert observed.dropped == []
    assert sorted(i["key"] for i in observed.scraped) == expected
    # their items are stored; the storable requests are in the frontier (chain3, yielded by
    # a memory request of start(), is written when that request is finished)
    assert sorted(r["key"] for r in records(crawl_database)) == expected
    assert sorted((e.url, e.state) for e in frontier_entries(crawl_database)) == [
        (site.url + "/ok/chain3", "done"), (site.url + "/ok/plain", "done")]
    assert observed.stats["idempotent/requests/unstorable"] == 2
    assert observed.stats["idempotent/requests/from_memory"] == 2


class NotesSpider(SiteSpider):
    """A page yields three items of a type without a configured natural key; ``start()``
    also yields objects that are not items (Scrapy passes them on as they are)."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/notes"))
        yield "not an item"

    def parse(self, response: Any) -> Any:
        for title in ("first", "second", "third"):
            yield Note(title=title)


@deferred_f_from_coro_f
async def test_several_items_of_a_page_without_a_key_are_several_records(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    plain = await crawl(NotesSpider, {"TELNETCONSOLE_ENABLED": False}, url=site.url)
    observed = await crawl(NotesSpider, settings(crawl_database), url=site.url)
    assert observed.reason == "finished"
    assert len(observed.scraped) == len(plain.scraped) == 4
    assert "not an item" in observed.scraped
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert sorted(r["title"] for r in records(crawl_database)) == ["first", "second", "third"]
    assert observed.stats["idempotent/items/keyed_by_rank"] == 2
    keys = sorted(json.loads(r.natural_key) for r in stored_records(crawl_database))
    page = site.url + "/ok/notes"
    assert keys == [[page], [page, "test_scrapy_parity.Note", "#2"],
                    [page, "test_scrapy_parity.Note", "#3"]]
    # told apart by their order on the page: the same records in the next run
    again = await crawl(NotesSpider, settings(crawl_database), url=site.url)
    assert again.stats["idempotent/records/unchanged"] == 3
    assert len(records(crawl_database)) == 3
