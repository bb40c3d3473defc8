"""The store contract (``scrapy_idempotent.store.base``), without Scrapy.

Every test that takes the ``store`` or ``make_store`` fixture runs against each factory in
``STORE_FACTORIES``: add a backend there and it must pass the same tests. Besides the
``FrontierStore`` methods, the tests read rows through ``store.query(sql, params)`` over the
``requests`` and ``records`` tables. The tests named ``test_sqlite_*`` are about the SQLite file
itself (schema version, permissions, WAL).

Time never passes by itself: every store gets a ``FakeClock`` that the tests move forward.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import (
    SCHEMA_VERSION,
    CommitResult,
    Completion,
    FrontierStatus,
    FrontierStore,
    LeasedRequest,
    LeaseHolder,
    NewRequest,
    Record,
    Reject,
    RequestState,
    RunInfo,
    SQLiteStore,
    UnitOfWork,
)

LEASE_SECONDS = 60.0
T0 = 1_700_000_000.0


class FakeClock:
    """Unix seconds that only move when a test says so."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def sqlite_factory(location: Path, clock: FakeClock, **options: Any) -> FrontierStore:
    return SQLiteStore(str(location / "frontier.sqlite3"), clock=clock, **options)


def postgresql_factory(location: Path, clock: FakeClock, **options: Any) -> FrontierStore:
    """A PostgreSQL store on a database of this test's own (made once per location), without
    the heartbeat thread and death by heartbeat (time here is the fake clock's)."""
    from scrapy_idempotent.store.postgresql import PostgreSQLStore

    marker = location / "postgresql-url"
    if not marker.exists():
        marker.write_text(_POSTGRES_CLUSTER[0].new_database())
    options.setdefault("heartbeat_seconds", None)
    options.setdefault("dead_after_seconds", None)
    options.pop("synchronous", None)
    return PostgreSQLStore(marker.read_text(), clock=clock, **options)


_POSTGRES_CLUSTER: list[Any] = []

#: What a commit that fails may raise: the package's error or the backend's DB-API error.
COMMIT_ERRORS: tuple[type[BaseException], ...] = (StoreError, sqlite3.Error)
try:
    import psycopg

    COMMIT_ERRORS += (psycopg.Error,)
except ImportError:  # the PostgreSQL store's tests skip
    pass

#: One factory per backend: ``factory(location, clock, **options)`` returns an unopened store;
#: two stores made with the same location share one database (two processes).
STORE_FACTORIES = [pytest.param(sqlite_factory, id="sqlite"),
                   pytest.param(postgresql_factory, id="postgresql")]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=STORE_FACTORIES)
def make_store(request: pytest.FixtureRequest, tmp_path: Path,
               clock: FakeClock) -> Iterator[Callable[..., Any]]:
    """``make_store(**options)``: an unopened store on this test's database, closed after."""
    made: list[Any] = []
    if request.param is postgresql_factory and not _POSTGRES_CLUSTER:
        _POSTGRES_CLUSTER.append(request.getfixturevalue("postgres_cluster"))

    def make(**options: Any) -> Any:
        options.setdefault("lease_seconds", LEASE_SECONDS)
        store = request.param(tmp_path, clock, **options)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def store(make_store: Callable[..., Any]) -> Any:
    """An opened store on a new database, with worker ``w1`` in run 1."""
    store = make_store()
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    return store


def open_store(make_store: Callable[..., Any], worker: str, run_mode: str = "auto",
               **options: Any) -> tuple[Any, RunInfo]:
    store = make_store(**options)
    store.open(fingerprinter="x")
    return store, store.begin_session(worker, run_mode)


# -- helpers --------------------------------------------------------------------------------


def req(key: str, *, fingerprint: str | None = None, priority: int = 0, is_start: bool = False,
        filter_fingerprint: bool = True, parent_key: str | None = None,
        data: str | None = None) -> NewRequest:
    url = f"https://shop.example/{key}"
    return NewRequest(
        key=key,
        fingerprint=fingerprint if fingerprint is not None else f"fp-{key}",
        url=url,
        priority=priority,
        data=data if data is not None else json.dumps({"url": url}),
        parent_key=parent_key,
        is_start=is_start,
        filter_fingerprint=filter_fingerprint,
    )


def rec(record_id: str, content_hash: str, data: str = '{"sku":"A1"}') -> Record:
    return Record(
        record_id=record_id,
        source="shop",
        natural_key='["A1"]',
        item_type="dict",
        data=data,
        content_hash=content_hash,
    )


def enqueue(store: Any, *requests: NewRequest, worker: str = "w1") -> CommitResult:
    return store.commit(UnitOfWork(requests=list(requests)), worker)


def claim(store: Any, count: int, worker: str = "w1") -> list[LeasedRequest]:
    """Claim, then start what was claimed, as the scheduler does when it hands requests out
    (a start counts an attempt)."""
    leased = store.commit(UnitOfWork(claim=count), worker).leased
    if leased:
        store.commit(UnitOfWork(started=[r.key for r in leased]), worker)
    return leased


def claim_keys(store: Any, count: int, worker: str = "w1") -> list[str]:
    return [leased.key for leased in claim(store, count, worker)]


def complete(store: Any, key: str, state: RequestState = RequestState.DONE,
             worker: str = "w1", **fields: Any) -> CommitResult:
    return store.commit(UnitOfWork(completions=[Completion(key, state, **fields)]), worker)


def row(store: Any, key: str) -> tuple[Any, ...]:
    """(state, worker, attempts) of one frontier entry."""
    rows = store.query("SELECT state, worker, attempts FROM requests WHERE key = ?", (key,))
    assert len(rows) == 1, rows
    return tuple(rows[0])


