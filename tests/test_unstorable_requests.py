"""Requests that cannot be stored (fetched from memory under their owner's lease), in real
crawls against the local site (``site`` fixture): a lost lease stops them, a later lease of
the owner fetches them again, a suspect runs alone with them, and they take their turn among
the stored requests by priority as in Scrapy.
"""

from __future__ import annotations

from typing import Any, ClassVar

import scrapy
from local_site import LocalSite
from scrapy import signals
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
from helpers.stored import change_stored, frontier_entries
from scrapy_idempotent import scrapy_compat
from scrapy_idempotent.keys import RequestKeys


def memory_item(response: Any) -> list[dict[str, str]]:
    """The callback of the children below: not a spider method, so they cannot be stored."""
    return [{"key": path_of(response.url)}]


# -- a lost lease ------------------------------------------------------------------------------


class OwnerSpider(SiteSpider):
    """``/ok/owner`` yields three unstorable children (in order of priority) and then a
    storable ``/ok/marker``. ``events``: its callbacks and downloads, in order."""

    events: ClassVar[list[str]] = []

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/owner"))

    def parse(self, response: Any) -> Any:
        self.events.append(f"parse {path_of(response.url)}")
        yield {"key": path_of(response.url)}
        if path_of(response.url) != "/ok/owner":
            return
        for n in (1, 2, 3):
            yield scrapy.Request(self.at(f"/ok/child{n}"), callback=memory_item, priority=-n)
        yield scrapy.Request(self.at("/ok/marker"), dont_filter=True)


@deferred_f_from_coro_f
async def test_a_lost_lease_drops_its_memory_requests_and_a_new_lease_fetches_them_again(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = get_crawler(OwnerSpider, settings(crawl_database, **ONE_AT_A_TIME))
    observed = Observed(crawler)
    events = OwnerSpider.events = []
    stolen_at: list[int] = []

    def on_scheduled(request: Any, spider: Any) -> None:
        # The owner's children are in memory, none sent (one response at a time): its lease
        # is taken away (released, as at a dead worker's reclaim), and the scheduler renews.
        if path_of(request.url) != "/ok/marker" or stolen_at:
            return
        stolen_at.append(len(observed.sent))
        events.append("lease lost")
        change_stored(crawl_database, "UPDATE requests SET state = 'pending', worker = NULL,"
                      " leased_until = NULL WHERE url = ?", (site.url + "/ok/owner",))
        scrapy_compat.engine_scheduler(crawler).leases.renew()

    def on_sent(request: Any, spider: Any) -> None:
        events.append(f"sent {path_of(request.url)}")

    crawler.signals.connect(on_scheduled, signals.request_scheduled)
    crawler.signals.connect(on_sent, signals.request_reached_downloader)
    await crawl_to_end(crawler, url=site.url)
    assert observed.reason == "finished"
    assert stolen_at == [1]
    # nothing of the lost owner is fetched after the loss, until the owner is leased again
    # (its response comes from the journal then: not sent again)
    lost = events.index("lease lost")
    again = events.index("parse /ok/owner", lost)
    assert events[lost + 1:again] == [], events
    # leased again by the same process: its children are fetched again (not refused as
    # duplicates of the lost lease's), and it is done with their items
    assert sorted(e for e in events[again:] if e.startswith("sent")) == [
        "sent /ok/child1", "sent /ok/child2", "sent /ok/child3", "sent /ok/marker"]
    assert sorted(r["key"] for r in records(crawl_database)) == [
        "/ok/child1", "/ok/child2", "/ok/child3", "/ok/marker", "/ok/owner"]
    assert sorted((e.url, e.state) for e in frontier_entries(crawl_database)) == [
        (site.url + "/ok/marker", "done"), (site.url + "/ok/owner", "done")]
    assert observed.stats["idempotent/requests/lease_lost_dropped"] == 3
    assert observed.dropped == []


# -- a suspect runs alone ----------------------------------------------------------------------


class SuspectSpider(SiteSpider):
    """``/ok/suspect`` (highest priority) yields two unstorable children; six other start
    requests."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/suspect"), priority=10)
        for n in range(6):
            yield scrapy.Request(self.at(f"/ok/other{n}"))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response.url)}
        if path_of(response.url) == "/ok/suspect":
            for n in (1, 2):
                yield scrapy.Request(self.at(f"/slow/0.2/child{n}"), callback=memory_item)


@deferred_f_from_coro_f
async def test_a_suspect_runs_alone_until_its_memory_requests_are_finished(
    site: LocalSite, crawl_database: str
) -> None:
    db = crawl_database
    first = await crawl(SuspectSpider, settings(db), url=site.url)
    assert first.reason == "finished"
    # as after two deaths with /ok/suspect in flight: everything pending again
    change_stored(db, "UPDATE requests SET state = 'pending', finished_at = NULL")
    change_stored(db, "UPDATE runs SET finished_at = NULL, reason = NULL")  # resumed
    change_stored(db, "UPDATE requests SET unfinished = 2 WHERE url = ?",
                  (site.url + "/ok/suspect",))
    crawler = get_crawler(SuspectSpider, settings(db))
    observed = Observed(crawler)
    in_flight: set[str] = set()
    overlaps: list[tuple[str, tuple[str, ...]]] = []
    family = ("/ok/suspect", "/slow/0.2/child1", "/slow/0.2/child2")

    def reached(request: Any, spider: Any) -> None:
        path = path_of(request.url)
        mixed = {path, *in_flight}
        if any(p in family for p in mixed) and not all(p in family for p in mixed):
            overlaps.append((path, tuple(sorted(in_flight))))
        in_flight.add(path)

    def left(request: Any, spider: Any) -> None:
        in_flight.discard(path_of(request.url))

    crawler.signals.connect(reached, signals.request_reached_downloader)
    crawler.signals.connect(left, signals.request_left_downloader)
    await crawl_to_end(crawler, url=site.url)
    assert observed.reason == "finished"
    assert sorted(map(path_of, observed.sent)) == sorted(
        [*family, *(f"/ok/other{n}" for n in range(6))])
    assert overlaps == []
    assert observed.stats["idempotent/requests/from_memory"] == 2


# -- order -------------------------------------------------------------------------------------


class PriorityChildrenSpider(SiteSpider):
    """``/ok/page`` (first) yields unstorable children above and below the priority of the
    stored start requests."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/page"), priority=5)
        for n in range(3):
            yield scrapy.Request(self.at(f"/ok/start{n}"))

    def parse(self, response: Any) -> Any:
        if path_of(response.url) == "/ok/page":
            yield scrapy.Request(self.at("/ok/low"), callback=memory_item, priority=-5)
            yield scrapy.Request(self.at("/ok/high"), callback=memory_item, priority=3)
            yield scrapy.Request(self.at("/ok/even"), callback=memory_item)


