"""Concurrent page commits on PostgreSQL that add the same new requests or records (two
workers whose listing pages link the same products, in another order) never deadlock: the
rows go into the tables in key order, so one commit waits for the other; the claim order
still follows the order the requests were given in. A deadlock that does happen is reported
as what it is."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from crawling import wait_for
from scrapy_idempotent.exceptions import StoreBusy
from scrapy_idempotent.store import CommitResult, CrawlIdentity, NewRequest, Record, UnitOfWork

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import PostgreSQLStore, schema_for  # noqa: E402

SHOP = CrawlIdentity(project="p", spider="shop", source="shop")
SCHEMA = schema_for(SHOP)


@pytest.fixture
def workers(postgres_url: str) -> Iterator[list[PostgreSQLStore]]:
    """Two workers' stores on one crawl, sessions begun. A lock waits as long as it takes
    (one commit waiting for the other is the point; a loaded machine makes it long)."""
    stores = [PostgreSQLStore(postgres_url, heartbeat_seconds=None, busy_timeout_seconds=600)
              for _ in range(2)]
    try:
        for n, store in enumerate(stores):
            store.open(fingerprinter="f", identity=SHOP)
            store.begin_session(f"w{n}", "auto")
        yield stores
    finally:
        for store in stores:
            store.close()


def sql(url: str, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)
        return [tuple(row) for row in cur.fetchall()] if cur.description else []


def req(key: str) -> NewRequest:
    return NewRequest(key=key, fingerprint=key, url=f"https://shop.example/{key}", priority=0,
                      data="{}", fifo=True)


def rec(record_id: str) -> Record:
    return Record(record_id=record_id, source="shop", natural_key=f'["{record_id}"]',
                  item_type="dict", data="{}", content_hash="h")


def waiting_on_locks(url: str) -> int:
    """The store connections of this test's database waiting for a lock now."""
    return int(sql(url, "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                        " current_database() AND application_name = 'scrapy_idempotent'"
                        " AND wait_event_type = 'Lock'")[0][0])


def commit_at_once(stores: list[PostgreSQLStore], units: list[UnitOfWork],
                   between: Callable[[], None] = lambda: None) -> list[Any]:
    """Each store commits its unit in a thread of its own; ``between`` runs while they do.
    Returns each commit's result, or the error it raised."""
    outcomes: list[Any] = [None] * len(stores)

    def run(n: int) -> None:
        try:
            outcomes[n] = stores[n].commit(units[n], f"w{n}")
        except Exception as exc:  # reported below
            outcomes[n] = exc

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(stores))]
    for thread in threads:
        thread.start()
    try:
        between()
    finally:
        for thread in threads:
            thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


def _held_by_a_third(postgres_url: str, statement: str,
                     workers: list[PostgreSQLStore], units: list[UnitOfWork]) -> list[Any]:
    """Commit ``units`` while a third transaction holds the middle row (``statement``, not
    committed): both commits go as far as it and wait, then it is rolled back. Inserting in
    opposite orders, each would then need what the other inserted meanwhile: a deadlock."""
    with psycopg.connect(postgres_url) as third:
        third.execute(statement)

        def release() -> None:
            wait_for(lambda: waiting_on_locks(postgres_url) == 2, 120,
                     "both page commits waiting for a lock")
            third.rollback()

        return commit_at_once(workers, units, release)


def test_new_requests_given_in_opposite_orders_do_not_deadlock(
        workers: list[PostgreSQLStore], postgres_url: str) -> None:
    keys = [f"k{n:04d}" for n in range(200)]
    outcomes = _held_by_a_third(
        postgres_url,
        f"INSERT INTO \"{SCHEMA}\".requests (key, fingerprint, url, priority, state, data,"
        " enqueued_at, run_id) VALUES ('k0100', 'k0100', 'u', 0, 'pending', '{}', 0, 1)",
        workers, [UnitOfWork(requests=[req(k) for k in keys]),
                  UnitOfWork(requests=[req(k) for k in reversed(keys)])])
    assert all(isinstance(outcome, CommitResult) for outcome in outcomes), outcomes
    assert sum(outcome.requests_added for outcome in outcomes) == len(keys)
    assert sql(postgres_url, f'SELECT count(*) FROM "{SCHEMA}".requests') == [(len(keys),)]


