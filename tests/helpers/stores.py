"""Store access as the store contract tests do it, through the ``FrontierStore`` interface:
new requests and records, units of work (enqueue, claim, complete, journal), reading entries
back, and a SQLite database file as an older release wrote it. The ``make_store`` and
``store`` fixtures built on them are in conftest.py."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from scrapy_idempotent.store import (
    CommitResult,
    Completion,
    LeasedRequest,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import FrontierEntry, StoredRecord
from scrapy_idempotent.store.sqlite import _MIGRATIONS, APPLICATION_ID

#: How long a lease of the ``make_store`` stores lasts (unless a test gives its own).
LEASE_SECONDS = 60.0
#: The outbox target ``page`` and ``fetch_page`` commit for, unless given others.
HOOK = "https://hooks.example/records"


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
    entry = store.entry(key)
    assert entry is not None, key
    return (entry.state, entry.worker, entry.attempts)


def entries(store: Any) -> list[FrontierEntry]:
    """Every frontier entry, in key order (paged as a caller of ``entries`` pages)."""
    found: list[FrontierEntry] = []
    while page := store.entries(after=found[-1].key if found else None, limit=3):
        found += page
    return found


def records(store: Any) -> list[StoredRecord]:
    return list(store.records_page(limit=10_000))


def journal(store: Any, key: str, data: str, body: bytes, worker: str = "w1") -> None:
    """Journal a response as the scheduler does: in a unit of work."""
    store.commit(UnitOfWork(responses=[(key, data, body)]), worker)


def counts(**nonzero: int) -> dict[str, int]:
    base = {"pending": 0, "leased": 0, "done": 0, "failed": 0, "redirected": 0, "records": 0}
    base.update(nonzero)
    return base


def frontier_keys(store: Any) -> list[str]:
    return [entry.key for entry in entries(store)]




def page(store: Any, key: str, *records: Any, targets: tuple[str, ...] = (HOOK,),
         worker: str = "w1") -> Any:
    """Commit the completion of leased request ``key`` with ``records``."""
    return store.commit(UnitOfWork(records=[(r, key) for r in records],
                                   completions=[Completion(key, RequestState.DONE)],
                                   outbox_targets=targets), worker)


def fetch_page(store: Any, key: str, *records: Any, **options: Any) -> Any:
    enqueue(store, req(key))
    claim(store, 1)
    return page(store, key, *records, **options)


def sqlite_at_version(path: Path, version: int, *statements: str) -> None:
    """A database file as a release of schema ``version`` wrote it, with ``statements``
    run on it."""
    conn = sqlite3.connect(path)
    for step in _MIGRATIONS[:version]:
        for statement in step:
            conn.execute(statement)
    for statement in statements:
        conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.commit()
    conn.close()


def count_reads(store: Any, monkeypatch: Any) -> list[str]:
    """The statements ``store`` reads for a crawl (``_crawl_select``) from now on, as they
    are made."""
    reads: list[str] = []
    select = store._crawl_select

    def counted(sql: str, params: Any = ()) -> Any:
        reads.append(sql)
        return select(sql, params)

    monkeypatch.setattr(store, "_crawl_select", counted)
    return reads
