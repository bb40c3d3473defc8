"""The in-flight tracker (``scrapy_idempotent.inflight``), the scheduler's collaborator that
the components use openly, inside a real crawler and engine (the crawl loop driven by hand)."""

from __future__ import annotations

import scrapy

from helpers.scheduler_harness import URLS, Harness, drain, finish
from scrapy_idempotent.crawl import frontier_store, inflight_tracker


def test_the_components_find_the_schedulers_collaborators(harness: Harness) -> None:
    scheduler = harness.scheduler()
    assert inflight_tracker(scheduler.crawler, "test") is scheduler.tracker
    assert frontier_store(scheduler.crawler, "test") is scheduler.store


def test_a_handed_out_request_is_tracked_until_the_engine_is_done(harness: Harness) -> None:
    scheduler = harness.scheduler()
    scheduler.enqueue_request(scrapy.Request(URLS[0]))
    request, = drain(scheduler)
    entry = scheduler.tracker.for_request(request)
    assert entry is not None and entry.request is request
    assert [e.key for e in scheduler.tracker.leased()] == [entry.key]
    finish(scheduler, request)
    assert scheduler.tracker.for_request(request) is None
    assert scheduler.tracker.leased() == []
