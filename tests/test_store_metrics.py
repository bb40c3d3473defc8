"""The store's figures for monitoring, on each backend: the run counters that the metrics and
the chart read (leases reclaimed and lost, records stale) are counted in the transactions that
do the work, so they are there for any reader and survive the process; the outbox backlog;
the progress samples (one per interval for the whole crawl, the first worker's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from conftest import T0

from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
)

LEASE_SECONDS = 60.0


@pytest.fixture
def make_store(store_factory: Callable[..., FrontierStore]) -> Callable[[str], Any]:
    """``make_store(worker)``: a store on this test's database with ``worker``'s session
    begun (run 1)."""

    def make(worker: str) -> Any:
        store = store_factory(lease_seconds=LEASE_SECONDS)
        store.open(fingerprinter="x")
        store.begin_session(worker, "auto")
        return store

    return make


def req(key: str) -> NewRequest:
    url = f"https://shop.example/{key}"
    return NewRequest(key=key, fingerprint=f"fp-{key}", url=url, priority=0,
                      data=f'{{"url":"{url}"}}', parent_key=None)


def rec(content_hash: str, observed_at: float) -> Record:
    return Record(record_id="r1", source="shop", natural_key='["A1"]', item_type="dict",
                  data=f'{{"h":"{content_hash}"}}', content_hash=content_hash,
                  observed_at=observed_at)


def claim(store: Any, count: int, worker: str) -> list[str]:
    leased = store.commit(UnitOfWork(claim=count), worker).leased
    store.commit(UnitOfWork(started=[r.key for r in leased]), worker)
    return [r.key for r in leased]


def page(store: Any, key: str, worker: str, *records: Record) -> Any:
    return store.commit(UnitOfWork(records=[(r, key) for r in records],
                                   completions=[Completion(key, RequestState.DONE)]), worker)


def read_again(store_factory: Callable[..., FrontierStore]) -> Any:
    """The run as a new reader of the database sees it (another process: the exporter)."""
    reader = store_factory()
    reader.open_existing(readonly=True)
    (run,) = reader.runs()
    return run


def test_reclaimed_and_lost_leases_and_stale_records_are_counted_in_the_run(
        make_store: Callable[[str], Any], store_factory: Callable[..., FrontierStore],
        clock: Any) -> None:
    w1 = make_store("w1")
    w1.commit(UnitOfWork(requests=[req("a"), req("b"), req("c")]), "w1")
    assert sorted(claim(w1, 3, "w1")) == ["a", "b", "c"]
    clock.advance(LEASE_SECONDS + 1)  # w1 stops renewing: its leases expire
    w2 = make_store("w2")
    assert w2.reclaim_expired() == 3
    a, b = claim(w2, 2, "w2")
    # w1 comes back: its completion of a is refused (w2 holds the lease)
    assert page(w1, a, "w1").leases_lost == 1
    # w2's page of a stores the record observed later; its page of b brings an older
    # observation of it: refused as stale
    assert page(w2, a, "w2", rec("new", T0 + 100)).records_inserted == 1
    assert page(w2, b, "w2", rec("old", T0 + 50)).records_stale == 1
    # a dead worker's leases released by another worker are reclaims too
    assert len(claim(w2, 1, "w2")) == 1
    assert w1.release_leases(["w2"]) == 1
    run = read_again(store_factory)
    assert (run.leases_reclaimed, run.leases_lost, run.records_stale) == (4, 1, 1)
    assert (run.done, run.records_inserted) == (2, 1)


def test_the_outbox_backlog_is_the_pending_entries_by_target(
        make_store: Callable[[str], Any], clock: Any) -> None:
    w1 = make_store("w1")
    w1.commit(UnitOfWork(requests=[req("a"), req("b")]), "w1")
    claim(w1, 2, "w1")
    w1.commit(UnitOfWork(records=[(rec("h1", T0), "a")],
                         completions=[Completion("a", RequestState.DONE)],
                         outbox_targets=("hook",)), "w1")
    clock.advance(30)
    w1.commit(UnitOfWork(records=[(dataclasses.replace(rec("h2", T0 + 30), record_id="r2"),
                                   "b")],
                         completions=[Completion("b", RequestState.DONE)],
                         outbox_targets=("hook",)), "w1")
    backlog = w1.outbox_backlog()
    assert list(backlog) == ["hook"]
    assert (backlog["hook"].entries, backlog["hook"].oldest_at) == (2, T0)
    (first, *_) = w1.claim_outbox(["hook"], 1, 60)
    from scrapy_idempotent.store import OutboxOutcome, OutboxState

    w1.settle_outbox([OutboxOutcome(first.entry_id, OutboxState.DELIVERED,
                                    held_until=first.held_until)])
    assert w1.outbox_backlog()["hook"].entries == 1
    assert w1.outbox_backlog()["hook"].oldest_at == T0 + 30


def test_one_progress_sample_per_interval_for_the_whole_crawl(
        make_store: Callable[[str], Any], store_factory: Callable[..., FrontierStore],
        clock: Any) -> None:
    """The first worker to reach an interval stores the run's counters (every worker's);
    the others find it taken; a close's final sample replaces the interval's."""
    w1, w2 = make_store("w1"), make_store("w2")
    clock.advance(60 - clock() % 60)  # the start of an interval
    w1.commit(UnitOfWork(requests=[req("a"), req("b"), req("c")]), "w1")
    assert w1.record_sample(60) is True
    assert w2.record_sample(60) is False  # taken by w1
    (first,) = claim(w1, 1, "w1")
    second, _ = claim(w2, 2, "w2")
    assert page(w2, second, "w2").completed == {"done": 1}
    clock.advance(60)
    assert w2.record_sample(60) is True
    assert w1.record_sample(60) is False
    assert page(w1, first, "w1").completed == {"done": 1}
    assert w1.record_sample(60, final=True) is True
    reader = store_factory()
    reader.open_existing(readonly=True)
    samples = reader.samples(1)
    assert [(s.at - samples[0].at, s.leased, s.done, s.in_flight) for s in samples] == [
        (0, 0, 0, 0), (60, 3, 2, 1)]
    assert reader.samples(2) == []


def test_a_schema_7_sqlite_database_gets_the_counters_and_the_samples(tmp_path: Any) -> None:
    import sqlite3

    from scrapy_idempotent.store.sqlite import _MIGRATIONS, APPLICATION_ID, SQLiteStore

    path = tmp_path / "v7.sqlite3"
    conn = sqlite3.connect(path)
    for step in _MIGRATIONS[:7]:
        for statement in step:
            conn.execute(statement)
    conn.execute("INSERT INTO runs (run_id, started_at, done) VALUES (1, 100.0, 5)")
    conn.execute("PRAGMA user_version = 7")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.commit()
    conn.close()
    store = SQLiteStore(str(path), clock=lambda: 300.0)
    store.open()
    try:
        (run,) = store.runs()
        assert (run.done, run.leases_reclaimed, run.leases_lost, run.records_stale) == (
            5, 0, 0, 0)
        store.begin_session("w1", "resume")
        assert store.record_sample(60) is True
        assert [(s.at, s.done) for s in store.samples(1)] == [(300.0, 5)]
    finally:
        store.close()


def test_the_leases_of_a_killed_worker_are_the_charts_repeats(
        make_store: Callable[[str], Any], clock: Any) -> None:
    from scrapy_idempotent.commands import chart

    w1 = make_store("w1")
    w1.commit(UnitOfWork(requests=[req("a"), req("b"), req("c")]), "w1")
    assert w1.record_sample(60) is True
    first = claim(w1, 2, "w1")  # w1 is killed holding two leases
    clock.advance(LEASE_SECONDS + 1)
    w2 = make_store("w2")
    assert w2.reclaim_expired() == 2
    for key in claim(w2, 3, "w2"):
        page(w2, key, "w2")
    assert w2.record_sample(60, final=True) is True
    (run,) = w2.runs()
    series = chart.from_samples(run, w2.samples(run.run_id))
    assert {name: sum(counts.values()) for name, counts in series.items()} == {
        "pages done": 3, "pages failed": 0, "repeats": len(first), "records changed": 0}
