"""The ``request_done`` signal: sent after the page's transaction has committed, on the
reactor thread, once per final state, and for known requests refused as already done."""

from __future__ import annotations

import json
import threading
from typing import Any

from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end, frontier_counts
from helpers.stored import reading
from scrapy_idempotent import signals
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


class DurabilityProbe:
    """A ``request_done`` handler that checks, through a store of its own opened read-only
    (it sees only committed data), that what the signal announces is already stored."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.seen: list[tuple[str, str, str]] = []  # (state, key, url)
        self.problems: list[str] = []

    def __call__(self, request: Any, key: str, fingerprint: str, state: str,
                 spider: Any) -> None:
        url = request.url if request is not None else "?"
        self.seen.append((state, key, url))
        if threading.current_thread() is not threading.main_thread():
            self.problems.append(f"{url}: sent from thread {threading.current_thread().name}")
        with reading(self.database) as store:
            if state == signals.ALREADY_DONE:
                # the known entry is the one of that fingerprint (its key may be another
                # than the refused request's: a dont_filter start request, say)
                if store.known_request(fingerprint) != signals.ALREADY_DONE:
                    self.problems.append(f"{url}: announced {state}, not committed so")
                return
            entry = store.entry(key)
            if entry is None:
                self.problems.append(f"{url} ({state}): no frontier entry {key}")
                return
            if entry.fingerprint != fingerprint:
                self.problems.append(f"{url}: fingerprint {fingerprint} != {entry.fingerprint}")
            if entry.state != state:
                self.problems.append(f"{url}: announced {state}, committed {entry.state}")
            if state == "done" and "/product/" in url:
                sku = url.rsplit("/", 1)[1]
                records = [r for r in store.records_page(limit=100_000)
                           if r.request_key == key and json.loads(r.data).get("sku") == sku]
                if len(records) != 1:
                    self.problems.append(f"{url}: done, but {len(records)} records committed")


@deferred_f_from_coro_f
async def test_request_done_follows_each_commit_and_already_done_duplicates(
    crawl_database: str, monkeypatch: Any,
) -> None:
    # the duplicate checks of a page's links are made in one read, when the first of them
    # is enqueued (answered as reads of their own would be: the announcements below hold)
    from scrapy_idempotent.store.sql import SqlStore

    batches: list[int] = []
    read_expected = SqlStore._read_expected

    def counted(self: Any, batch: Any, now: float) -> None:
        batches.append(len(batch.expected))
        read_expected(self, batch, now)

    monkeypatch.setattr(SqlStore, "_read_expected", counted)
    with LocalSite(products_failing=[7]) as shop:
        crawler = get_crawler(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS))
        probe = DurabilityProbe(crawl_database)
        crawler.signals.connect(probe, signal=signals.request_done)
        await crawl_to_end(crawler, url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert probe.problems == []
    by_state: dict[str, list[tuple[str, str, str]]] = {}
    for seen in probe.seen:
        by_state.setdefault(seen[0], []).append(seen)
    # one signal per final state written, each entry once
    assert len(by_state["done"]) == 524 == stats["idempotent/requests/done"]
    assert [url for _, _, url in by_state["failed"]] == [f"{shop.url}/product/SKU-00007"]
    finals = by_state["done"] + by_state["failed"]
    assert len({key for _, key, _ in finals}) == 525
    assert frontier_counts(crawl_database) == {"done": 524, "failed": 1}
    # every listing links /list/1 back: refused as already done, announced as such
    assert len(by_state[signals.ALREADY_DONE]) == stats["idempotent/requests/already_done"]
    assert len(by_state[signals.ALREADY_DONE]) >= 20
    assert {url for _, _, url in by_state[signals.ALREADY_DONE]} == {f"{shop.url}/list/1"}
    assert set(by_state) == {"done", "failed", signals.ALREADY_DONE}
    assert sum(batches) >= 500
    if scraper_reads_ahead():
        # a read per page at most for the links it yielded (25 listings of 20 products)
        assert 0 < len(batches) <= 25
    else:
        # Scrapy 2.13 (or a reactor other than asyncio's) enqueues each link before the
        # callback yields the next: one read each
        assert batches == [1] * len(batches)


def scraper_reads_ahead() -> bool:
    """Whether Scrapy's scraper takes a callback's outputs ahead of enqueueing them (2.14
    and later, on the asyncio reactor)."""
    from scrapy.core import scraper
    from scrapy.utils.reactor import is_asyncio_reactor_installed

    return hasattr(scraper, "_parallel_asyncio") and is_asyncio_reactor_installed()


@deferred_f_from_coro_f
async def test_restarted_start_request_already_done_is_announced(crawl_database: str) -> None:
    """A resumed crawl whose start request is done already: ``start()`` yields it again,
    nothing is fetched, and ``request_done`` says ``already_done`` (with the same key)."""
    with LocalSite(listing_pages=1, products_per_page=2) as shop:
        settings = crawl_settings(crawl_database, IDEMPOTENT_RUN_MODE="resume", **NATURAL_KEYS)
        first = get_crawler(ShopSpider, settings)
        first_probe = DurabilityProbe(crawl_database)
        first.signals.connect(first_probe, signal=signals.request_done)
        await crawl_to_end(first, url=shop.url)
        second = get_crawler(ShopSpider, settings)
        probe = DurabilityProbe(crawl_database)
        second.signals.connect(probe, signal=signals.request_done)
        shop.reset_counts()
        await crawl_to_end(second, url=shop.url)
        assert shop.request_count == 0
    assert probe.problems == first_probe.problems == []
    start_key = next(key for state, key, url in first_probe.seen
                     if url.endswith("/list/1") and state == "done")
    assert probe.seen == [(signals.ALREADY_DONE, start_key, f"{shop.url}/list/1")]