def counts(**nonzero: int) -> dict[str, int]:
    base = {"pending": 0, "leased": 0, "done": 0, "failed": 0, "redirected": 0, "records": 0}
    base.update(nonzero)
    return base


def frontier_keys(store: Any) -> list[str]:
    return [r[0] for r in store.query("SELECT key FROM requests ORDER BY key")]


# -- idempotent enqueue ---------------------------------------------------------------------


def test_enqueue_same_key_twice_keeps_one_row(store):
    assert enqueue(store, req("a")) == CommitResult(requests_added=1)
    assert enqueue(store, req("a")) == CommitResult(requests_duplicate=1)
    assert store.counts() == counts(pending=1)
    assert frontier_keys(store) == ["a"]


def test_enqueue_same_key_twice_in_one_unit(store):
    assert enqueue(store, req("a"), req("a")) == CommitResult(requests_added=1,
                                                              requests_duplicate=1)
    assert store.counts() == counts(pending=1)


def test_enqueue_of_a_leased_key_is_a_duplicate(store):
    enqueue(store, req("a"))
    assert claim_keys(store, 1) == ["a"]
    assert enqueue(store, req("a")) == CommitResult(requests_duplicate=1)
    assert row(store, "a") == ("leased", "w1", 1)


def test_enqueue_of_a_done_key_is_already_done(store):
    enqueue(store, req("a"))
    claim(store, 1)
    assert complete(store, "a").completed == {"done": 1}
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)
    assert store.counts() == counts(done=1)


def test_start_request_of_a_done_key_is_already_done(store):
    # start requests (dont_filter) are re-yielded on every run, without the fingerprint filter
    enqueue(store, req("start:0", is_start=True, filter_fingerprint=False))
    claim(store, 1)
    complete(store, "start:0")
    assert enqueue(store, req("start:0", is_start=True, filter_fingerprint=False)) == (
        CommitResult(requests_already_done=1))
    assert enqueue(store, req("start:0", is_start=True, filter_fingerprint=False,
                              fingerprint="changed")) == CommitResult(requests_already_done=1)
    assert store.counts() == counts(done=1)


def test_enqueue_of_a_failed_key_is_already_done(store):
    enqueue(store, req("a"))
    claim(store, 1)
    complete(store, "a", RequestState.FAILED, error_kind="dns", error_message="no such host")
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)


def test_known_key_is_not_inserted_even_without_fingerprint_filter(store):
    enqueue(store, req("a"))
    assert enqueue(store, req("a", filter_fingerprint=False)) == CommitResult(
        requests_duplicate=1)
    assert store.counts() == counts(pending=1)


def test_fingerprint_filter_drops_a_request_known_under_another_key(store):
    # a dont_filter start request for the URL was stored under its own key
    enqueue(store, req("start:0", fingerprint="F", is_start=True, filter_fingerprint=False))
    assert enqueue(store, req("F", fingerprint="F")) == CommitResult(requests_duplicate=1)
    assert frontier_keys(store) == ["start:0"]


def test_fingerprint_filter_counts_a_finished_fingerprint_as_already_done(store):
    enqueue(store, req("start:0", fingerprint="F", filter_fingerprint=False))
    claim(store, 1)
    complete(store, "start:0")
    assert enqueue(store, req("F", fingerprint="F")) == CommitResult(requests_already_done=1)
    assert frontier_keys(store) == ["start:0"]


def test_without_fingerprint_filter_a_new_key_is_inserted(store):
    enqueue(store, req("F", fingerprint="F"))
    result = enqueue(store, req("F:retry:1", fingerprint="F", filter_fingerprint=False))
    assert result == CommitResult(requests_added=1)
    assert frontier_keys(store) == ["F", "F:retry:1"]
    assert store.counts() == counts(pending=2)


# -- leasing order and exclusivity ----------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 10])
def test_claim_order_priority_then_non_start_then_newest(store, batch):
    for new in [
        req("start1", is_start=True),
        req("a"),
        req("start2", is_start=True),
        req("high", priority=5),
        req("b"),
        req("low", priority=-1),
        req("high-start", priority=5, is_start=True),
    ]:
        enqueue(store, new)  # one transaction each: enqueue order is age order
    claimed: list[str] = []
    while leased := claim_keys(store, batch):
        assert len(leased) <= batch
        claimed.extend(leased)
    assert claimed == ["high", "high-start", "b", "a", "start2", "start1", "low"]


def test_claim_order_within_one_unit_is_newest_first(store):
    enqueue(store, req("first"), req("second"), req("third"))
    assert claim_keys(store, 3) == ["third", "second", "first"]


def test_claimed_request_carries_its_data(store):
    new = req("a", priority=4)
    enqueue(store, new)
    assert claim(store, 1) == [
        LeasedRequest(key="a", fingerprint="fp-a", data=new.data, priority=4, attempts=1)]
    assert row(store, "a") == ("leased", "w1", 1)


def test_claims_never_return_a_request_twice(store):
    enqueue(store, *(req(f"r{i}") for i in range(5)))
    first = claim_keys(store, 2)
    second = claim_keys(store, 2)
    third = claim_keys(store, 2)
    assert (len(first), len(second), len(third)) == (2, 2, 1)
    assert sorted(first + second + third) == ["r0", "r1", "r2", "r3", "r4"]
    assert claim_keys(store, 2) == []
    assert claim_keys(store, 2, worker="w2") == []


def test_second_worker_cannot_claim_what_the_first_holds(store):
    enqueue(store, req("a"), req("b"))
    assert claim_keys(store, 5, worker="w1") == ["b", "a"]
    assert claim_keys(store, 5, worker="w2") == []
    assert store.counts() == counts(leased=2)


