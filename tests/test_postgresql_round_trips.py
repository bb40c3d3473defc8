"""A page commit on PostgreSQL waits for the server only where the store needs an answer:
the statements go out in psycopg's pipeline mode. Counted in libpq's protocol trace of the
store's connection: each wait is a Sync or a Flush the client sends (or a simple Query),
whatever the machine's speed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

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
from scrapy_idempotent.store.postgresql import PostgreSQLStore  # noqa: E402

if psycopg.pq.version() < 140000:  # the trace format read below is libpq 14's
    pytest.skip(f"libpq {psycopg.pq.version()} writes another trace format: psycopg[binary] "
                "brings a newer one", allow_module_level=True)


def new(n: int) -> NewRequest:
    key = hashlib.sha1(str(n).encode()).hexdigest()
    return NewRequest(key=key, fingerprint=key, url=f"https://shop.example/{n}", priority=0,
                      data="{}")


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgreSQLStore]:
    store = PostgreSQLStore(postgres_url, heartbeat_seconds=None)
    try:
        store.open(fingerprinter="f", identity=CrawlIdentity("p", "shop", "shop"))
        store.begin_session("w", "auto")
        store.commit(UnitOfWork(requests=[new(n) for n in range(20)]), "w")
        yield store
    finally:
        store.close()


def waits(store: PostgreSQLStore, work: UnitOfWork, trace: Path) -> int:
    """The times the client waits for the server while committing ``work``."""
    conn = store.conn
    with trace.open("w") as out:
        conn.pgconn.trace(out.fileno())
        try:
            store.commit(work, "w")
        finally:
            conn.pgconn.untrace()
    sent = [line.split("\t")[3] for line in trace.read_text().splitlines()
            if line.split("\t")[1:2] == ["F"]]
    # a Flush right after a Sync is the same wait
    return sum(1 for n, kind in enumerate(sent)
               if kind in ("Sync", "Query") or (kind == "Flush" and sent[n - 1] != "Sync"))


def test_a_page_commit_waits_three_times(store: PostgreSQLStore, tmp_path: Path) -> None:
    leased = store.commit(UnitOfWork(claim=2), "w").leased
    store.commit(UnitOfWork(started=[lease.key for lease in leased]), "w")
    # what the scheduler commits per page: the completion, the page's links, the next claim
    page = UnitOfWork(completions=[Completion(leased[0].key, RequestState.DONE)],
                      requests=[new(100 + n) for n in range(8)], claim=1)
    # the fence and the known entries; every write and the claim; COMMIT
    assert waits(store, page, tmp_path / "trace") == 3
    # fencing still comes first: a completion of a lease not held writes nothing
    lost = store.commit(UnitOfWork(completions=[Completion(leased[0].key, RequestState.DONE)],
                                   requests=[new(200)], claim=0), "w")
    assert lost.leases_lost == 1 and lost.requests_added == 1  # a root request: not fenced
    assert store.entry(new(100).key) is not None


def test_records_add_their_own_waits_only(store: PostgreSQLStore, tmp_path: Path) -> None:
    leased = store.commit(UnitOfWork(claim=1), "w").leased
    store.commit(UnitOfWork(started=[leased[0].key]), "w")
    record = Record(record_id="r1", source="shop", natural_key='["r1"]', item_type="dict",
                    data="{}", content_hash="h")
    page = UnitOfWork(completions=[Completion(leased[0].key, RequestState.DONE)],
                      records=[(record, leased[0].key)], claim=1)
    # + the records' newest time, numbers of first sight and locks (one), + the new record's
    # insert (one)
    assert waits(store, page, tmp_path / "trace") == 3 + 2


def test_new_records_are_inserted_with_one_wait_however_many(store: PostgreSQLStore,
                                                             tmp_path: Path) -> None:
    leased = store.commit(UnitOfWork(claim=2), "w").leased
    store.commit(UnitOfWork(started=[lease.key for lease in leased]), "w")
    records = [(Record(record_id=f"r{n}", source="shop", natural_key=f'["r{n}"]',
                       item_type="dict", data="{}", content_hash="h"), leased[n % 2].key)
               for n in range(4)]
    page = UnitOfWork(completions=[Completion(lease.key, RequestState.DONE) for lease in leased],
                      records=records, claim=1)
    # two completions and four new records: as many waits as one of each
    assert waits(store, page, tmp_path / "trace") == 3 + 2
    assert sorted(r.record_id for r in store.records_page()) == ["r0", "r1", "r2", "r3"]
