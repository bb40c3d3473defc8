"""Runs and recrawl windows at the store level, with injected clocks (no Scrapy). Part of the
store contract: every test runs against each store backend (``store_factory``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conftest import FakeClock as Clock

from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
)

HOUR = 3600.0
Stores = Callable[..., FrontierStore]


def request(n: int) -> NewRequest:
    return NewRequest(key=f"k{n}", fingerprint=f"f{n}", url=f"https://example.com/{n}",
                      priority=0, data="{}")


def open_store(store_factory: Stores, clock: Clock, worker: str, **kwargs: Any) -> FrontierStore:
    store = store_factory(clock=clock, **kwargs)
    store.open(fingerprinter="f")
    store.begin_session(worker, "auto")
    return store


def requests(store: FrontierStore) -> list[tuple[str, int]]:
    """(state, attempts) of every frontier entry."""
    return [(entry.state, entry.attempts) for entry in store.entries()]


def crawl(store: FrontierStore, worker: str, n: int) -> None:
    """Enqueue, lease and complete request n."""
    store.commit(UnitOfWork(requests=[request(n)]), worker)
    for leased in store.commit(UnitOfWork(claim=10), worker).leased:
        store.commit(UnitOfWork(started=[leased.key]), worker)
        store.commit(UnitOfWork(completions=[Completion(leased.key, RequestState.DONE)]),
                     worker)


def test_run_counters_are_cumulative_over_sessions(store_factory: Stores) -> None:
    clock = Clock(1000.0)
    first = open_store(store_factory, clock, "w1")
    crawl(first, "w1", 1)
    first.end_session("w1", "shutdown")
    second = open_store(store_factory, clock, "w2")  # resumes the unfinished run
    crawl(second, "w2", 2)
    second.end_session("w2", "finished")
    (run,) = second.runs()
    assert (run.leased, run.done, run.failed, run.finished_at) == (2, 2, 0, 1000.0)


def test_without_window_a_new_run_starts_from_an_empty_frontier(
    store_factory: Stores,
) -> None:
    clock = Clock(1000.0)
    store = open_store(store_factory, clock, "w1")
    crawl(store, "w1", 1)
    store.end_session("w1", "finished")
    assert store.begin_session("w1", "auto").run_id == 2
    assert store.commit(UnitOfWork(requests=[request(1)]), "w1").requests_added == 1


def test_within_the_window_done_is_not_due_and_after_it_is(
    store_factory: Stores,
) -> None:
    clock = Clock(10 * HOUR + 60)
    store = open_store(store_factory, clock, "w1", recrawl_seconds=HOUR)
    crawl(store, "w1", 1)
    store.end_session("w1", "finished")
    clock.now += 600  # a new run in the same window keeps what was done
    store.begin_session("w1", "auto")
    result = store.commit(UnitOfWork(requests=[request(1)]), "w1")
    assert (result.requests_added, result.requests_already_done) == (0, 1)
    clock.now = 11 * HOUR + 1  # the next window: due again, once
    result = store.commit(UnitOfWork(requests=[request(1), request(1)]), "w1")
    assert (result.requests_due_again, result.requests_duplicate) == (1, 1)
    assert requests(store) == [("pending", 0)]


def test_workers_whose_clocks_differ_across_a_window_boundary_fetch_once(
    store_factory: Stores,
) -> None:
    """Worker A's clock reads 0.5 s before the hour, worker B's 0.5 s after it. A page done by
    A in the last window is rediscovered by both: it is due again for B, and the state change
    in the database makes it one pending entry, leased by one worker, fetched once."""
    clock_a, clock_b = Clock(11 * HOUR - 0.5), Clock(11 * HOUR + 0.5)
    a = open_store(store_factory, clock_a, "a", recrawl_seconds=HOUR)
    b = open_store(store_factory, clock_b, "b", recrawl_seconds=HOUR)
    clock_a.now -= 60
    crawl(a, "a", 1)  # done in window 10 by A's clock
    clock_a.now += 60
    assert a.commit(UnitOfWork(requests=[request(1)]), "a").requests_already_done == 1
    assert b.commit(UnitOfWork(requests=[request(1)]), "b").requests_due_again == 1
    assert a.commit(UnitOfWork(requests=[request(1)]), "a").requests_duplicate == 1
    assert b.commit(UnitOfWork(requests=[request(1)]), "b").requests_duplicate == 1
    leased = [a.commit(UnitOfWork(claim=5), "a").leased, b.commit(UnitOfWork(claim=5), "b").leased]
    assert sorted(len(x) for x in leased) == [0, 1]
    assert len(requests(a)) == 1


def test_a_new_run_with_a_window_forgets_what_was_done_before_it(
    store_factory: Stores,
) -> None:
    clock = Clock(10 * HOUR + 60)
    store = open_store(store_factory, clock, "w1", recrawl_seconds=HOUR)
    crawl(store, "w1", 1)
    clock.now += 60
    crawl(store, "w1", 2)
    store.end_session("w1", "finished")
    clock.now = 11 * HOUR + 5
    store.begin_session("w1", "auto")
    assert requests(store) == []