def test_second_connection_cannot_claim_what_the_first_holds(store, make_store):
    enqueue(store, req("a"), req("b"))
    assert claim_keys(store, 1, worker="w1") == ["b"]
    other, run = open_store(make_store, "w2")
    assert (run.run_id, run.new) == (1, False)
    assert claim_keys(other, 5, worker="w2") == ["a"]
    assert claim_keys(store, 5, worker="w1") == []
    assert row(other, "b") == ("leased", "w1", 1)
    assert row(store, "a") == ("leased", "w2", 1)


# -- lease expiry, renewal, release ---------------------------------------------------------


def test_expired_lease_is_reclaimed_only_after_lease_seconds(store, clock):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS - 1)
    assert store.reclaim_expired() == 0
    assert row(store, "a") == ("leased", "w1", 1)
    assert claim_keys(store, 1, worker="w2") == []
    clock.advance(2)
    assert store.reclaim_expired() == 1
    assert row(store, "a") == ("pending", None, 1)
    assert claim(store, 1, worker="w2")[0].attempts == 2
    assert row(store, "a") == ("leased", "w2", 2)


def test_lease_holders_report_workers_counts_and_expiry(store, clock):
    assert store.lease_holders() == []
    enqueue(store, req("a"), req("b"), req("c"))
    claim(store, 1, worker="w1")
    clock.advance(10)
    claim(store, 1, worker="w2")
    clock.advance(10)
    claim(store, 1, worker="w1")
    holders = sorted(store.lease_holders(), key=lambda h: h.worker)
    assert holders == [  # the latest expiry among a worker's leases
        LeaseHolder(worker="w1", leases=2, leased_until=T0 + 20 + LEASE_SECONDS),
        LeaseHolder(worker="w2", leases=1, leased_until=T0 + 10 + LEASE_SECONDS),
    ]


def test_renew_leases_pushes_expiry(store, clock):
    enqueue(store, req("a"), req("b"))
    claim(store, 2, worker="w1")
    clock.advance(50)
    assert sorted(store.renew_leases("w1")) == ["a", "b"]
    assert store.renew_leases("w2") == []
    assert store.lease_holders() == [
        LeaseHolder(worker="w1", leases=2, leased_until=T0 + 50 + LEASE_SECONDS)]
    clock.advance(20)  # past the first expiry, before the renewed one
    assert store.reclaim_expired() == 0
    clock.advance(LEASE_SECONDS - 20 + 1)
    assert store.reclaim_expired() == 2
    assert store.counts() == counts(pending=2)


def test_renew_leases_touches_only_that_worker(store, clock):
    enqueue(store, req("a"), req("b"))
    claim(store, 1, worker="w1")
    claim(store, 1, worker="w2")
    clock.advance(30)
    store.renew_leases("w1")
    clock.advance(LEASE_SECONDS - 30 + 1)
    assert store.reclaim_expired() == 1
    assert store.lease_holders() == [
        LeaseHolder(worker="w1", leases=1, leased_until=T0 + 30 + LEASE_SECONDS)]


def test_release_leases_puts_back_only_the_named_workers(store):
    enqueue(store, req("a"), req("b"), req("c"))
    assert claim_keys(store, 2, worker="w1") == ["c", "b"]
    assert claim_keys(store, 1, worker="w2") == ["a"]
    assert store.release_leases(["w1"]) == 2
    assert store.release_leases([]) == 0
    assert store.release_leases(["w3"]) == 0
    assert store.counts() == counts(pending=2, leased=1)
    assert row(store, "b") == ("pending", None, 1)
    assert [h.worker for h in store.lease_holders()] == ["w2"]
    assert store.release_leases(["w1", "w2"]) == 1
    assert store.lease_holders() == []


# -- completion in one transaction ----------------------------------------------------------


def test_completion_commits_children_records_and_done_together(store, clock):
    enqueue(store, req("parent"))
    claim(store, 1)
    clock.advance(5)
    result = store.commit(
        UnitOfWork(
            requests=[req("child1", parent_key="parent"), req("child2", parent_key="parent")],
            records=[(rec("r1", "h1"), "parent")],
            completions=[Completion("parent", RequestState.DONE)],
        ),
        "w1",
    )
    assert result == CommitResult(requests_added=2, records_inserted=1, completed={"done": 1})
    assert store.counts() == counts(pending=2, done=1, records=1)
    assert row(store, "parent") == ("done", None, 1)
    assert store.query(
        "SELECT key, parent_key FROM requests WHERE state = 'pending' ORDER BY key"
    ) == [("child1", "parent"), ("child2", "parent")]
    assert store.query(
        "SELECT record_id, source, natural_key, item_type, data, content_hash, first_seen,"
        " last_changed, request_key FROM records"
    ) == [("r1", "shop", '["A1"]', "dict", '{"sku":"A1"}', "h1", T0 + 5, T0 + 5, "parent")]


def test_completion_and_claim_in_one_unit(store):
    enqueue(store, req("parent"))
    claim(store, 1)
    result = store.commit(
        UnitOfWork(requests=[req("child")], completions=[Completion("parent", RequestState.DONE)],
                   claim=1),
        "w1",
    )
    assert result.requests_added == 1
    assert result.completed == {"done": 1}
    assert [leased.key for leased in result.leased] == ["child"]
    assert store.counts() == counts(leased=1, done=1)


