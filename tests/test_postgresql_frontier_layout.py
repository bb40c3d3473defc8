"""The PostgreSQL frontier's storage layout: its pages filled (no free room kept), its pending
indexes holding the queue reversed (the head at the right end, where last-in-first-out
requests are appended) and read backward by both claims, in order, without a sort; and a
database of the schema before migrated to it with its pending requests kept in order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scrapy_idempotent._order import queue_position
from scrapy_idempotent.store import NewRequest, UnitOfWork
from scrapy_idempotent.store.base import SlotLimits

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import SCHEMA_VERSION, PostgreSQLStore  # noqa: E402

SCHEMA = "layout"


@pytest.fixture
def url(postgres_url: str) -> str:
    return f"{postgres_url}?schema={SCHEMA}"


def _store(url: str) -> PostgreSQLStore:
    return PostgreSQLStore(url, clock=lambda: 100.0, heartbeat_seconds=None,
                           dead_after_seconds=None)


def sql(postgres_url: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        cur = conn.execute(statement)
        return cur.fetchall() if cur.description else []


def _options(postgres_url: str) -> list[str]:
    [(options,)] = sql(postgres_url, "SELECT reloptions FROM pg_class"
                                     f" WHERE oid = '{SCHEMA}.requests'::regclass")
    return list(options)


def _requests(count: int, start: int = 0) -> list[NewRequest]:
    return [NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}", url=f"https://s{n % 3}/{n}",
                       priority=n % 2, data="{}", slot=f"s{n % 3}")
            for n in range(start, start + count)]


@pytest.fixture
def store(url: str) -> Iterator[PostgreSQLStore]:
    store = _store(url)
    store.open()
    store.begin_session("w1", "resume")
    yield store
    store.close()


def test_a_new_frontier_fills_its_pages(store: PostgreSQLStore, postgres_url: str) -> None:
    assert "fillfactor=100" in _options(postgres_url)


def _plan(postgres_url: str, statement: str) -> str:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.execute("ANALYZE requests")
        return "\n".join(row[0] for row in conn.execute(f"EXPLAIN {statement}"))


@pytest.mark.parametrize("by_slot", [False, True], ids=["worker", "crawl"])
def test_claims_read_the_pending_index_backward_without_a_sort(
        store: PostgreSQLStore, postgres_url: str, by_slot: bool) -> None:
    """The claims' statements (PostgreSQLStore._claim_rows: IDEMPOTENT_POLITENESS "worker";
    SqlPoliteness._claim_by_slot: "crawl") on a frontier of 3,000 requests: an index scan
    backward that stops at the limit."""
    for start in range(0, 3000, 500):
        store.commit(UnitOfWork(requests=_requests(500, start=start)), "w1")
    where = "slot = 's1' AND state = 'pending'" if by_slot else "state = 'pending'"
    plan = _plan(postgres_url, f"SELECT id FROM requests WHERE {where}"
                               f" ORDER BY {store.PENDING_ORDER} LIMIT 8{store.SKIP_LOCKED}")
    index = "requests_slot_pending" if by_slot else "requests_pending"
    assert f"Index Scan Backward using {index} on requests" in plan, plan
    assert "Sort" not in plan, plan


@pytest.mark.parametrize("by_slot", [False, True], ids=["worker", "crawl"])
def test_both_claims_take_scrapys_order(store: PostgreSQLStore, by_slot: bool) -> None:
    """Priorities, start requests (FIFO) and the others (LIFO) mixed, FIFO among the others
    too: the claims give them in rules.queue_position's order, by slot or over all."""
    if by_slot:
        store.keep_slot_limits(SlotLimits(concurrency=1000))
    requests = [NewRequest(key=f"k{n:03}", fingerprint=f"k{n:03}", url=f"https://s/{n}",
                           priority=n % 3 - 1, data="{}", is_start=n % 4 == 0,
                           fifo=n % 4 == 0 or n % 7 == 0, slot="s" if by_slot else "")
                for n in range(120)]
    for start in range(0, 120, 30):
        store.commit(UnitOfWork(requests=requests[start:start + 30]), "w1")
    expected = [r.key for _, r in sorted(
        enumerate(requests), key=lambda e: queue_position(e[1].priority, e[1].is_start,
                                                           e[1].fifo, e[0]))]
    assert _claim_all(store) == expected


def _as_schema_15(postgres_url: str) -> None:
    """The database as schema version 15 left it (the steps before are unchanged)."""
    sql(postgres_url, "ALTER TABLE requests SET (fillfactor = 80)")
    for index, slot in (("requests_pending", ""), ("requests_slot_pending", "slot, ")):
        sql(postgres_url, f"DROP INDEX {index}")
        sql(postgres_url, f"CREATE INDEX {index} ON requests ({slot}priority DESC,"
                          " is_start, (CASE WHEN fifo THEN id ELSE -id END))"
                          " WHERE state = 'pending'")
    sql(postgres_url, "UPDATE meta SET value = '15' WHERE key = 'schema_version'")


def _claim_all(store: PostgreSQLStore) -> list[str]:
    claimed: list[str] = []
    while leased := store.commit(UnitOfWork(claim=7), "w1").leased:
        claimed.extend(lease.key for lease in leased)
    return claimed


def test_a_schema_15_frontier_is_migrated_with_its_requests_in_order(
        url: str, postgres_url: str) -> None:
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=_requests(40)), "w1")
    first.close()
    _as_schema_15(postgres_url)
    assert "fillfactor=80" in _options(postgres_url)
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "17"
        assert "fillfactor=100" in _options(postgres_url)
        indexes = sql(postgres_url, "SELECT indexdef FROM pg_indexes WHERE"
                      f" schemaname = '{SCHEMA}' AND indexname LIKE '%pending'"
                      " ORDER BY indexname")
        assert [" ".join(d.split()) for (d,) in indexes] == [
            f"CREATE INDEX {index} ON {SCHEMA}.requests USING btree ({slot}priority,"
            " is_start DESC, ( CASE WHEN fifo THEN (- id) ELSE id END))"
            " WHERE (state = 'pending'::text)"
            for index, slot in (("requests_pending", ""), ("requests_slot_pending", "slot, "))]
        store.begin_session("w1", "resume")
        store.commit(UnitOfWork(requests=_requests(20, start=40)), "w1")
        # Scrapy's order: the highest priority first, then the newest first (LIFO)
        assert _claim_all(store) == [f"k{n:03}" for n in
                                     sorted(range(60), key=lambda n: (-(n % 2), -n))]
    finally:
        store.close()
