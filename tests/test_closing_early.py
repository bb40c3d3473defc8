"""A crawl closed early (``CloseSpider`` from a callback, ``CLOSESPIDER_ITEMCOUNT``) keeps
what it finished and leaves the rest pending, and the next crawl finishes the job; a spider
paginating with a counter of its own resumes its pending page."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import pytest
import scrapy
from local_site import LocalSite
from scrapy.exceptions import CloseSpider
from scrapy.utils.defer import deferred_f_from_coro_f

from helpers.site_crawls import (
    PathSpider,
    assert_nothing_leased,
    crawl,
    finish_reason,
    frontier,
    istats,
    path_of,
    records,
    rows,
    settings,
)

# -- closing early and finishing in the next crawl ------------------------------------------------


#: Keys after this one are served by ``/block/...`` in the CloseSpider tests.
GATE_AFTER_KEY = 4


def keyed_path(key: int) -> str:
    """Keys up to :data:`GATE_AFTER_KEY` are answered at once; later ones wait for the
    site's release, which the spider gives when it raises CloseSpider. So what a crawl
    fetches after the stop is bounded by the requests in flight, however long Scrapy takes
    to run the callback (before 2.18 it waited 0.1 s first, long enough to download every
    page of this test)."""
    return f"/ok/k{key}" if key <= GATE_AFTER_KEY else f"/block/k{key}"


class KeyedSpider(PathSpider):
    """40 keyed requests (the key in ``cb_kwargs``); ``stop_at`` raises CloseSpider
    in the callback of that key before it yields its record (after calling ``release``)."""

    def __init__(self, url: str, stop_at: int | None = None,
                 release: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.stop_at = stop_at
        self.release = release
        self.seen: list[int] = []

    async def start(self) -> Any:
        for key in range(40):
            # priorities: keys in ascending order, so key 4 comes early
            yield scrapy.Request(self.at(keyed_path(key)), cb_kwargs={"key": key},
                                 priority=40 - key)

    def parse(self, response: Any, key: int) -> Any:
        self.seen.append(key)
        if key == self.stop_at:
            if self.release is not None:
                self.release()
            raise CloseSpider("stop_at_key")
        yield {"key": f"k{key}", "path": path_of(response)}


@deferred_f_from_coro_f
async def test_close_spider_from_a_callback_then_the_next_crawl_finishes_the_job(
    site: LocalSite, crawl_database: str
) -> None:
    first = await crawl(KeyedSpider, settings(crawl_database, CONCURRENT_REQUESTS=2), url=site.url,
                        stop_at=GATE_AFTER_KEY, release=site.release)
    assert finish_reason(first) == "stop_at_key"
    assert_nothing_leased(crawl_database)
    after_first = frontier(crawl_database, site)
    assert len(after_first) == 40
    done_first = {url for url, (state, _, _) in after_first.items() if state == "done"}
    pending = {url for url, (state, _, _) in after_first.items() if state == "pending"}
    assert done_first | pending == set(after_first)  # nothing else: no failed, no leased
    # the request whose callback raised CloseSpider did not finish: it is not done
    assert keyed_path(GATE_AFTER_KEY) in pending
    # at most CONCURRENT_REQUESTS requests were in flight behind the gate when it stopped
    assert len(pending) >= 40 - (GATE_AFTER_KEY + 1) - 2
    assert {f"k{k}" for k in first.spider.seen if k != GATE_AFTER_KEY} == set(
        records(crawl_database))

    second = await crawl(KeyedSpider, settings(crawl_database, CONCURRENT_REQUESTS=2),
                         url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(crawl_database)
    after_second = frontier(crawl_database, site)
    assert set(after_second) == {keyed_path(k) for k in range(40)}
    assert {state for state, _, _ in after_second.values()} == {"done"}
    # every key not done in the first crawl ran in the second, with its own key
    assert sorted(second.spider.seen) == sorted(
        int(u.rsplit("/k", 1)[1]) for u in pending)
    stored = records(crawl_database)
    assert set(stored) == {f"k{k}" for k in range(40)}
    assert all(record["path"] == keyed_path(int(key[1:])) for key, record in stored.items())
    inserted = (istats(first).get("records/inserted", 0)
                + istats(second).get("records/inserted", 0))
    assert inserted == 40  # none twice
    assert "records/updated" not in istats(second)
    assert "records/unchanged" not in istats(second)


class StopMidwaySpider(PathSpider):
    """``/ok/stopper`` yields an item and a child, then raises CloseSpider (first crawl)."""

    def __init__(self, url: str, stop: bool = False, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.stop = stop

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/stopper"), callback=self.parse_stopper)

    def parse_stopper(self, response: Any) -> Any:
        yield {"key": "stopper", "n": 1}
        yield response.follow("/ok/after-stop")
        if self.stop:
            raise CloseSpider("stopped_midway")
        yield {"key": "stopper-tail"}

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_close_spider_midway_keeps_what_was_yielded_and_the_page_stays_due(
    site: LocalSite, crawl_database: str
) -> None:
    first = await crawl(StopMidwaySpider, settings(crawl_database), url=site.url, stop=True)
    assert finish_reason(first) == "stopped_midway"
    assert_nothing_leased(crawl_database)
    after_first = frontier(crawl_database, site)
    assert after_first["/ok/stopper"][0] == "pending"  # its callback did not finish
    assert after_first["/ok/after-stop"][0] in ("pending", "done")
    assert "stopper" in records(crawl_database)

    second = await crawl(StopMidwaySpider, settings(crawl_database), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(crawl_database)
    assert {url: state for url, (state, _, _) in frontier(crawl_database, site).items()} == {
        "/ok/stopper": "done", "/ok/after-stop": "done"}
    assert set(records(crawl_database)) == {"stopper", "stopper-tail", "/ok/after-stop"}
    assert site.hits("/ok/after-stop") == 1
    inserted = (istats(first).get("records/inserted", 0)
                + istats(second).get("records/inserted", 0))
    assert inserted == 3  # none twice; the replayed page's first item is unchanged
    assert istats(second)["records/unchanged"] == 1


class TenPagesSpider(PathSpider):
    """``/ok/root`` links nine pages; every page yields one item. ``/ok/p1`` and ``/ok/p2``
    answer at once, the others (``/block/...``) only once three items went through the
    pipelines: a CLOSESPIDER_* count of 3 is reached with at most one page in flight behind
    the gate, however late Scrapy runs the callbacks (before 2.18 it waited 0.1 s first,
    long enough to download all ten pages)."""

    def __init__(self, url: str, release: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.release = release
        self.items = 0

    @classmethod
    def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> TenPagesSpider:
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider.item_scraped, signal=scrapy.signals.item_scraped)
        return cast("TenPagesSpider", spider)

    def item_scraped(self) -> None:
        self.items += 1
        if self.items == 3 and self.release is not None:
            self.release()

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/root?links=" + ",".join(
            ["/ok/p1", "/ok/p2", *(f"/block/p{n}" for n in range(3, 10))])))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response).split("?")[0]}
        for href in response.css("a::attr(href)").getall():
            # the pages that answer at once first (the frontier is LIFO within a priority)
            yield response.follow(href, priority=1 if href.startswith("/ok/") else 0)


@pytest.mark.parametrize(("setting", "reason"), [
    ("CLOSESPIDER_PAGECOUNT", "closespider_pagecount"),
    ("CLOSESPIDER_ITEMCOUNT", "closespider_itemcount"),
])
@deferred_f_from_coro_f
async def test_closespider_count_leaves_the_rest_pending_for_the_next_crawl(
    site: LocalSite, crawl_database: str, setting: str, reason: str
) -> None:
    one_at_a_time = {"CONCURRENT_REQUESTS": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1}
    first = await crawl(TenPagesSpider, settings(crawl_database, **{setting: 3}, **one_at_a_time),
                        url=site.url, release=site.release)
    assert finish_reason(first) == reason
    assert_nothing_leased(crawl_database)
    states = [state for state, _, _ in frontier(crawl_database, site).values()]
    assert set(states) == {"done", "pending"}
    assert len(states) == 10
    done_first = states.count("done")
    assert 3 <= done_first <= 4  # the three counted, and the one in flight behind the gate
    assert len(records(crawl_database)) == done_first

    second = await crawl(TenPagesSpider, settings(crawl_database, **one_at_a_time), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(crawl_database)
    assert {state for state, _, _ in frontier(crawl_database, site).values()} == {"done"}
    assert len(records(crawl_database)) == 10
    assert (istats(first)["records/inserted"] + istats(second)["records/inserted"]) == 10
    assert istats(second)["requests/done"] == 10 - done_first
    assert all(n == 1 for n in site.counts_by_path().values()), site.counts_by_path()
    assert site.request_count == 10


# -- pagination driven by a counter on the spider -------------------------------------------------


class CounterPaginationSpider(PathSpider):
    """The next page's number comes from a counter on the spider (a pattern reported to break
    resumes with JOBDIR), so after a resume the counter starts from 1 again while the frontier
    is further on."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.page = 1

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/page1"))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response)}
        self.page += 1
        if self.page <= 5:
            yield response.follow(f"/ok/page{self.page}")


