"""The store's operator queries (the ``# -- operator queries --`` section of ``FrontierStore``),
without Scrapy: filters, the retry transaction, read-only opening, record paging."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import (
    Completion,
    NewRequest,
    Record,
    RequestState,
    SQLiteStore,
    UnitOfWork,
)
from scrapy_idempotent.store.sqlite import SCHEMA_VERSION

T0 = 1_700_000_000.0
WORKER = "host:1:1"
FAILURES = {  # url -> error kind
    "http://shop/product/1": "http_status",
    "http://shop/product/2": "download_error/DownloadTimeoutError",
    "http://shop/product/3": "download_error/CannotResolveHostError",
    "http://shop/list/1": "spider_error/ValueError",
    "http://shop/product/4": "download_errors_of_another_kind",
}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def crawled() -> Iterator[Callable[[Path, Clock], SQLiteStore]]:
    """``crawled(path, clock)``: a store with a finished run (every URL of FAILURES failed
    with its kind, one more done). Every store made is closed at the end of the test, also
    when it fails (an unclosed connection is a ResourceWarning on Python 3.13)."""
    made: list[SQLiteStore] = []

    def make(path: Path, clock: Clock) -> SQLiteStore:
        store = _crawled(path, clock)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def _crawled(path: Path, clock: Clock) -> SQLiteStore:
    store = SQLiteStore(str(path), clock=clock)
    store.open()
    store.begin_session(WORKER, "auto")
    urls = [*FAILURES, "http://shop/ok"]
    store.commit(UnitOfWork(requests=[NewRequest(key=u, fingerprint=u, url=u, priority=0,
                                                 data="{}") for u in urls]), WORKER)
    leased = store.commit(UnitOfWork(claim=len(urls)), WORKER).leased
    assert len(leased) == len(urls)
    store.commit(UnitOfWork(started=[r.key for r in leased]), WORKER)  # handed out
    clock.now += 1
    store.commit(UnitOfWork(completions=[
        Completion(u, RequestState.FAILED, kind, f"{kind} at {u}")
        for u, kind in FAILURES.items()] + [Completion("http://shop/ok", RequestState.DONE)]),
        WORKER)
    store.end_session(WORKER, "finished")
    return store


def test_failed_filters_by_kind_prefix_glob_and_regex(
    tmp_path: Path, crawled: Callable[[Path, Clock], SQLiteStore]
) -> None:
    store = crawled(tmp_path / "db.sqlite3", Clock())

    def urls(**filters: object) -> set[str]:
        rows = store.failed_requests(**filters)  # type: ignore[arg-type]
        assert store.count_failed(**filters) == len(rows)  # type: ignore[arg-type]
        return {str(r["url"]) for r in rows}

    assert urls() == set(FAILURES)
    assert urls(kinds=["download_error"]) == {"http://shop/product/2", "http://shop/product/3"}
    assert urls(kinds=["download_error/DownloadTimeoutError", "http_status"]) == {
        "http://shop/product/1", "http://shop/product/2"}
    assert urls(kinds=["spider"]) == set()  # a prefix ends at a '/'
    assert urls(url_glob="*/product/[13]") == {"http://shop/product/1", "http://shop/product/3"}
    assert urls(url_glob="product") == set()  # a glob matches the whole URL
    assert urls(url_regex=r"list|product/4$") == {"http://shop/list/1", "http://shop/product/4"}
    assert urls(kinds=["download_error"], url_regex="2") == {"http://shop/product/2"}
    assert len(store.failed_requests(limit=2)) == 2
    assert store.failure_counts()["http_status"] == 1
    row = store.failed_requests(url_glob="*/1", kinds=["http_status"])[0]
    assert row["error_message"] == "http_status at http://shop/product/1"
    assert row["attempts"] == 1 and row["finished_at"] == T0 + 1


def test_retry_resets_the_entries_and_reopens_the_finished_run(
    tmp_path: Path, crawled: Callable[[Path, Clock], SQLiteStore]
) -> None:
    clock = Clock()
    store = crawled(tmp_path / "db.sqlite3", clock)
    assert store.runs()[-1]["finished_at"] is not None
    assert store.retry_failed(kinds=["nothing"]) == {"retried": 0, "run_id": 1,
                                                     "reopened": False}
    assert store.runs()[-1]["finished_at"] is not None  # nothing put back: still finished

    assert store.retry_failed(kinds=["download_error"]) == {"retried": 2, "run_id": 1,
                                                            "reopened": True}
    run = store.runs()[-1]
    assert (run["finished_at"], run["reason"]) == (None, None)
    rows = store.query("SELECT state, worker, leased_until, attempts, finished_at, error_kind,"
                       " error_message FROM requests WHERE url LIKE '%product/2'"
                       " OR url LIKE '%product/3'")
    assert rows == [("pending", None, None, 0, None, None, None)] * 2
    assert store.counts()["failed"] == 3
    assert store.anomalies() == dict.fromkeys(store.anomalies(), 0)
    # the next session of run mode auto resumes the reopened run and leases them
    info = store.begin_session("host:2:2", "auto")
    assert (info.run_id, info.new, info.counts["pending"]) == (1, False, 2)
    assert len(store.commit(UnitOfWork(claim=8), "host:2:2").leased) == 2
    store.close()


def test_open_existing_neither_creates_nor_writes(
    tmp_path: Path, crawled: Callable[[Path, Clock], SQLiteStore]
) -> None:
    missing = tmp_path / "missing.sqlite3"
    with pytest.raises(StoreError, match="no frontier database at"):
        SQLiteStore(str(missing)).open_existing()
    assert not missing.exists()

    path = tmp_path / "db.sqlite3"
    crawled(path, Clock()).close()
    store = SQLiteStore(str(path))
    assert store.open_existing() == {"schema_version": SCHEMA_VERSION,
                                     "supported_schema_version": SCHEMA_VERSION,
                                     "journal_mode": "wal"}
    assert store.meta()["fingerprinter"] == ""
    with pytest.raises(StoreError, match="read-only"):
        store.retry_failed()
    store.close()

    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match="is not a scrapy_idempotent database, or is damaged"):
        SQLiteStore(str(path)).open_existing()


def test_records_are_paged_by_record_id_and_filtered_by_change(tmp_path: Path) -> None:
    clock = Clock()
    store = SQLiteStore(str(tmp_path / "db.sqlite3"), clock=clock)
    store.open()
    for run in (1, 2):
        store.begin_session(WORKER, "fresh")
        clock.now = T0 + 100 * run
        ids = range(run * 5)  # run 1 inserts 0-4; run 2 inserts 5-9, changes 4
        store.commit(UnitOfWork(records=[
            (Record(record_id=f"r{i:02d}", source="s", natural_key=f'["{i}"]', item_type="T",
                    data=f'{{"n": {i}}}',
                    content_hash="changed" if (run == 2 and i == 4) else f"h{i}"), None)
            for i in ids]), WORKER)
        store.end_session(WORKER, "finished")

    def ids(**filters: object) -> list[str]:
        found, after = [], None
        while True:
            page = store.records_page(after=after, limit=3, **filters)  # type: ignore[arg-type]
            found += [str(r["record_id"]) for r in page]
            if len(page) < 3:
                return found
            after = str(page[-1]["record_id"])

    assert ids() == [f"r{i:02d}" for i in range(10)]
    assert ids(changed_since_run=2) == ["r04", "r05", "r06", "r07", "r08", "r09"]
    assert ids(changed_since=T0 + 200) == ids(changed_since_run=2)
    assert ids(changed_since=T0 + 201) == []
    (record,) = store.records_page(after="r03", limit=1)
    assert (record["first_seen"], record["last_changed"], record["first_run_id"],
            record["changed_run_id"]) == (T0 + 100, T0 + 200, 1, 2)
    assert [(r["run_id"], r["records_inserted"], r["records_updated"],
             r["records_unchanged"]) for r in store.runs()] == [(1, 5, 0, 0), (2, 5, 1, 4)]
    store.close()