def test_failed_completion_keeps_the_error(store):
    enqueue(store, req("a"))
    claim(store, 1)
    result = complete(store, "a", RequestState.FAILED, error_kind="http_status",
                      error_message="HTTP 500 not handled by the spider")
    assert result == CommitResult(completed={"failed": 1})
    assert store.query("SELECT state, error_kind, error_message FROM requests") == [
        ("failed", "http_status", "HTTP 500 not handled by the spider")]


def test_redirected_completion(store):
    enqueue(store, req("a"))
    claim(store, 1)
    assert complete(store, "a", RequestState.REDIRECTED) == CommitResult(
        completed={"redirected": 1})
    assert store.counts() == counts(redirected=1)


def test_empty_unit_of_work_changes_nothing(store):
    assert store.commit(UnitOfWork(), "w1") == CommitResult()
    assert store.counts() == counts()


def test_rejects_are_stored(store):
    result = store.commit(
        UnitOfWork(rejects=[Reject(item_type="dict", reason="no sku", data='{"name":"x"}',
                                   request_key="p1")]),
        "w1",
    )
    assert result == CommitResult(rejects=1)
    assert store.query("SELECT item_type, reason, data, request_key FROM rejects") == [
        ("dict", "no sku", '{"name":"x"}', "p1")]


# -- record upserts -------------------------------------------------------------------------


def record_times(store: Any, record_id: str) -> tuple[Any, ...]:
    rows = store.query(
        "SELECT data, content_hash, first_seen, last_changed FROM records WHERE record_id = ?",
        (record_id,),
    )
    assert len(rows) == 1, rows
    return tuple(rows[0])


def commit_record(store: Any, record: Record) -> CommitResult:
    return store.commit(UnitOfWork(records=[(record, None)]), "w1")


def test_record_upsert_insert_unchanged_updated(store, clock):
    assert commit_record(store, rec("r1", "h1", '{"price":1}')) == CommitResult(
        records_inserted=1)
    assert record_times(store, "r1") == ('{"price":1}', "h1", T0, T0)

    clock.advance(100)
    assert commit_record(store, rec("r1", "h1", '{"price":1}')) == CommitResult(
        records_unchanged=1)
    assert record_times(store, "r1") == ('{"price":1}', "h1", T0, T0)

    clock.advance(100)
    assert commit_record(store, rec("r1", "h2", '{"price":2}')) == CommitResult(
        records_updated=1)
    assert record_times(store, "r1") == ('{"price":2}', "h2", T0, T0 + 200)

    clock.advance(100)
    assert commit_record(store, rec("r1", "h2", '{"price":2}')) == CommitResult(
        records_unchanged=1)
    assert record_times(store, "r1") == ('{"price":2}', "h2", T0, T0 + 200)
    assert store.counts() == counts(records=1)


def test_record_times_never_go_backwards_across_a_backward_clock_step(store, clock):
    """The wall clock steps back an hour between two changes: first_seen <= last_changed
    still holds, and `--since` with the newest time the data showed finds the later change
    (and the record first seen after the step)."""
    commit_record(store, rec("r1", "h1", '{"price":1}'))
    clock.advance(100)
    commit_record(store, rec("r2", "h1", '{"price":1}'))
    shown = max(r["last_changed"] for r in store.records_page())  # what an export showed
    clock.advance(-3600)  # NTP steps the clock back
    commit_record(store, rec("r1", "h2", '{"price":2}'))
    commit_record(store, rec("r3", "h1", '{"price":3}'))
    times = {r["record_id"]: (r["first_seen"], r["last_changed"])
             for r in store.records_page()}
    assert all(first <= last for first, last in times.values()), times
    assert {r["record_id"] for r in store.records_page(changed_since=shown)} >= {"r1", "r3"}
    assert store.anomalies()["record_times"] == 0


def test_record_with_same_hash_is_unchanged_whatever_its_data(store, clock):
    # volatile fields are in the data but not in the hash: such a change is no change
    commit_record(store, rec("r1", "h1", '{"seen":1}'))
    clock.advance(100)
    assert commit_record(store, rec("r1", "h1", '{"seen":2}')) == CommitResult(
        records_unchanged=1)
    assert record_times(store, "r1") == ('{"seen":1}', "h1", T0, T0)


def test_distinct_records_in_one_unit(store):
    result = store.commit(UnitOfWork(records=[(rec("r1", "h1"), None), (rec("r2", "h1"), None),
                                              (rec("r1", "h9"), None)]), "w1")
    assert result == CommitResult(records_inserted=2, records_updated=1)
    assert store.counts() == counts(records=2)


# -- rollback -------------------------------------------------------------------------------


def test_failed_commit_writes_nothing_of_its_unit(store):
    enqueue(store, req("parent"))
    claim(store, 1)
    broken = Record(record_id="r2", source=None, natural_key='["B"]',  # type: ignore[arg-type]
                    item_type="dict", data="{}", content_hash="h2")
    work = UnitOfWork(
        requests=[req("child1"), req("child2")],
        records=[(rec("r1", "h1"), "parent"), (broken, "parent")],
        completions=[Completion("parent", RequestState.DONE)],
    )
    with pytest.raises(COMMIT_ERRORS):  # source is NOT NULL
        store.commit(work, "w1")
    assert frontier_keys(store) == ["parent"]
    assert row(store, "parent") == ("leased", "w1", 1)
    assert store.counts() == counts(leased=1)
    assert store.query("SELECT count(*) FROM records") == [(0,)]

    # the store is usable afterwards: no transaction was left open
    work.records = [(rec("r1", "h1"), "parent")]
    assert store.commit(work, "w1") == CommitResult(requests_added=2, records_inserted=1,
                                                    completed={"done": 1})
    assert store.counts() == counts(pending=2, done=1, records=1)