@deferred_f_from_coro_f
async def test_counter_pagination_resume_runs_the_pending_page_and_reports_drops(
    site: LocalSite, crawl_database: str, caplog: Any
) -> None:
    one_at_a_time = {"CONCURRENT_REQUESTS": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1}
    first = await crawl(CounterPaginationSpider, settings(
        crawl_database, CLOSESPIDER_PAGECOUNT=2, **one_at_a_time), url=site.url)
    assert finish_reason(first) == "closespider_pagecount"
    assert_nothing_leased(crawl_database)
    assert [r[:3] for r in rows(crawl_database, site)] == [
        ("/ok/page1", "done", None), ("/ok/page2", "done", None),
        ("/ok/page3", "pending", None)]

    site.reset_counts()
    caplog.clear()
    caplog.set_level(logging.INFO, logger="scrapy_idempotent")
    second = await crawl(CounterPaginationSpider, settings(crawl_database, **one_at_a_time),
                         url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(crawl_database)
    # the pending page still runs after the resume ...
    assert site.counts_by_path() == {"/ok/page3": 1}
    assert [r[:3] for r in rows(crawl_database, site)] == [
        ("/ok/page1", "done", None), ("/ok/page2", "done", None),
        ("/ok/page3", "done", None)]
    assert set(records(crawl_database)) == {"/ok/page1", "/ok/page2", "/ok/page3"}
    # ... and the early end (its reset counter linked page 2 again) is visible: the start
    # request and page 2 were dropped as already done, in a stat and in a closing log line
    stats = istats(second)
    assert stats["requests/already_done"] == 2
    assert stats["requests/done"] == 1
    closing = [r.getMessage() for r in caplog.records
               if r.name.startswith("scrapy_idempotent") and "closing" in r.getMessage()]
    assert len(closing) == 1, closing
    assert "2 requests not fetched because already done" in closing[0]
