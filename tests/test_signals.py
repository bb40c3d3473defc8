"""The ``request_done`` signal: sent after the page's transaction has committed, on the
reactor thread, once per final state, and for known requests refused as already done."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end, frontier_counts
from scrapy_idempotent import signals
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


class DurabilityProbe:
    """A ``request_done`` handler that checks, through a connection of its own (it sees only
    committed data), that what the signal announces is already in the database."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.seen: list[tuple[str, str, str]] = []  # (state, key, url)
        self.problems: list[str] = []

    def __call__(self, request: Any, key: str, fingerprint: str, state: str,
                 spider: Any) -> None:
        url = request.url if request is not None else "?"
        self.seen.append((state, key, url))
        if threading.current_thread() is not threading.main_thread():
            self.problems.append(f"{url}: sent from thread {threading.current_thread().name}")
        conn = sqlite3.connect(self.db_path)
        try:
            # already_done: the known entry is the one of that fingerprint (its key may be
            # another than the refused request's: a dont_filter start request, say)
            row = conn.execute(
                "SELECT state, fingerprint FROM requests WHERE fingerprint = ?"
                " ORDER BY state = 'pending' OR state = 'leased' LIMIT 1", (fingerprint,)
            ).fetchone() if state == signals.ALREADY_DONE else conn.execute(
                "SELECT state, fingerprint FROM requests WHERE key = ?", (key,)).fetchone()
            if row is None:
                self.problems.append(f"{url} ({state}): no frontier entry {key}")
                return
            stored_state, stored_fingerprint = row
            if stored_fingerprint != fingerprint:
                self.problems.append(f"{url}: fingerprint {fingerprint} != {stored_fingerprint}")
            expected = ("done", "failed", "redirected") if state == signals.ALREADY_DONE \
                else (state,)
            if stored_state not in expected:
                self.problems.append(f"{url}: announced {state}, committed {stored_state}")
            if state == "done" and "/product/" in url:
                sku = url.rsplit("/", 1)[1]
                (records,) = conn.execute(
                    "SELECT count(*) FROM records WHERE request_key = ? AND data LIKE ?",
                    (key, f'%"{sku}"%')).fetchone()
                if records != 1:
                    self.problems.append(f"{url}: done, but {records} records committed")
        finally:
            conn.close()


@deferred_f_from_coro_f
async def test_request_done_follows_each_commit_and_already_done_duplicates(
    db_path: Path,
) -> None:
    with LocalSite(products_failing=[7]) as shop:
        crawler = get_crawler(ShopSpider, crawl_settings(db_path, **NATURAL_KEYS))
        probe = DurabilityProbe(db_path)
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
    assert frontier_counts(db_path) == {"done": 524, "failed": 1}
    # every listing links /list/1 back: refused as already done, announced as such
    assert len(by_state[signals.ALREADY_DONE]) == stats["idempotent/requests/already_done"]
    assert len(by_state[signals.ALREADY_DONE]) >= 20
    assert {url for _, _, url in by_state[signals.ALREADY_DONE]} == {f"{shop.url}/list/1"}
    assert set(by_state) == {"done", "failed", signals.ALREADY_DONE}


@deferred_f_from_coro_f
async def test_restarted_start_request_already_done_is_announced(db_path: Path) -> None:
    """A resumed crawl whose start request is done already: ``start()`` yields it again,
    nothing is fetched, and ``request_done`` says ``already_done`` (with the same key)."""
    with LocalSite(listing_pages=1, products_per_page=2) as shop:
        settings = crawl_settings(db_path, IDEMPOTENT_RUN_MODE="resume", **NATURAL_KEYS)
        first = get_crawler(ShopSpider, settings)
        first_probe = DurabilityProbe(db_path)
        first.signals.connect(first_probe, signal=signals.request_done)
        await crawl_to_end(first, url=shop.url)
        second = get_crawler(ShopSpider, settings)
        probe = DurabilityProbe(db_path)
        second.signals.connect(probe, signal=signals.request_done)
        shop.reset_counts()
        await crawl_to_end(second, url=shop.url)
        assert shop.request_count == 0
    assert probe.problems == first_probe.problems == []
    start_key = next(key for state, key, url in first_probe.seen
                     if url.endswith("/list/1") and state == "done")
    assert probe.seen == [(signals.ALREADY_DONE, start_key, f"{shop.url}/list/1")]
