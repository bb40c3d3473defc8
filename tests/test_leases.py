"""The requests a worker claimed ahead (scrapy_idempotent.leases) against a real store (each
backend):
kept in Scrapy's order when pages add requests, without giving them all back and claiming
them again for every such page."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scrapy_idempotent.leases import ClaimedRequests
from scrapy_idempotent.store.base import (
    Completion,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.sqlite import SQLiteStore

WORKER = "host:1:1"


def new(name: str, priority: int = 0, parent: str | None = None) -> NewRequest:
    return NewRequest(key=name, fingerprint=name, url=f"http://example.com/{name}",
                      priority=priority, data="{}", parent_key=parent)


def rows_changed(store: FrontierStore) -> int | None:
    """Rows the store changed so far, where its backend counts them (SQLite's
    ``total_changes``); None on the others."""
    return store.conn.total_changes if isinstance(store, SQLiteStore) else None


def commit(store: FrontierStore, claimed: ClaimedRequests, work: UnitOfWork) -> int | None:
    """Commit ``work`` as the scheduler does; returns the rows it changed (where the backend
    counts them: :func:`rows_changed`)."""
    claimed.prepare(work, closing=False)
    before = rows_changed(store)
    result = store.commit(work, WORKER)
    claimed.accept(work, result)
    after = rows_changed(store)
    return None if before is None or after is None else after - before


def hand_out(store: FrontierStore, claimed: ClaimedRequests) -> str:
    leased = claimed.pop()
    store.commit(UnitOfWork(started=[leased.key]), WORKER)
    return leased.key


@pytest.fixture
def store(store_factory: Callable[..., FrontierStore]) -> FrontierStore:
    """A store of each backend, opened for :data:`WORKER`."""
    store = store_factory()
    store.open(fingerprinter="f")
    store.begin_session(WORKER, "auto")  # type: ignore[arg-type]
    return store


def test_a_page_adding_a_request_claims_it_first_and_keeps_the_batch(
        store: FrontierStore) -> None:
    claimed = ClaimedRequests(batch=8)
    commit(store, claimed, UnitOfWork(requests=[new(f"r{i}") for i in range(20)]))
    assert len(claimed) == 8  # claimed ahead
    page = hand_out(store, claimed)
    assert page == "r19"  # last in, first out
    ahead = [claimed.head().key]
    changed = commit(store, claimed, UnitOfWork(
        requests=[new("child", parent=page)],
        completions=[Completion(page, RequestState.DONE)]))
    # the child is inserted and claimed, the page completed: 3 rows (and the run's
    # counters), not the 7 claimed ahead given back and claimed again (counted on SQLite)
    assert changed is None or changed <= 4
    assert len(claimed) == 8
    order = [claimed.pop().key for _ in range(len(claimed))]
    assert order[0] == "child"  # it goes before the older requests (Scrapy's order)
    assert order[1] == ahead[0]
    assert order == ["child", *[f"r{i}" for i in range(18, 11, -1)]]


def test_more_new_requests_than_a_claim_takes_give_back_what_they_go_before(
        store: FrontierStore) -> None:
    claimed = ClaimedRequests(batch=4)
    commit(store, claimed, UnitOfWork(requests=[new(f"r{i}") for i in range(6)]))
    page = hand_out(store, claimed)
    children = [new(f"c{i}", parent=page) for i in range(10)]
    commit(store, claimed, UnitOfWork(requests=children,
                                      completions=[Completion(page, RequestState.DONE)]))
    # four children claimed (a batch); the six children not claimed go before the requests
    # claimed earlier, which are given back with the next transaction
    assert [claimed.pop().key for _ in range(len(claimed))] == ["c9", "c8", "c7", "c6"]
    commit(store, claimed, UnitOfWork(claim=4))
    assert [claimed.pop().key for _ in range(len(claimed))] == ["c5", "c4", "c3", "c2"]
    rows = {entry.key: entry.state for entry in store.entries()}
    assert rows["r0"] == rows["r1"] == rows["r2"] == rows["r3"] == rows["r4"] == "pending"


def test_a_higher_priority_request_goes_first_a_lower_one_waits(
        store: FrontierStore) -> None:
    claimed = ClaimedRequests(batch=4)
    commit(store, claimed, UnitOfWork(requests=[new(f"r{i}") for i in range(6)]))
    page = hand_out(store, claimed)
    commit(store, claimed, UnitOfWork(
        requests=[new("high", priority=5, parent=page), new("low", priority=-5, parent=page)],
        completions=[Completion(page, RequestState.DONE)]))
    order = [claimed.pop().key for _ in range(len(claimed))]
    assert order[0] == "high"
    assert "low" not in order  # every request claimed here goes before it
