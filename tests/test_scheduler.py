"""The scheduler contract, with the behaviours of Scrapy's own scheduler tests
(tests/test_scheduler.py upstream) ported to the durable frontier.

The scheduler runs inside a real crawler and engine; only the crawl loop is not started, so
the tests drive ``enqueue_request``/``next_request`` and the engine's completion hook
(``_slot.remove_request``) by hand, on each store backend in turn (``crawl_harness``), and
read what was stored through the store interface (``helpers.stored``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any
from urllib.parse import urlsplit

import scrapy
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future

from helpers.scheduler_harness import URLS, Harness, drain, finish
from helpers.stored import (
    change_stored,
    frontier_counts,
    frontier_entries,
    reading,
    request_keys,
    rewrite_stored_requests,
    stored_key,
    stored_runs,
    stored_sessions,
)
from scrapy_idempotent.store.base import UnitOfWork
from scrapy_idempotent.store.registry import sqlite_path
from scrapy_idempotent.workers import WorkerId


def test_length_and_pending(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    assert len(scheduler) == 0
    assert not scheduler.has_pending_requests()
    for url in URLS:
        assert scheduler.enqueue_request(scrapy.Request(url))
    assert scheduler.has_pending_requests()
    assert len(scheduler) == len(URLS)


def test_drain_returns_exactly_what_was_enqueued(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    for url in URLS + URLS:  # the second time each is a duplicate
        scheduler.enqueue_request(scrapy.Request(url))
    drained = drain(scheduler)
    assert sorted(r.url for r in drained) == sorted(URLS)
    assert scheduler.next_request() is None
    assert not scheduler.has_pending_requests()  # all leased by this worker, in its hands
    for request in drained:
        finish(scheduler, request)
    assert frontier_counts(crawl_harness.database) == {"done": len(URLS)}
    assert scheduler.stats.get_value("idempotent/requests/duplicate") == len(URLS)


def test_priority_highest_first_then_newest(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    priorities = [0, 3, -1, 3, 1, 0, 2]
    for i, priority in enumerate(priorities):
        scheduler.enqueue_request(scrapy.Request(f"https://example.com/{i}", priority=priority))
    order = [int(r.url.rsplit("/", 1)[1]) for r in drain(scheduler)]
    assert order == [3, 1, 6, 4, 5, 0, 2]


def test_callback_requests_beat_start_requests_at_equal_priority(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    for name in ("start1", "start2"):
        # as StartSpiderMiddleware marks them
        start = scrapy.Request(f"https://example.com/{name}", dont_filter=True,
                               meta={"is_start_request": True})
        scheduler.tracker.mark_start(start)
        scheduler.enqueue_request(start)
    for name in ("other1", "other2"):
        scheduler.enqueue_request(scrapy.Request(f"https://example.com/{name}"))
    # start requests first-in-first-out, the others last-in-first-out, and first
    assert [r.url.rsplit("/", 1)[1] for r in drain(scheduler)] == [
        "other2", "other1", "start1", "start2"]


def test_new_requests_come_before_requests_claimed_ahead(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    for i in range(3):
        scheduler.enqueue_request(scrapy.Request(f"https://example.com/{i}"))
    first = scheduler.next_request()  # claims the others ahead
    assert first is not None and first.url.endswith("/2")
    scheduler.enqueue_request(scrapy.Request("https://example.com/child"))
    finish(scheduler, first)  # commits the child; it is taken first (LIFO), as in Scrapy
    assert [r.url.rsplit("/", 1)[1] for r in drain(scheduler)] == ["child", "1", "0"]
    assert frontier_counts(crawl_harness.database) == {"done": 1, "leased": 3}


def test_same_after_close_and_reopen(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    for i, url in enumerate(URLS):
        scheduler.enqueue_request(
            scrapy.Request(url, priority=i % 3, callback=scheduler.spider.parse))
    crawl_harness.close(scheduler)
    reopened = crawl_harness.scheduler()
    assert len(reopened) == len(URLS)
    urls = [r.url for r in drain(reopened)]
    assert sorted(urls) == sorted(URLS)
    assert [int(u.rsplit("/", 1)[1]) % 3 for u in urls] == sorted(
        (i % 3 for i in range(10)), reverse=True)


def test_dequeued_but_unfinished_is_not_done(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    for url in URLS:
        scheduler.enqueue_request(scrapy.Request(url))
    taken = drain(scheduler)
    finish(scheduler, taken[0])
    crawl_harness.close(scheduler)  # a graceful stop releases the other leases at once
    assert frontier_counts(crawl_harness.database) == {"done": 1, "pending": len(URLS) - 1}
    reopened = crawl_harness.scheduler()
    assert sorted(r.url for r in drain(reopened)) == sorted(u for u in URLS
                                                            if u != taken[0].url)


def test_start_requests_are_keyed_deterministically_across_restarts(
        crawl_harness: Harness) -> None:
    for _ in range(2):
        scheduler = crawl_harness.scheduler()
        for url in URLS[:3]:
            request = scrapy.Request(url, dont_filter=True)
            scheduler.tracker.mark_start(request)
            scheduler.enqueue_request(request)
        scheduler.next_request()  # flushes
        crawl_harness.close(scheduler)
    assert len(frontier_entries(crawl_harness.database)) == 3


def test_finished_request_is_done_and_a_rediscovery_is_not_fetched(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    scheduler.enqueue_request(scrapy.Request(URLS[0]))
    finish(scheduler, scheduler.next_request())
    scheduler.enqueue_request(scrapy.Request(URLS[0]))
    assert scheduler.next_request() is None
    assert scheduler.stats.get_value("idempotent/requests/already_done") == 1


def test_unstorable_request_is_handed_out_from_memory_and_counted(
    crawl_harness: Harness, caplog: Any
) -> None:
    scheduler = crawl_harness.scheduler()
    with open(__file__) as f:
        unstorable = [scrapy.Request(URLS[0], callback=lambda r: None),
                      scrapy.Request(URLS[1], meta={"f": f})]
        assert all(scheduler.enqueue_request(r) for r in unstorable)
        assert scheduler.stats.get_value("idempotent/requests/unstorable") == 2
        assert "meta['f']" in caplog.text and "TextIOWrapper" in caplog.text
        assert scheduler.has_pending_requests()
        assert len(scheduler) == 2
        assert drain(scheduler) == unstorable[::-1]  # Scrapy's order: LIFO
        for request in unstorable:
            finish(scheduler, request)
    assert frontier_counts(crawl_harness.database) == {}
    assert not scheduler.has_pending_requests()


def test_a_damaged_packed_request_fails_that_request_and_the_rest_goes_on(
        crawl_harness: Harness) -> None:
    """A stored request whose packed bytes were damaged on disk cannot be read back: the
    claim hands out the rest, that one ends failed as ``unloadable`` naming its row (it
    stopped every run of the crawl before)."""
    scheduler = crawl_harness.scheduler()
    for url in URLS[:3]:
        scheduler.enqueue_request(scrapy.Request(url))
    crawl_harness.close(scheduler)
    damaged = request_keys(crawl_harness.database)[urlsplit(URLS[1]).path]
    if sqlite_path(str(crawl_harness.database)) is not None:  # the packed bytes in data
        change_stored(crawl_harness.database, "UPDATE requests SET data ="
                      " substr(data, 1, length(data) - 2) WHERE key = ? AND typeof(data) ="
                      " 'blob'", (damaged,))
    else:  # beside it
        change_stored(crawl_harness.database, "UPDATE requests SET packed ="
                      " substring(packed from 1 for length(packed) - 2) WHERE key = ?"
                      " AND packed IS NOT NULL", (stored_key(crawl_harness.database, damaged),))
    reopened = crawl_harness.scheduler()
    drained = drain(reopened)
    assert sorted(r.url for r in drained) == sorted([URLS[0], URLS[2]])
    for request in drained:
        finish(reopened, request)
    assert reopened.stats.get_value("idempotent/requests/unloadable") == 1
    reopened.close("finished")
    crawl_harness.open.remove(reopened)
    with reading(crawl_harness.database) as store:
        failed, = store.failed_requests()
    assert (failed.key, failed.url, failed.error_kind) == (damaged, URLS[1], "unloadable")
    assert f"frontier row {damaged} cannot be unpacked" in (failed.error_message or "")
    assert frontier_counts(crawl_harness.database) == {"done": 2, "failed": 1}


def test_missing_callback_fails_that_request_and_the_rest_goes_on(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    scheduler.enqueue_request(scrapy.Request(URLS[0], callback=scheduler.spider.parse_other))
    scheduler.enqueue_request(scrapy.Request(URLS[1]))
    crawl_harness.close(scheduler)
    # the code changed between runs: parse_other no longer exists
    rewrite_stored_requests(crawl_harness.database,
                            lambda text: text.replace("parse_other", "gone"))
    reopened = crawl_harness.scheduler()
    assert [r.url for r in drain(reopened)] == [URLS[1]]
    reopened.close("shutdown")
    crawl_harness.open.remove(reopened)
    (kind, message), = [(entry.error_kind, entry.error_message)
                        for entry in frontier_entries(crawl_harness.database)
                        if entry.state == "failed"]
    assert kind == "unloadable" and "'gone'" in message


def test_store_failure_never_raises_into_scrapy(harness: Harness) -> None:
    # SQLite only: a closed SQLite connection stays closed; a lost PostgreSQL connection is
    # opened again (test_postgresql_outage.py)
    scheduler = harness.scheduler()
    scheduler.enqueue_request(scrapy.Request(URLS[0]))
    scheduler.store.conn.close()  # the database goes away under the scheduler
    assert scheduler.next_request() is None
    assert scheduler.enqueue_request(scrapy.Request(URLS[1])) in (True, False)
    assert scheduler.has_pending_requests() is False
    assert scheduler.stats.get_value("idempotent/error")
    scheduler.health.closing = True
    harness.open.remove(scheduler)


def test_two_workers_never_share_a_lease_and_dead_workers_are_reclaimed(
    crawl_harness: Harness,
) -> None:
    first = crawl_harness.scheduler(worker="otherhost:1:1")
    for url in URLS:
        first.enqueue_request(scrapy.Request(url))
    held = drain(first)
    second = crawl_harness.scheduler()
    assert second.next_request() is None  # everything is leased by a live worker elsewhere
    assert second.has_pending_requests()  # ... so it waits instead of finishing
    # a process of this host (and PID namespace) that no longer exists: its leases come
    # back at once
    here = WorkerId.parse(second.worker)
    assert here is not None
    dead = WorkerId(here.host, 999999, "1", "0a0b0c0d", here.namespace)
    change_stored(crawl_harness.database, "UPDATE requests SET worker = ? WHERE state = 'leased'",
                  (str(dead),))
    second.leases._dead_check_at = 0
    assert second.has_pending_requests()
    # they were in flight at one death of their worker: replayed at full concurrency (only
    # what was in flight at two deaths runs alone)
    reclaimed = drain(second)
    for request in reclaimed:
        finish(second, request)
    assert sorted(r.url for r in reclaimed) == sorted(r.url for r in held)
    assert second.stats.get_value("idempotent/requests/reclaimed") == len(URLS)
    first.health.closing = True
    first.store.close()
    crawl_harness.open.remove(first)


def test_duplicate_of_a_buffered_child_is_refused_at_once(crawl_harness: Harness) -> None:
    scheduler = crawl_harness.scheduler()
    for url in URLS[:2]:
        scheduler.enqueue_request(scrapy.Request(url))
    first, second = drain(scheduler)
    # two pages in flight yield the same link; neither page is finished, so the first child
    # is only buffered (for its page's transaction) when the second arrives
    children = [scrapy.Request("https://example.com/child") for _ in range(2)]
    for page, child in zip((first, second), children, strict=True):
        scheduler.tracker.track(child, scheduler.tracker.for_request(page), page.url)
    assert scheduler.enqueue_request(children[0]) is True
    assert scheduler.enqueue_request(children[1]) is False
    assert scheduler.stats.get_value("dupefilter/filtered") == 1
    finish(scheduler, second)
    finish(scheduler, first)
    # the child was written once, by the page that yielded it first
    entries = frontier_entries(crawl_harness.database)
    keys = {entry.url: entry.key for entry in entries}
    assert [entry.parent_key for entry in entries
            if entry.url == "https://example.com/child"] == [keys[first.url]]


def test_a_crawl_open_across_the_run_boundary_goes_on_in_the_next_run(
        crawl_harness: Harness) -> None:
    """a joined run 1 and is idle when b finishes that run and c starts run 2: a takes run
    2's work as run 2's (its session, its stats, its close: the feeds it writes then)."""
    a = crawl_harness.scheduler()
    b = crawl_harness.scheduler()
    assert b.enqueue_request(scrapy.Request("https://shop.example/1"))
    finish(b, b.next_request())
    crawl_harness.close(b, "finished")
    c = crawl_harness.scheduler()
    assert (a.run_id, c.run_id) == (1, 2)
    assert c.enqueue_request(scrapy.Request("https://shop.example/2"))
    crawl_harness.close(c)  # its claim of the request given back
    request = a.next_request()
    assert request is not None and request.url == "https://shop.example/2"
    assert (a.run_id, a.stats.get_value("idempotent/run_id")) == (2, 2)
    finish(a, request)
    assert Counter(session.run_id for session in stored_sessions(crawl_harness.database)
                   if session.ended_at is None) == {2: 1}
    crawl_harness.close(a, "finished")
    assert [(run.run_id, run.leased, run.done, run.reason)
            for run in stored_runs(crawl_harness.database)] == [
        (1, 1, 1, "finished"), (2, 1, 1, "finished")]


def test_claimed_requests_given_back_alone_are_written(crawl_harness: Harness) -> None:
    # A transaction that adds more requests than a claim takes gives back the claimed ones
    # that may no longer go first, with the next transaction. When that one carries nothing
    # else (the periodic flush, the close's drain) it was taken for empty and never written:
    # the given-back requests stayed leased by this worker, out of its hands, so the crawl
    # could end "finished" with them released at the close, never fetched.
    scheduler = crawl_harness.scheduler(IDEMPOTENT_LEASE_BATCH=4)
    for url in URLS[:6]:
        scheduler.enqueue_request(scrapy.Request(url))
    first = scheduler.next_request()
    assert first is not None and len(scheduler.claimed) == 3
    scheduler.commits.commit(UnitOfWork())  # (its attempt's start is written)
    claimed = scheduler.claimed
    given_back = claimed._claimed.pop()  # what accept() gives back
    claimed._give_back.append(given_back.key)
    scheduler.commits.flush_buffered()  # the periodic flush of what waits without a page
    assert not claimed.has_give_back
    state = [entry.state for entry in frontier_entries(crawl_harness.database)
             if entry.key == given_back.key]
    assert state == ["pending"]
    handed_out = [first, *drain(scheduler)]
    for request in handed_out:
        finish(scheduler, request)
    assert sorted(r.url for r in handed_out) == sorted(URLS[:6])
    assert frontier_counts(crawl_harness.database) == {"done": 6}


def test_requests_waiting_to_be_given_back_are_pending(crawl_harness: Harness) -> None:
    # claimed requests waiting to be given back are leased by this worker and out of its
    # hands until written: the crawl is not idle meanwhile, and they are handed out again
    scheduler = crawl_harness.scheduler(IDEMPOTENT_LEASE_BATCH=4)
    for url in URLS[:4]:
        scheduler.enqueue_request(scrapy.Request(url))
    first = scheduler.next_request()
    assert first is not None and len(scheduler.claimed) == 3
    scheduler.commits.commit(UnitOfWork())  # (its attempt's start is written)
    claimed = scheduler.claimed
    while claimed:
        claimed._give_back.append(claimed.pop().key)  # what accept() gives back
    assert scheduler.has_pending_requests()
    handed_out = [first, *drain(scheduler)]
    for request in handed_out:
        finish(scheduler, request)
    assert sorted(r.url for r in handed_out) == sorted(URLS[:4])
    assert frontier_counts(crawl_harness.database) == {"done": 4}
    assert not scheduler.has_pending_requests()



@deferred_f_from_coro_f
async def test_a_close_asks_whether_the_run_finished_without_counting_the_frontier(
        crawl_harness: Harness) -> None:
    # the hooks (the feeds) learn whether this close ends the run from one probe of each
    # state's index; the frontier is counted once, for the closing line (a count of ten
    # million requests takes seconds)
    async def closed(scheduler: Any, reason: str) -> tuple[list[bool], int]:
        told: list[bool] = []

        async def hook(store: Any, run_id: int, finishing: bool) -> None:
            told.append(finishing)

        scheduler.before_session_end(hook)
        counted = 0
        count = scheduler.store.counts

        def counting() -> dict[str, int]:
            nonlocal counted
            counted += 1
            return count()

        scheduler.store.counts = counting
        crawl_harness.open.remove(scheduler)
        await maybe_deferred_to_future(scheduler.close(reason))
        return told, counted

    first = crawl_harness.scheduler()
    for url in URLS[:2]:
        first.enqueue_request(scrapy.Request(url))
    finish(first, first.next_request())
    assert await closed(first, "finished") == ([False], 1)  # one request left pending
    second = crawl_harness.scheduler()
    finish(second, second.next_request())
    assert await closed(second, "finished") == ([True], 1)
    assert [run.reason for run in stored_runs(crawl_harness.database)] == ["finished"]