def test_new_records_given_in_opposite_orders_do_not_deadlock(
        workers: list[PostgreSQLStore], postgres_url: str) -> None:
    ids = [f"r{n:04d}" for n in range(200)]
    outcomes = _held_by_a_third(
        postgres_url,
        f"INSERT INTO \"{SCHEMA}\".records (record_id, source, natural_key, item_type, data,"
        " content_hash, first_seen, last_changed, first_run_id, changed_run_id, seen_run_id,"
        " seen_seq, observed_at) VALUES ('r0100', 'shop', '[]', 'dict', '{}', 'h', 1, 1, 1, 1,"
        " 1, 0, 1)",
        workers, [UnitOfWork(records=[(rec(i), None) for i in ids]),
                  UnitOfWork(records=[(rec(i), None) for i in reversed(ids)])])
    assert all(isinstance(outcome, CommitResult) for outcome in outcomes), outcomes
    assert sum(outcome.records_inserted for outcome in outcomes) == len(ids)
    assert sql(postgres_url, f'SELECT count(*) FROM "{SCHEMA}".records') == [(len(ids),)]


def test_thousands_of_shared_keys_in_opposite_orders_rounds_without_deadlock(
        workers: list[PostgreSQLStore], postgres_url: str) -> None:
    """As two workers racing over the same links: several rounds of the same 3,000 new
    requests and records, one worker in ascending order, the other in descending."""
    for round_ in range(4):
        keys = [f"round{round_}-{n:05d}" for n in range(3000)]
        units = [UnitOfWork(requests=[req(k) for k in order],
                            records=[(rec(k), None) for k in order])
                 for order in (keys, keys[::-1])]
        outcomes = commit_at_once(workers, units)
        assert all(isinstance(outcome, CommitResult) for outcome in outcomes), outcomes
        assert sum(outcome.requests_added for outcome in outcomes) == len(keys)
        assert sum(outcome.records_inserted for outcome in outcomes) == len(keys)


def test_the_claim_follows_the_order_given_not_the_key_order(
        workers: list[PostgreSQLStore]) -> None:
    keys = ["m", "z", "a", "q", "b"]
    store = workers[0]
    store.commit(UnitOfWork(requests=[req(k) for k in keys]), "w0")
    leased = store.commit(UnitOfWork(claim=len(keys)), "w0").leased
    assert [lease.key for lease in leased] == keys  # first in, first out


def test_the_feeds_follow_the_item_order_not_the_record_id_order(
        workers: list[PostgreSQLStore]) -> None:
    store = workers[0]
    first, second = ["m", "z", "a"], ["q", "a", "b"]  # "a" seen again: its first sight stays
    for ids in (first, second):
        store.commit(UnitOfWork(records=[(rec(i), None) for i in ids]), "w0")
    assert store.run_id is not None
    assert [r.record_id for r in store.run_records(store.run_id)] == ["m", "z", "a", "q", "b"]


def test_a_deadlock_is_reported_as_one_and_retried(workers: list[PostgreSQLStore],
                                                   postgres_url: str) -> None:
    sql(postgres_url, "CREATE TABLE pair (n int PRIMARY KEY)")
    sql(postgres_url, "INSERT INTO pair VALUES (1), (2)")
    first, second = (psycopg.connect(postgres_url) for _ in range(2))
    errors: list[Exception] = []
    try:
        first.execute("UPDATE pair SET n = n WHERE n = 1")
        second.execute("UPDATE pair SET n = n WHERE n = 2")

        def cross(conn: Any, n: int) -> None:
            try:
                conn.execute("UPDATE pair SET n = n WHERE n = %s", (n,))
            except psycopg.errors.DeadlockDetected as exc:
                errors.append(exc)
            conn.rollback()

        threads = [threading.Thread(target=cross, args=(first, 2)),
                   threading.Thread(target=cross, args=(second, 1))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        first.close()
        second.close()
    [deadlock] = errors
    error = workers[0]._error(deadlock, "committing")
    assert isinstance(error, StoreBusy)
    assert "waited for each other's locks while committing" in str(error)
    assert "IDEMPOTENT_BUSY_TIMEOUT_SECONDS" not in str(error)