def test_failure_after_a_completion_rolls_the_completion_back(store):
    enqueue(store, req("a"), req("b"))
    claim(store, 2)
    store.journal_response("a", '{"status":200}', b"<html>")
    work = UnitOfWork(
        requests=[req("child")],
        records=[(rec("r1", "h1"), "a")],
        rejects=[Reject(item_type="dict", reason="no sku", data="{}", request_key="a")],
        completions=[
            Completion("a", RequestState.DONE),
            Completion("b", RequestState.PENDING, data={"not": "text"}),  # type: ignore[arg-type]
        ],
    )
    with pytest.raises(COMMIT_ERRORS):  # the data of a continuation must be JSON text
        store.commit(work, "w1")
    assert row(store, "a") == ("leased", "w1", 1)
    assert row(store, "b") == ("leased", "w1", 1)
    assert store.counts() == counts(leased=2)
    assert store.query("SELECT count(*) FROM rejects") == [(0,)]
    assert frontier_keys(store) == ["a", "b"]
    assert store.journaled_response("a") == ('{"status":200}', b"<html>")


# -- completions guarded by the lease owner -------------------------------------------------


def test_completion_by_another_worker_is_a_lost_lease(store):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    result = complete(store, "a", worker="w2")
    assert result == CommitResult(leases_lost=1)
    assert row(store, "a") == ("leased", "w1", 1)


def test_completion_after_the_lease_moved_to_another_worker(store, clock):
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    claim(store, 1, worker="w2")
    assert complete(store, "a", worker="w1") == CommitResult(leases_lost=1)
    assert row(store, "a") == ("leased", "w2", 2)
    assert complete(store, "a", worker="w2") == CommitResult(completed={"done": 1})
    assert row(store, "a") == ("done", None, 2)


def test_completion_of_a_pending_request_is_a_lost_lease(store):
    enqueue(store, req("a"))
    assert complete(store, "a") == CommitResult(leases_lost=1)
    assert row(store, "a") == ("pending", None, 0)


def test_completion_of_a_done_request_is_a_lost_lease(store):
    enqueue(store, req("a"))
    claim(store, 1)
    complete(store, "a")
    assert complete(store, "a", RequestState.FAILED) == CommitResult(leases_lost=1)
    assert row(store, "a") == ("done", None, 1)


