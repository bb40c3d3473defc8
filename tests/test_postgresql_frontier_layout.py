"""The PostgreSQL frontier's storage layout: its pages filled (no free room kept), its pending
indexes holding the queue reversed (the head at the right end, where last-in-first-out
requests are appended) and read backward by both claims, in order, without a sort; and a
database of the schema before migrated to it with its pending requests kept in order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scrapy_idempotent._order import queue_position
from scrapy_idempotent.store import CommitResult, NewRequest, UnitOfWork
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


def _as_schema_17(postgres_url: str) -> None:
    """The requests' keys as schema version 17 left them: the primary key the id's."""
    sql(postgres_url, "ALTER TABLE requests DROP CONSTRAINT requests_key_key, ADD CONSTRAINT"
                      " requests_key_key UNIQUE (key), ADD CONSTRAINT requests_pkey"
                      " PRIMARY KEY (id)")
    sql(postgres_url, "UPDATE meta SET value = '17' WHERE key = 'schema_version'")


def _as_schema_15(postgres_url: str) -> None:
    """The database as schema version 15 left it (the steps before are unchanged)."""
    _as_schema_17(postgres_url)
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
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "18"
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


def _primary_key(postgres_url: str) -> list[tuple[Any, ...]]:
    """The requests' primary key: its name and its index's definition."""
    return [(name, " ".join(definition.split())) for name, definition in sql(
        postgres_url, "SELECT c.conname, pg_get_indexdef(c.conindid) FROM pg_constraint c"
        f" WHERE c.conrelid = '{SCHEMA}.requests'::regclass AND c.contype = 'p'")]


def _request_indexes(postgres_url: str) -> list[str]:
    return [name for (name,) in sql(postgres_url, "SELECT indexname FROM pg_indexes WHERE"
                                    f" schemaname = '{SCHEMA}' AND tablename = 'requests'"
                                    " ORDER BY indexname")]


def test_a_schema_17_frontier_gets_its_key_as_primary_key(url: str, postgres_url: str) -> None:
    """Schema 18: the requests' primary key is their key, and ``id`` (still an identity)
    has no index of its own but the redirected requests'. The requests of schema 17 keep
    their ids and their order; a done request found again by its key is due again."""
    first = _store(url)
    first.open()
    first.begin_session("w1", "resume")
    first.commit(UnitOfWork(requests=_requests(40)), "w1")
    first.close()
    _as_schema_17(postgres_url)
    assert _primary_key(postgres_url) == [
        ("requests_pkey", f"CREATE UNIQUE INDEX requests_pkey ON {SCHEMA}.requests"
                          " USING btree (id)")]
    ids = sql(postgres_url, "SELECT key, id FROM requests ORDER BY key")
    store = _store(url)
    store.open()
    try:
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "18"
        assert _primary_key(postgres_url) == [
            ("requests_key_key", f"CREATE UNIQUE INDEX requests_key_key ON {SCHEMA}.requests"
                                 " USING btree (key)")]
        assert "requests_pkey" not in _request_indexes(postgres_url)
        assert sql(postgres_url, "SELECT key, id FROM requests ORDER BY key") == ids
        [(identity,)] = sql(postgres_url, "SELECT attidentity FROM pg_attribute WHERE"
                            f" attrelid = '{SCHEMA}.requests'::regclass AND attname = 'id'")
        assert identity == "d"
        store.begin_session("w1", "resume")
        store.commit(UnitOfWork(requests=_requests(20, start=40)), "w1")
        [(lowest_new,)] = sql(postgres_url, "SELECT min(id) FROM requests WHERE key >= 'k040'")
        assert lowest_new > max(i for _, i in ids)
        # Scrapy's order: the highest priority first, then the newest first (LIFO)
        assert _claim_all(store) == [f"k{n:03}" for n in
                                     sorted(range(60), key=lambda n: (-(n % 2), -n))]
    finally:
        store.close()


class _Recording:
    """The store's cursor, keeping the statements sent through it."""

    def __init__(self, cur: Any) -> None:
        self.cur = cur
        self.statements: list[tuple[str, Any]] = []

    def execute(self, statement: str, params: Any = None, **options: Any) -> _Recording:
        self.statements.append((statement, params))
        self.cur.execute(statement, params, **options)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cur, name)


def _plans_without_seq_scans(postgres_url: str,
                             statements: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Each statement on the requests of ``statements`` with its plan, planned with
    sequential scans priced out (so any index that serves a statement is taken)."""
    with psycopg.connect(postgres_url) as conn:
        conn.execute(f"SET search_path TO {SCHEMA}")
        conn.execute("ANALYZE requests")
        conn.execute("SET enable_seqscan = off")
        return [(statement, "\n".join(
                    row[0] for row in conn.execute("EXPLAIN " + statement, params)))
                for statement, params in statements if "requests" in statement]


def test_claims_and_the_take_back_find_their_rows_by_an_index(
        store: PostgreSQLStore, postgres_url: str) -> None:
    """The statements that found rows by their ``id`` (which has no index since schema 18)
    find them by the primary key: the claim's update of the rows it locked, the claim by
    slot and the take-back of expired leases before it. None reads the table through."""
    store.commit(UnitOfWork(requests=_requests(3000)), "w1")
    assert len(store.commit(UnitOfWork(claim=20), "w1").leased) == 20
    with store._write("claiming") as cur:
        recording = _Recording(cur)
        assert len(store._claim_rows(recording, "w1", 8, 200.0)) == 8
    store.keep_slot_limits(SlotLimits(concurrency=1000, dead_worker_pause_seconds=5))
    with store._write("taking back") as cur:
        # the 28 leases expired: taken back, their slots paused
        recording.cur = cur
        result = CommitResult()
        assert store._claim_by_slot(recording, "w1", 8, 2e8, 1e8, result, {}, {}) == []
        assert result.reclaimed is not None and result.reclaimed.expired == 28
    with store._write("claiming by slot") as cur:
        recording.cur = cur
        assert len(store._claim_by_slot(recording, "w1", 8, 3e8, 2e8, CommitResult(), {},
                                        {})) == 8
    by_row = f"{store.REQUEST_ROW} IN (SELECT {store.REQUEST_ROW}"
    planned = _plans_without_seq_scans(postgres_url, recording.statements)
    # the claim; the take-back's slots and its update; the claim by slot
    assert sum(by_row in s or "FROM head" in s for s, _ in planned) == 4
    for statement, plan in planned:
        assert "Seq Scan on requests" not in plan, plan
        if by_row in statement or "FROM head" in statement:
            assert "requests_key_key on requests" in plan, plan