@deferred_f_from_coro_f
async def test_memory_requests_take_their_turn_by_priority_as_in_scrapy(
    site: LocalSite, crawl_database: str
) -> None:
    plain = await crawl(PriorityChildrenSpider, {**ONE_AT_A_TIME, "TELNETCONSOLE_ENABLED": False},
                        url=site.url)
    expected = [path_of(u) for u in plain.sent]
    assert expected.index("/ok/low") > expected.index("/ok/start2")  # the case at hand
    # per-worker limits: with the crawl's (the default) a site's place is held until its
    # page's commit, so a claim may come back empty when the engine asks, and a memory
    # request goes before a stored request of higher priority not claimed yet (stated in
    # docs/how-it-works.rst, "Nothing is kept only in memory past its parent's lease")
    observed = await crawl(PriorityChildrenSpider, settings(
        crawl_database, **ONE_AT_A_TIME, IDEMPOTENT_POLITENESS="worker"), url=site.url)
    assert observed.reason == "finished"
    assert [path_of(u) for u in observed.sent] == expected


# -- unstorable start requests -----------------------------------------------------------------


class TwinStartSpider(SiteSpider):
    """Two unstorable ``dont_filter`` start requests to the same URL, then a storable one: the
    storable one's key is the third of that URL's start keys."""

    async def start(self) -> Any:
        for _ in range(2):
            yield scrapy.Request(self.at("/ok/twin"), callback=memory_item, dont_filter=True)
        yield scrapy.Request(self.at("/ok/twin"), dont_filter=True)

    def parse(self, response: Any) -> Any:
        yield {"key": "stored"}


class TwinStoredSpider(TwinStartSpider):
    """The same three start requests, all storable."""

    async def start(self) -> Any:
        for _ in range(3):
            yield scrapy.Request(self.at("/ok/twin"), dont_filter=True)


@deferred_f_from_coro_f
async def test_an_unstorable_start_request_takes_one_rank_among_its_twins(
    site: LocalSite, crawl_database: str, second_crawl_database: str
) -> None:
    stored_db, mixed_db = crawl_database, second_crawl_database
    stored = await crawl(TwinStoredSpider, settings(stored_db), url=site.url)
    mixed = await crawl(TwinStartSpider, settings(mixed_db), url=site.url)
    assert stored.reason == mixed.reason == "finished"
    assert mixed.stats["idempotent/requests/from_memory"] == 2
    entries = frontier_entries(stored_db)
    assert len(entries) == 3
    [fingerprint] = {entry.fingerprint for entry in entries}
    # the keys of the URL's first, second and third start requests, as the crawls give them
    ranked = RequestKeys()
    try:
        keys = ranked.root_keys([fingerprint] * 3, is_start=True)
    finally:
        ranked.close()
    assert sorted(entry.key for entry in entries) == sorted(keys)
    # the storable one is the third of its URL's start requests, as when all are stored
    assert [entry.key for entry in frontier_entries(mixed_db)] == [keys[2]]