def test_lost_lease_writes_nothing_of_its_unit_of_work(store, clock):
    """The lease fences the whole unit of work: a completion that is not the worker's any
    more writes neither its records, nor its rejects, nor its child requests, nor a journal
    row, and counts nothing in the run's counters; the rest of the transaction (an orphan
    request, another page's completion) is written."""
    enqueue(store, req("a"), req("b"))
    claim(store, 2, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    assert claim_keys(store, 1, worker="w2") == ["b"]
    assert store.commit(UnitOfWork(records=[(rec("r1", "new"), "b")],
                                   completions=[Completion("b", RequestState.DONE)]),
                        "w2").records_inserted == 1
    runs_before = store.runs()
    result = store.commit(
        UnitOfWork(requests=[req("orphan"), req("child", parent_key="b")],
                   records=[(rec("r1", "old"), "b"), (rec("r2", "x"), "b")],
                   rejects=[Reject("T", "no key", "{}", "b")],
                   responses=[("b", "{}", b"late")],
                   started=["b"],
                   completions=[Completion("b", RequestState.DONE)]),
        "w1",
    )
    assert result == CommitResult(requests_added=1, leases_lost=1)
    assert result.lost == ["b"]
    assert store.query("SELECT record_id, content_hash FROM records") == [("r1", "new")]
    assert store.query("SELECT count(*) FROM rejects") == [(0,)]
    assert store.query("SELECT count(*) FROM responses") == [(0,)]
    assert store.query("SELECT key FROM requests WHERE key IN ('orphan', 'child')") == [
        ("orphan",)]
    assert store.query("SELECT attempts FROM requests WHERE key = 'b'") == [(2,)]
    runs_after = store.runs()
    assert [r["done"] for r in runs_after] == [r["done"] for r in runs_before]
    assert [r["leased"] for r in runs_after] == [r["leased"] for r in runs_before]


def test_renewal_does_not_revive_an_expired_lease(store, clock):
    enqueue(store, req("a"), req("b"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS / 2)
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS / 2 + 1)  # b (claimed first: newest) expired, a live
    assert store.renew_leases("w1") == ["a"]
    assert store.reclaim_expired() == 1
    assert row(store, "b") == ("pending", None, 1)


def test_pending_completion_is_a_continuation(store):
    enqueue(store, req("a", priority=0))
    claim(store, 1)
    result = complete(store, "a", RequestState.PENDING, data='{"url":"retry"}', priority=-3)
    assert result == CommitResult(completed={"pending": 1})
    assert row(store, "a") == ("pending", None, 1)
    assert claim(store, 1, worker="w2") == [
        LeasedRequest(key="a", fingerprint="fp-a", data='{"url":"retry"}', priority=-3,
                      attempts=2, downloads=1)]


def test_pending_completion_without_data_keeps_the_stored_request(store):
    new = req("a", priority=2)
    enqueue(store, new)
    claim(store, 1)
    complete(store, "a", RequestState.PENDING)
    assert claim(store, 1) == [
        LeasedRequest(key="a", fingerprint="fp-a", data=new.data, priority=2, attempts=2,
                      downloads=1)]


# -- attempts and quarantine ----------------------------------------------------------------


def test_request_started_max_attempts_times_without_finishing_is_quarantined(make_store):
    store, _ = open_store(make_store, "w1", max_attempts=2)
    enqueue(store, req("poison"))
    for attempt in (1, 2):
        assert [(r.key, r.attempts) for r in claim(store, 1)] == [("poison", attempt)]
        assert store.release_leases(["w1"]) == 1  # the worker died with it
    result = store.commit(UnitOfWork(claim=1), "w1")
    assert result == CommitResult(quarantined=["https://shop.example/poison"])
    assert store.query("SELECT state, worker, attempts, error_kind FROM requests") == [
        ("failed", None, 2, "quarantined")]
    assert store.counts() == counts(failed=1)
    assert enqueue(store, req("poison")) == CommitResult(requests_already_done=1)


@pytest.mark.parametrize(("max_attempts", "alone_from"), [(10, 2), (3, 2), (2, 1)])
def test_a_request_runs_alone_once_it_was_in_flight_at_two_deaths(make_store, max_attempts,
                                                                  alone_from):
    """In flight at one death: replayed with the rest (a resume runs at full concurrency).
    At two deaths (at one, when the limit is 2): a suspect, to run alone."""
    store, _ = open_store(make_store, "w1", max_attempts=max_attempts)
    enqueue(store, req("page"))
    suspects = []
    for _ in range(max_attempts):
        (leased,) = claim(store, 1)
        suspects.append(leased.suspect)
        store.release_leases(["w1"])  # the worker died with it in flight
    assert suspects == [deaths >= alone_from for deaths in range(max_attempts)]


def test_quarantine_leaves_other_requests_claimable(make_store):
    store, _ = open_store(make_store, "w1", max_attempts=1)
    enqueue(store, req("poison", priority=9), req("fine"))
    assert claim_keys(store, 1) == ["poison"]
    store.release_leases(["w1"])
    result = store.commit(UnitOfWork(claim=2), "w1")
    assert len(result.quarantined) == 1
    assert [(r.key, r.attempts) for r in result.leased] == [("fine", 1)]


def test_claimed_but_never_started_leases_do_not_count_towards_quarantine(make_store):
    """A worker that dies with a batch of claimed requests it had not started yet: only what
    it started is a suspect."""
    store, _ = open_store(make_store, "w1", max_attempts=2)
    enqueue(store, req("bystander"), req("poison", priority=9))
    for _ in range(2):
        leased = store.commit(UnitOfWork(claim=2), "w1").leased
        assert [r.key for r in leased] == ["poison", "bystander"]
        store.commit(UnitOfWork(started=["poison"]), "w1")  # started poison, then died
        store.release_leases(["w1"])
    result = store.commit(UnitOfWork(claim=2), "w1")
    assert [(r.key, r.attempts) for r in result.leased] == [("bystander", 1)]
    assert store.query("SELECT key, state, attempts, unfinished FROM requests ORDER BY key") == [
        ("bystander", "leased", 0, 0), ("poison", "failed", 2, 0)]


def test_a_completed_attempt_resets_the_unfinished_count(make_store):
    store, _ = open_store(make_store, "w1", max_attempts=2)
    enqueue(store, req("flaky"))
    for _ in range(5):  # retried again and again, each attempt completes its lease
        assert len(claim(store, 1)) == 1
        store.commit(UnitOfWork(completions=[Completion("flaky", RequestState.PENDING)]), "w1")
    assert store.query("SELECT state, attempts, unfinished FROM requests") == [
        ("pending", 5, 0)]


# -- runs and sessions ----------------------------------------------------------------------


def finish_one(store: Any, key: str, record: Record | None = None) -> None:
    enqueue(store, req(key))
    claim(store, 1)
    store.commit(UnitOfWork(records=[(record, key)] if record else [],
                            completions=[Completion(key, RequestState.DONE)]), "w1")


def test_new_database_starts_run_1(make_store):
    _, run = open_store(make_store, "w1")
    assert run == RunInfo(run_id=1, new=True, counts=counts())


def test_finished_run_then_auto_starts_a_new_run_keeping_records(make_store, clock):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a", rec("r1", "h1"))
    assert store.end_session("w1", "finished") == 0
    store.close()

    clock.advance(3600)
    store, run = open_store(make_store, "w2")
    assert run == RunInfo(run_id=2, new=True, counts=counts(records=1))
    assert frontier_keys(store) == []
    # the frontier was cleared: the page is fetched again in the new run
    assert enqueue(store, req("a"), worker="w2") == CommitResult(requests_added=1)
    assert record_times(store, "r1") == ('{"sku":"A1"}', "h1", T0, T0)


def test_end_session_finished_with_pending_requests_keeps_the_run_open(make_store):
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"), req("b"))
    assert store.end_session("w1", "finished") == 0
    store.close()
    _, run = open_store(make_store, "w2")
    assert run == RunInfo(run_id=1, new=False, counts=counts(pending=2))


def test_end_session_finished_while_another_worker_holds_leases_keeps_the_run_open(make_store):
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"))
    claim(store, 1, worker="w2")
    assert store.end_session("w1", "finished") == 0
    store.close()
    _, run = open_store(make_store, "w3")
    assert run == RunInfo(run_id=1, new=False, counts=counts(leased=1))


def test_end_session_with_another_reason_never_finishes_the_run(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a")
    assert store.end_session("w1", "shutdown") == 0
    store.close()
    _, run = open_store(make_store, "w2")
    assert run == RunInfo(run_id=1, new=False, counts=counts(done=1))


def test_end_session_releases_the_workers_leases(store):
    enqueue(store, req("a"), req("b"), req("c"))
    claim(store, 2, worker="w1")
    claim(store, 1, worker="w2")
    assert store.end_session("w1", "shutdown") == 2
    assert store.counts() == counts(pending=2, leased=1)
    assert [h.worker for h in store.lease_holders()] == ["w2"]


def test_fresh_always_starts_a_new_run(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a", rec("r1", "h1"))
    enqueue(store, req("b"))  # unfinished run
    store.close()
    store, run = open_store(make_store, "w2", "fresh")
    assert run == RunInfo(run_id=2, new=True, counts=counts(records=1))
    assert frontier_keys(store) == []


def test_resume_keeps_the_last_run_even_when_finished(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a")
    store.end_session("w1", "finished")
    store.close()
    store, run = open_store(make_store, "w2", "resume")
    assert run == RunInfo(run_id=1, new=False, counts=counts(done=1))
    assert enqueue(store, req("a"), worker="w2") == CommitResult(requests_already_done=1)


def test_resume_on_a_new_database_starts_run_1(make_store):
    _, run = open_store(make_store, "w1", "resume")
    assert run == RunInfo(run_id=1, new=True, counts=counts())


def test_records_remember_the_run_that_created_and_changed_them(make_store):
    store, _ = open_store(make_store, "w1")
    finish_one(store, "a", rec("r1", "h1"))
    finish_one(store, "b", rec("r2", "h1"))
    store.end_session("w1", "finished")
    store.close()
    store, _ = open_store(make_store, "w2")
    store.commit(UnitOfWork(records=[(rec("r1", "h2"), None), (rec("r2", "h1"), None)]), "w2")
    assert store.query(
        "SELECT record_id, first_run_id, changed_run_id FROM records ORDER BY record_id"
    ) == [("r1", 1, 2), ("r2", 1, 1)]


# -- the response journal -------------------------------------------------------------------


def test_journaled_response_is_kept_until_the_completion(store):
    enqueue(store, req("a"), req("b"))
    claim(store, 2)
    assert store.journaled_response("a") is None
    store.journal_response("a", '{"status":200}', b"\x00<html>")
    assert store.journaled_response("a") == ('{"status":200}', b"\x00<html>")
    assert store.journaled_response("b") is None
    store.journal_response("a", '{"status":203}', b"")  # a later response replaces it
    assert store.journaled_response("a") == ('{"status":203}', b"")
    result = store.commit(UnitOfWork(requests=[req("child")],
                                     completions=[Completion("a", RequestState.DONE)]), "w1")
    assert result.completed == {"done": 1}
    assert store.journaled_response("a") is None


def test_continuation_deletes_the_journaled_response(store):
    enqueue(store, req("a"))
    claim(store, 1)
    store.journal_response("a", '{"status":503}', b"busy")
    complete(store, "a", RequestState.PENDING, data='{"url":"retry"}')
    assert store.journaled_response("a") is None


def test_lost_lease_completion_keeps_the_journaled_response(store, clock):
    # w1's lease expired and w2 took the request over and journaled its response; w1's late
    # completion is refused and must change nothing, the journal of w2 included
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    clock.advance(LEASE_SECONDS + 1)
    store.reclaim_expired()
    claim(store, 1, worker="w2")
    store.journal_response("a", '{"status":200}', b"w2")
    assert complete(store, "a", worker="w1") == CommitResult(leases_lost=1)
    assert store.journaled_response("a") == ('{"status":200}', b"w2")


def test_new_run_discards_the_journal(make_store):
    store, _ = open_store(make_store, "w1")
    enqueue(store, req("a"))
    claim(store, 1)
    store.journal_response("a", '{"status":200}', b"x")
    store.close()
    store, run = open_store(make_store, "w2", "fresh")
    assert run.new is True
    assert store.journaled_response("a") is None


# -- the recrawl window ---------------------------------------------------------------------

RECRAWL_SECONDS = 3600.0
#: T0 lies 800 s into its recrawl window: the next window starts this much later
NEXT_WINDOW = RECRAWL_SECONDS - T0 % RECRAWL_SECONDS


def test_without_recrawl_window_done_stays_done(store, clock):
    finish_one(store, "a")
    clock.advance(10 * 365 * 86400)
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)


def test_recrawl_done_request_is_due_again_in_a_later_window(make_store, clock):
    assert NEXT_WINDOW == 2800.0
    store, _ = open_store(make_store, "w1", recrawl_seconds=RECRAWL_SECONDS)
    finish_one(store, "a")
    clock.advance(NEXT_WINDOW - 1)  # same window
    assert enqueue(store, req("a")) == CommitResult(requests_already_done=1)
    clock.advance(1)
    assert enqueue(store, req("a", priority=3, data='{"v":2}')) == CommitResult(
        requests_due_again=1)
    assert row(store, "a") == ("pending", None, 0)
    assert enqueue(store, req("a")) == CommitResult(requests_duplicate=1)
    assert claim(store, 1) == [
        LeasedRequest(key="a", fingerprint="fp-a", data='{"v":2}', priority=3, attempts=1)]


def test_recrawl_new_run_keeps_what_was_done_in_the_current_window(make_store, clock):
    store, _ = open_store(make_store, "w1", recrawl_seconds=RECRAWL_SECONDS)
    finish_one(store, "a", rec("r1", "h1"))
    enqueue(store, req("b"))
    store.close()
    clock.advance(100)
    store, run = open_store(make_store, "w2", "fresh", recrawl_seconds=RECRAWL_SECONDS)
    assert run == RunInfo(run_id=2, new=True, counts=counts(done=1, records=1))
    assert enqueue(store, req("a"), worker="w2") == CommitResult(requests_already_done=1)
    store.close()
    clock.advance(NEXT_WINDOW)
    store, run = open_store(make_store, "w3", "fresh", recrawl_seconds=RECRAWL_SECONDS)
    assert run == RunInfo(run_id=3, new=True, counts=counts(records=1))


# -- status ---------------------------------------------------------------------------------


def test_status_claimable_and_leased_elsewhere(store):
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=False)
    enqueue(store, req("a"), req("b"))
    assert store.status("w1") == FrontierStatus(claimable=True, leased_elsewhere=False)
    claim(store, 1, worker="w2")
    assert store.status("w1") == FrontierStatus(claimable=True, leased_elsewhere=True)
    assert store.status("w2") == FrontierStatus(claimable=True, leased_elsewhere=False)
    claim(store, 1, worker="w2")
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=True)
    assert store.status("w2") == FrontierStatus(claimable=False, leased_elsewhere=False)
    complete(store, "a", worker="w2")
    complete(store, "b", worker="w2")
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=False)


