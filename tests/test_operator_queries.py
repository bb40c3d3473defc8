"""The store's operator queries (the ``# -- operator queries --`` section of ``FrontierStore``),
without Scrapy: filters, the retry transaction, read-only opening, record paging. Part of the
store contract: every test runs against each store backend (``store_factory``) and reads
through the interface only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import T0, FakeClock

from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import (
    Completion,
    FrontierStore,
    NewRequest,
    Record,
    RequestState,
    UnitOfWork,
)
from scrapy_idempotent.store.base import (
    FailedRequest,
    IntegrityReport,
    RetriedFailed,
    SchemaInfo,
    url_glob_matches,
)

WORKER = "host:1:1"
FAILURES = {  # url -> error kind
    "http://shop/product/1": "http_status",
    "http://shop/product/2": "download_error/DownloadTimeoutError",
    "http://shop/product/3": "download_error/CannotResolveHostError",
    "http://shop/list/1": "spider_error/ValueError",
    "http://shop/product/4": "download_errors_of_another_kind",
}


@pytest.fixture
def crawled(store_factory: Callable[..., FrontierStore],
            clock: FakeClock) -> Callable[[], FrontierStore]:
    """``crawled()``: a store with a finished run (every URL of FAILURES failed with its kind,
    one more done)."""

    def make() -> FrontierStore:
        store = store_factory()
        _crawl(store, clock)
        return store

    return make


def _crawl(store: FrontierStore, clock: FakeClock) -> None:
    store.open(fingerprinter="")
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


def test_failed_filters_by_kind_prefix_glob_and_regex(
    crawled: Callable[[], FrontierStore],
) -> None:
    store = crawled()

    def urls(**filters: Any) -> set[str]:
        rows = store.failed_requests(**filters)
        assert store.count_failed(**filters) == len(rows)
        return {r.url for r in rows}

    assert urls() == set(FAILURES)
    assert urls(kinds=["download_error"]) == {"http://shop/product/2", "http://shop/product/3"}
    assert urls(kinds=["download_error/DownloadTimeoutError", "http_status"]) == {
        "http://shop/product/1", "http://shop/product/2"}
    assert urls(kinds=["spider"]) == set()  # a prefix ends at a '/'
    assert urls(url_glob="*/product/[13]") == {"http://shop/product/1", "http://shop/product/3"}
    assert urls(url_glob="product") == set()  # a glob matches the whole URL
    assert urls(url_glob="*/product/[!13]") == {"http://shop/product/2",
                                                "http://shop/product/4"}
    assert urls(url_glob="*/PRODUCT/*") == set()  # case-sensitive
    assert urls(url_glob="http://shop/?ist/*") == {"http://shop/list/1"}
    assert urls(url_regex=r"list|product/4$") == {"http://shop/list/1", "http://shop/product/4"}
    assert urls(kinds=["download_error"], url_regex="2") == {"http://shop/product/2"}
    assert len(store.failed_requests(limit=2)) == 2
    assert store.failure_counts()["http_status"] == 1
    assert store.failed_requests(url_glob="*/1", kinds=["http_status"]) == [FailedRequest(
        key="http://shop/product/1", url="http://shop/product/1", error_kind="http_status",
        error_message="http_status at http://shop/product/1", attempts=1, finished_at=T0 + 1,
        parent_key=None, run_id=1)]


@pytest.mark.parametrize(("glob", "url", "matches"), [
    ("*/product/*", "http://shop/product/1?x=1", True),
    ("*/product/?", "http://shop/product/12", False),
    ("*/p[a-c]ge", "http://shop/page", True),
    ("*/p[!a-c]ge", "http://shop/page", False),
    ("*/p[^a]ge", "http://shop/page", True),  # ^ is itself, not a negation
    ("*/p[^a]ge", "http://shop/p^ge", True),
    ("*x]", "http://shop/x]", True),
    ("*[*", "http://shop/[", True),  # an unclosed [ is itself
    ("http://shop/*", "HTTP://SHOP/a", False),
])
def test_the_url_glob_is_the_interfaces_not_the_databases(
    store_factory: Callable[..., FrontierStore], glob: str, url: str, matches: bool,
) -> None:
    """The documented glob (``url_glob_matches``) is what every backend applies, whatever
    its own pattern language does with ``[^...]`` or an unclosed ``[``."""
    assert url_glob_matches(glob, url) is matches
    store = store_factory()
    store.open(fingerprinter="")
    store.begin_session(WORKER, "auto")
    store.commit(UnitOfWork(requests=[NewRequest(key=url, fingerprint=url, url=url,
                                                 priority=0, data="{}")]), WORKER)
    assert [r.key for r in store.commit(UnitOfWork(claim=1), WORKER).leased] == [url]
    store.commit(UnitOfWork(started=[url]), WORKER)
    store.commit(UnitOfWork(completions=[Completion(url, RequestState.FAILED, "k", "m")]),
                 WORKER)
    assert [r.url for r in store.failed_requests(url_glob=glob)] == ([url] if matches else [])
    assert store.count_failed(url_glob=glob) == int(matches)


def test_retry_resets_the_entries_and_reopens_the_finished_run(
    crawled: Callable[[], FrontierStore],
) -> None:
    store = crawled()
    assert store.runs()[-1].finished_at is not None
    assert store.retry_failed(kinds=["nothing"]) == RetriedFailed(retried=0, run_id=1,
                                                                  reopened=False)
    assert store.runs()[-1].finished_at is not None  # nothing put back: still finished

    assert store.retry_failed(kinds=["download_error"]) == RetriedFailed(retried=2, run_id=1,
                                                                         reopened=True)
    run = store.runs()[-1]
    assert (run.finished_at, run.reason) == (None, None)
    entries = [store.entry(f"http://shop/product/{n}") for n in (2, 3)]
    assert [(e.state, e.worker, e.leased_until, e.attempts, e.finished_at, e.error_kind,
             e.error_message) for e in entries if e is not None] == [
        ("pending", None, None, 0, None, None, None)] * 2
    assert store.counts()["failed"] == 3
    assert store.anomalies() == dict.fromkeys(store.anomalies(), 0)
    # the next session of run mode auto resumes the reopened run and leases them
    info = store.begin_session("host:2:2", "auto")
    assert (info.run_id, info.new, info.counts["pending"]) == (1, False, 2)
    assert len(store.commit(UnitOfWork(claim=8), "host:2:2").leased) == 2


def test_open_existing_neither_creates_nor_writes(
    store_factory: Callable[..., FrontierStore], crawled: Callable[[], FrontierStore],
) -> None:
    for _ in range(2):  # no crawl made a database there, and opening it made none
        with pytest.raises(StoreError):
            store_factory().open_existing()

    crawled().close()
    store = store_factory()
    info = store.open_existing()
    assert isinstance(info, SchemaInfo) and info.current and info.version >= 1
    assert store.meta()["fingerprinter"] == ""
    assert store.integrity_check() == IntegrityReport(method=store.integrity_check().method)
    assert store.integrity_check().ok
    assert all(setting.ok for setting in store.engine_settings())
    with pytest.raises(StoreError, match="read-only"):
        store.retry_failed()


def test_records_are_paged_by_record_id_and_filtered_by_change(
    store_factory: Callable[..., FrontierStore], clock: FakeClock,
) -> None:
    store = store_factory()
    store.open(fingerprinter="")
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
            found += [r.record_id for r in page]
            if len(page) < 3:
                return found
            after = page[-1].record_id

    assert ids() == [f"r{i:02d}" for i in range(10)]
    assert ids(changed_since_run=2) == ["r04", "r05", "r06", "r07", "r08", "r09"]
    assert ids(changed_since=T0 + 200) == ids(changed_since_run=2)
    assert ids(changed_since=T0 + 201) == []
    (record,) = store.records_page(after="r03", limit=1)
    assert (record.first_seen, record.last_changed, record.first_run_id,
            record.changed_run_id) == (T0 + 100, T0 + 200, 1, 2)
    assert [(r.run_id, r.records_inserted, r.records_updated,
             r.records_unchanged) for r in store.runs()] == [(1, 5, 0, 0), (2, 5, 1, 4)]
