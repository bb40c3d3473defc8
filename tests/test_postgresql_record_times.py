"""Record observation times on PostgreSQL, where workers on several hosts share one database:
observations are ordered on the server's clock (as leases and heartbeats are), and a worker of
the previous release, still running while the schema is upgraded, keeps committing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from scrapy_idempotent.store import (
    Completion,
    CrawlIdentity,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
)

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.base import observation_clock  # noqa: E402
from scrapy_idempotent.store.postgresql import PostgreSQLStore, schema_for  # noqa: E402

SHOP = CrawlIdentity(project="p", spider="shop", source="shop")


@pytest.fixture
def make(postgres_url: str) -> Iterator[Callable[..., PostgreSQLStore]]:
    made: list[PostgreSQLStore] = []

    def make_store(**options: Any) -> PostgreSQLStore:
        store = PostgreSQLStore(postgres_url, heartbeat_seconds=None, **options)
        store.open(fingerprinter="f", identity=SHOP)
        made.append(store)
        return store

    yield make_store
    for store in made:
        store.close()


def rec(content_hash: str, observed_at: float) -> Record:
    return Record(record_id="r1", source="shop", natural_key='["A1"]', item_type="dict",
                  data=f'{{"v": "{content_hash}"}}', content_hash=content_hash,
                  observed_at=observed_at)


def page(store: PostgreSQLStore, worker: str, key: str, record: Record) -> Any:
    store.commit(UnitOfWork(requests=[NewRequest(key=key, fingerprint=key,
                                                 url=f"https://shop.example/{key}",
                                                 priority=0, data="{}")]), worker)
    store.commit(UnitOfWork(claim=1), worker)
    return store.commit(UnitOfWork(records=[(record, key)],
                                   completions=[Completion(key, RequestState.DONE)]), worker)


def test_a_worker_whose_clock_runs_ahead_does_not_hide_later_changes(
        make: Callable[..., PostgreSQLStore]) -> None:
    """Worker ``fast``'s clock is 100 s ahead (its measured offset to the server says so);
    it stores a record. A worker with a right clock then observes a change: the change is
    newer on the server's clock and must be stored, not refused as stale."""
    fast = make()
    fast.begin_session("fast", "auto")
    # what the offset measured on a host 100 s ahead would be
    fast._observed_offset -= 100.0
    page(fast, "fast", "a", rec("old", observation_clock() + 100.0))
    right = make()
    right.begin_session("right", "auto")
    result = page(right, "right", "b", rec("new", observation_clock() + 1.0))
    assert (result.records_updated, result.records_stale) == (1, 0)
    [stored] = right.records_page(limit=10)
    assert stored.content_hash == "new"


def test_a_worker_of_the_previous_release_keeps_inserting_records(
        make: Callable[..., PostgreSQLStore], postgres_url: str) -> None:
    """A rolling upgrade: the schema was migrated by a new worker while one of the previous
    release still runs; its record insert does not know the observation time."""
    store = make()
    schema = schema_for(SHOP)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".records (record_id, source, natural_key, item_type, data,'
            " content_hash, first_seen, last_changed, first_run_id, changed_run_id,"
            " seen_run_id, seen_seq) VALUES ('r1', 'shop', '[]', 'dict', '{}', 'h1', 1, 1,"
            " 1, 1, 1, 0)")
    store.begin_session("w1", "auto")
    # the old worker's record counts as observed before anything: a new observation wins
    result = page(store, "w1", "a", rec("h2", observation_clock()))
    assert (result.records_updated, result.records_stale) == (1, 0)
