"""Scrapy's queue order has one definition, ``_order.queue_position``: the store's claims and
the scheduler's requests fetched from memory follow it. Checked here through the store
interface, so any backend's claim order is held to the same definition."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from scrapy import Request
from scrapy.settings import Settings

from scrapy_idempotent._order import QueueOrder, queue_position
from scrapy_idempotent.store import CrawlIdentity, FrontierStore, NewRequest, UnitOfWork


def _requests(count: int, seed: int) -> list[NewRequest]:
    rng = random.Random(seed)
    return [NewRequest(key=f"k{i}", fingerprint=f"f{i}", url=f"https://example.com/{i}",
                       priority=rng.choice((-1, 0, 0, 1, 5)), data="{}",
                       is_start=rng.random() < 0.4, fifo=rng.random() < 0.5)
            for i in range(count)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_store_claims_in_queue_position_order(
        store_factory: Callable[..., FrontierStore], seed: int) -> None:
    requests = _requests(60, seed)
    store = store_factory()
    store.open(fingerprinter="x", identity=CrawlIdentity("p", "s", "s"))
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=requests), "w1")  # joined in list order
    claimed = []
    while batch := store.commit(UnitOfWork(claim=7), "w1").leased:
        claimed.extend(leased.key for leased in batch)
    # the sequence is the order the requests joined the frontier: their place in the list
    expected = sorted(requests, key=lambda r: queue_position(
        r.priority, r.is_start, r.fifo, requests.index(r)))
    assert claimed == [r.key for r in expected]


def test_queue_position_is_scrapys_default_order() -> None:
    # the highest priority first; at equal priority other requests before start requests;
    # then LIFO (the newest first) or FIFO (the oldest first) within the queue
    assert queue_position(5, True, True, 9) < queue_position(0, False, False, 1)
    assert queue_position(0, False, True, 9) < queue_position(0, True, True, 1)
    assert queue_position(0, False, False, 9) < queue_position(0, False, False, 1)
    assert queue_position(0, True, True, 1) < queue_position(0, True, True, 9)


def test_queue_order_reads_the_queue_classes_from_scrapys_settings() -> None:
    order = QueueOrder.from_settings(Settings())  # Scrapy's defaults
    start = {"is_start_request": True}
    assert order.place(Request("https://example.com", meta=start)) == (True, True)
    assert order.place(Request("https://example.com")) == (False, False)
    shared = QueueOrder.from_settings(Settings({"SCHEDULER_START_MEMORY_QUEUE": None}))
    assert shared.place(Request("https://example.com", meta=start)) == (False, False)