def test_status_counts_the_workers_own_expired_leases_as_reclaimable(store, clock):
    """A worker whose leases expired (it was stopped) must reclaim them itself: nobody else
    may be running, and it would otherwise finish with requests left leased."""
    enqueue(store, req("a"))
    claim(store, 1, worker="w1")
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=False)
    clock.advance(LEASE_SECONDS + 1)
    assert store.status("w1") == FrontierStatus(claimable=False, leased_elsewhere=True)


# -- the SQLite file ------------------------------------------------------------------------


def test_sqlite_reopening_an_existing_file(tmp_path, clock):
    path = str(tmp_path / "f.sqlite3")
    first = SQLiteStore(path, clock=clock)
    assert first.open(fingerprinter="x") is None
    first.begin_session("w1", "auto")
    enqueue(first, req("a"))
    first.close()
    second = SQLiteStore(path, clock=clock)
    try:
        assert second.open(fingerprinter="x") is None
        assert second.begin_session("w2", "auto") == RunInfo(run_id=1, new=False,
                                                             counts=counts(pending=1))
        assert second.query("PRAGMA user_version") == [(SCHEMA_VERSION,)]
    finally:
        second.close()


def test_sqlite_newer_schema_is_refused_and_the_file_left_untouched(tmp_path):
    from scrapy_idempotent.store.sqlite import APPLICATION_ID

    path = tmp_path / "f.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    store = SQLiteStore(str(path))
    with pytest.raises(StoreError) as caught:
        store.open(fingerprinter="x")
    message = str(caught.value)
    assert str(path) in message
    assert f"schema version {SCHEMA_VERSION + 1}" in message
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["f.sqlite3"]
    with pytest.raises(StoreError):
        store.status("w1")  # closed again


