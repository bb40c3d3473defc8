"""The requests a worker claimed ahead (scrapy_idempotent.leases) against a real store (each
backend):
kept in Scrapy's order when pages add requests, without giving them all back and claiming
them again for every such page."""

from __future__ import annotations

import os
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


def test_claims_on_their_way_at_once_keep_no_more_than_the_downloader_takes(
        store: FrontierStore) -> None:
    """With the crawl's limits a claim takes what the downloader takes now; two claims sized
    by the same room (the second prepared before the first came back) would hold a slot's
    places this worker cannot send in: what is beyond the room is given back."""
    room = [0]
    claimed = ClaimedRequests(batch=8, sendable=lambda: room[0])
    commit(store, claimed, UnitOfWork(requests=[new(f"r{i}") for i in range(6)]))
    assert len(claimed) == 0
    room[0] = 1
    first, second = UnitOfWork(), UnitOfWork()
    claimed.prepare(first, closing=False)
    claimed.prepare(second, closing=False)
    assert first.claim == second.claim == 1
    claimed.accept(first, store.commit(first, WORKER))
    hand_out(store, claimed)
    room[0] = 0  # the downloader is full now
    claimed.accept(second, store.commit(second, WORKER))
    assert len(claimed) == 0 and claimed.has_give_back
    commit(store, claimed, UnitOfWork())
    rows = [entry.state for entry in store.entries()]
    assert rows.count("leased") == 1 and rows.count("pending") == 5


class _HeldWriter:
    """A writer whose calls wait until the test runs them (on the test's thread, standing in
    for the writer's)."""

    def __init__(self, store: FrontierStore, worker: str) -> None:
        self.store, self.worker = store, worker
        self.calls: list[tuple[str, Callable[[FrontierStore], object], object]] = []

    def call(self, what: str, action: Callable[[FrontierStore], object]) -> object:
        from twisted.internet.defer import Deferred

        d: Deferred[object] = Deferred()
        self.calls.append((what, action, d))
        return d

    def run(self) -> None:
        _, action, d = self.calls.pop(0)
        d.callback(action(self.store))  # type: ignore[attr-defined]


class _Untouched:
    """The store as the reactor thread sees it: the check must not read it there."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"store.{name} used on the reactor thread")


def test_an_idle_workers_check_for_dead_workers_runs_on_the_writers_thread_one_at_a_time(
        store_factory: Callable[..., FrontierStore]) -> None:
    """The check reads who holds leases and releases a dead worker's on the writer's thread
    (the reactor never waits on the store), one check at a time; the dead worker's slots are
    paused with the crawl's limits, counted and logged."""
    import socket
    import subprocess
    import sys
    from types import SimpleNamespace
    from typing import Any, cast

    from scrapy.statscollectors import MemoryStatsCollector
    from scrapy.utils.test import get_crawler

    from scrapy_idempotent.leases import LeaseKeeper
    from scrapy_idempotent.store.base import SlotLimits
    from scrapy_idempotent.workers import WorkerId, pid_namespace, process_start_ticks

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = str(WorkerId(socket.gethostname(), gone.pid,
                        process_start_ticks(os.getpid()) or "1", "0a0b0c0d", pid_namespace()))
    store = store_factory()
    store.open(fingerprinter="f")
    store.begin_session(WORKER, "auto")  # type: ignore[arg-type]
    store.keep_slot_limits(SlotLimits(concurrency=2, dead_worker_pause_seconds=10.0))
    store.commit(UnitOfWork(requests=[NewRequest(key="a", fingerprint="a",
                                                 url="http://a.example/", priority=0,
                                                 data="{}", slot="a.example")]), dead)
    assert len(store.commit(UnitOfWork(claim=1), dead).leased) == 1
    writer = _HeldWriter(store, WORKER)
    stats = MemoryStatsCollector(get_crawler())
    woken: list[bool] = []
    keeper = LeaseKeeper(
        cast(Any, _Untouched()), cast(Any, writer), tracker=cast(Any, None),
        claimed=ClaimedRequests(10), stats=stats,
        health=cast(Any, SimpleNamespace(stopped=False, closing=False)),
        wakeup=cast(Any, SimpleNamespace(if_asked_in_vain=lambda: woken.append(True))),
        lease_seconds=60.0, flush=lambda: None)
    keeper.reclaim_soon(dead_only=True)
    keeper._dead_check_at = 0.0  # (a second later)
    keeper.reclaim_soon(dead_only=True)
    assert len(writer.calls) == 1  # one check at a time
    writer.run()
    assert stats.get_value("idempotent/requests/reclaimed") == 1
    assert stats.get_value("idempotent/slots/paused_after_dead_worker") == 1
    assert woken == [True]
    assert [s.slot for s in store.slots() if s.paused_until > store.clock()] == ["a.example"]
    keeper._dead_check_at = 0.0
    keeper.reclaim_soon(dead_only=True)  # no dead worker now: a read, nothing written
    writer.run()
    assert stats.get_value("idempotent/requests/reclaimed") == 1
