"""The in-flight tracker (``scrapy_idempotent.inflight``), the scheduler's collaborator that
the components use openly, inside a real crawler and engine (the crawl loop driven by hand)."""

from __future__ import annotations

import warnings

import scrapy
import test_scheduler
from test_scheduler import URLS, Harness, drain, finish

from scrapy_idempotent.crawl import frontier_store, inflight_tracker

harness = test_scheduler.harness  # the fixture: schedulers in real crawlers on one database


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


def test_the_schedulers_former_tracking_methods_warn_and_delegate(harness: Harness) -> None:
    scheduler = harness.scheduler()
    scheduler.enqueue_request(scrapy.Request(URLS[0]))
    request, = drain(scheduler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = scheduler.inflight_entry(request)
    assert entry is scheduler.tracker.for_request(request)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert "for_request" in str(caught[0].message)
    finish(scheduler, request)


def test_the_components_former_scheduler_attribute_warns(harness: Harness) -> None:
    from scrapy_idempotent import RecordIdMiddleware, UpsertPipeline

    scheduler = harness.scheduler()
    for component in (RecordIdMiddleware(scheduler.crawler), UpsertPipeline(scheduler.crawler)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert component.scheduler is scheduler
        assert [w.category for w in caught] == [DeprecationWarning]