def test_sqlite_corrupt_file_is_a_store_error_naming_the_path(tmp_path):
    path = tmp_path / "f.sqlite3"
    path.write_bytes(random.Random(1234).randbytes(8192))
    before = path.read_bytes()
    store = SQLiteStore(str(path))
    with pytest.raises(StoreError) as caught:
        store.open(fingerprinter="x")
    assert str(path) in str(caught.value)
    assert path.read_bytes() == before


def test_sqlite_new_file_is_private_to_its_owner(tmp_path):
    store = SQLiteStore(str(tmp_path / "f.sqlite3"))
    try:
        store.open(fingerprinter="x")
        store.begin_session("w1", "auto")
        for name in ("f.sqlite3", "f.sqlite3-wal", "f.sqlite3-shm"):
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
    finally:
        store.close()


def test_sqlite_missing_directory_is_created(tmp_path):
    path = tmp_path / "deep" / "er" / "f.sqlite3"
    store = SQLiteStore(str(path))
    try:
        assert store.open(fingerprinter="x") is None
        assert path.is_file()
    finally:
        store.close()


def test_sqlite_open_reports_the_fingerprinter_recorded_at_creation(tmp_path):
    path = str(tmp_path / "f.sqlite3")
    for given, expected in [("x", None), ("y", "x"), ("y", "x"), ("x", None)]:
        store = SQLiteStore(path)
        try:
            assert store.open(fingerprinter=given) == expected, given
        finally:
            store.close()


def test_sqlite_wal_mode_is_on(tmp_path):
    path = tmp_path / "f.sqlite3"
    store = SQLiteStore(str(path))
    try:
        store.open(fingerprinter="x")
        assert store.query("PRAGMA journal_mode") == [("wal",)]
    finally:
        store.close()
    conn = sqlite3.connect(path)
    try:  # persistent: another connection sees WAL without asking for it
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    finally:
        conn.close()


def test_sqlite_use_before_open_is_a_store_error(tmp_path):
    store = SQLiteStore(str(tmp_path / "f.sqlite3"))
    with pytest.raises(StoreError, match="is not open"):
        store.counts()


def test_a_version_1_database_is_migrated_and_keeps_what_its_runs_saw(tmp_path):
    import sqlite3

    from scrapy_idempotent.store.sqlite import _MIGRATIONS, SCHEMA_VERSION

    path = tmp_path / "v1.sqlite3"
    conn = sqlite3.connect(path)
    for statement in _MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO runs (run_id, started_at) VALUES (1, 1.0), (2, 2.0)")
    conn.execute(
        "INSERT INTO records (record_id, source, natural_key, item_type, data, content_hash,"
        " first_seen, last_changed, first_run_id, changed_run_id) VALUES"
        " ('r1', 's', '[]', 'dict', '{}', 'h', 1.0, 2.5, 1, 2)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    store = SQLiteStore(str(path))
    store.open()
    try:
        assert store.query("PRAGMA user_version") == [(SCHEMA_VERSION,)]
        assert [row["record_id"] for row in store.run_records(2)] == ["r1"]
        assert list(store.run_records(1)) == []
        assert store.request_summary()["downloads"] == 0
    finally:
        store.close()
