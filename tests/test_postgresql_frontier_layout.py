"""The PostgreSQL frontier's storage layout: its pages filled (no free room kept), and a
database of the schema before migrated to it with its pending requests kept in order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scrapy_idempotent.store import NewRequest, UnitOfWork

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


def _as_schema_15(postgres_url: str) -> None:
    """The database as schema version 15 left it (the steps before are unchanged)."""
    sql(postgres_url, "ALTER TABLE requests SET (fillfactor = 80)")
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
        assert store.meta()["schema_version"] == str(SCHEMA_VERSION) == "16"
        assert "fillfactor=100" in _options(postgres_url)
        store.begin_session("w1", "resume")
        store.commit(UnitOfWork(requests=_requests(20, start=40)), "w1")
        # Scrapy's order: the highest priority first, then the newest first (LIFO)
        assert _claim_all(store) == [f"k{n:03}" for n in
                                     sorted(range(60), key=lambda n: (-(n % 2), -n))]
    finally:
        store.close()
