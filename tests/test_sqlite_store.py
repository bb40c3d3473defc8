"""The SQLite store's own file: schema version, migration, refusal of files it cannot use,
permissions, WAL mode. What every backend must do is in ``test_store_contract.py``."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from crawling import db_rows
from helpers.stores import count_reads
from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import SCHEMA_VERSION, NewRequest, RunInfo, SQLiteStore, UnitOfWork
from scrapy_idempotent.store.base import EngineSetting, IntegrityReport, SchemaInfo


def test_sqlite_reopening_an_existing_file(tmp_path, clock):
    path = str(tmp_path / "f.sqlite3")
    first = SQLiteStore(path, clock=clock)
    assert first.open(fingerprinter="x") is None
    first.begin_session("w1", "auto")
    first.commit(UnitOfWork(requests=[NewRequest(key="a", fingerprint="a", url="https://a",
                                                 priority=0, data="{}")]), "w1")
    first.close()
    second = SQLiteStore(path, clock=clock)
    try:
        assert second.open(fingerprinter="x") is None
        assert second.begin_session("w2", "auto") == RunInfo(
            run_id=1, new=False, counts={"pending": 1, "leased": 0, "done": 0, "failed": 0,
                                         "redirected": 0, "records": 0})
        assert db_rows(Path(path), "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    finally:
        second.close()


@pytest.mark.parametrize("page_size", [4096, 8192])
def test_sqlite_new_file_gets_the_page_size_and_keeps_its_own(tmp_path, monkeypatch,
                                                               page_size):
    """A new file gets ``NEW_PAGE_SIZE`` (set before auto_vacuum, which would fix it) with
    incremental auto-vacuum; an existing file keeps the page size it was made with."""
    from scrapy_idempotent.store import sqlite as sqlite_store

    path = tmp_path / "f.sqlite3"
    monkeypatch.setattr(sqlite_store, "NEW_PAGE_SIZE", page_size)
    store = SQLiteStore(str(path))
    store.open(fingerprinter="x")
    store.close()
    assert db_rows(path, "PRAGMA page_size") == [(page_size,)]
    assert db_rows(path, "PRAGMA auto_vacuum") == [(2,)]
    monkeypatch.setattr(sqlite_store, "NEW_PAGE_SIZE", 16384)
    store = SQLiteStore(str(path))
    store.open(fingerprinter="x")
    store.close()
    assert db_rows(path, "PRAGMA page_size") == [(page_size,)]


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


def test_sqlite_dangling_symlink_creates_its_target_private_to_its_owner(tmp_path):
    (tmp_path / "volume").mkdir()
    target = tmp_path / "volume" / "f.sqlite3"
    link = tmp_path / "f.sqlite3"
    link.symlink_to(target)  # dangling: the target does not exist yet
    store = SQLiteStore(str(link))
    try:
        store.open(fingerprinter="x")
        store.begin_session("w1", "auto")
        assert link.is_symlink() and target.is_file()
        made = [p for p in (tmp_path, tmp_path / "volume") for p in p.iterdir()
                if p.is_file() and not p.is_symlink()]
        assert {p.name for p in made} >= {"f.sqlite3", "f.sqlite3-wal", "f.sqlite3-shm"}
        for path in made:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
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
        assert [(s.name, s.value, s.ok) for s in store.engine_settings()] == [
            ("journal_mode", "wal", True)]
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
    from scrapy_idempotent.store.sqlite import _MIGRATIONS

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
        assert db_rows(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
        assert [row.record_id for row in store.run_records(2)] == ["r1"]
        assert list(store.run_records(1)) == []
        assert store.request_summary().downloads == 0
    finally:
        store.close()


def test_sqlite_open_existing_refuses_a_missing_or_foreign_file_and_creates_none(tmp_path):
    missing = tmp_path / "missing.sqlite3"
    with pytest.raises(StoreError, match="no frontier database at"):
        SQLiteStore(str(missing)).open_existing()
    assert not missing.exists()

    path = tmp_path / "db.sqlite3"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreError, match="is not a scrapy_idempotent database, or is damaged"):
        SQLiteStore(str(path)).open_existing()
    assert path.read_bytes() == b"not a database" * 100


def test_sqlite_check_results_are_typed(tmp_path):
    path = tmp_path / "db.sqlite3"
    store = SQLiteStore(str(path))
    store.open()
    store.close()
    store = SQLiteStore(str(path))
    try:
        assert store.open_existing() == SchemaInfo(version=SCHEMA_VERSION,
                                                   supported=SCHEMA_VERSION)
        assert store.integrity_check() == IntegrityReport(method="PRAGMA integrity_check")
        assert store.engine_settings() == [EngineSetting(
            name="journal_mode", label="journal mode", value="wal", expected="wal")]
    finally:
        store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = DELETE")
    conn.close()
    store = SQLiteStore(str(path))
    try:
        store.open_existing()
        (setting,) = store.engine_settings()
        assert (setting.value, setting.ok) == ("delete", False)
    finally:
        store.close()


def test_sqlite_known_fingerprints_are_answered_from_memory(tmp_path, clock, monkeypatch):
    # rediscovered links (most of a crawl's links) are answered without a read: to a done
    # page for good, to a pending one added or read by this worker for KNOWN_PENDING_SECONDS
    # or until this worker finishes it
    from scrapy_idempotent.store import Completion, RequestState
    from scrapy_idempotent.store.sql_known import KNOWN_PENDING_SECONDS

    path = str(tmp_path / "f.sqlite3")
    store, other = SQLiteStore(path, clock=clock), SQLiteStore(path, clock=clock)
    store.open(fingerprinter="x")
    other.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    other.begin_session("w2", "auto")
    try:
        new = [NewRequest(key=k, fingerprint=k, url=f"https://a/{k}", priority=0, data="{}")
               for k in ("a", "b", "c")]
        store.commit(UnitOfWork(requests=new), "w1")
        reads = count_reads(store, monkeypatch)
        # added by this worker: pending, no read
        assert [store.known_request(k) for k in "abc"] == ["duplicate"] * 3
        assert reads == []
        # finished by this worker: done at once, no read
        leased = store.commit(UnitOfWork(claim=1), "w1").leased[0].key
        store.commit(UnitOfWork(started=[leased]), "w1")
        store.commit(UnitOfWork(completions=[Completion(leased, RequestState.DONE)]), "w1")
        assert [store.known_request(leased) for _ in range(3)] == ["already_done"] * 3
        assert reads == []
        # finished by another worker: seen once the memory's time is up
        taken = other.commit(UnitOfWork(claim=1), "w2").leased[0].key
        other.commit(UnitOfWork(started=[taken]), "w2")
        other.commit(UnitOfWork(completions=[Completion(taken, RequestState.DONE)]), "w2")
        assert store.known_request(taken) == "duplicate"
        clock.advance(KNOWN_PENDING_SECONDS)
        assert store.known_request(taken) == "already_done"
        assert len(reads) == 1
        assert store.known_request(taken) == "already_done"
        # a pending one read again once its time is up, then remembered again
        (left,) = {"a", "b", "c"} - {leased, taken}
        assert [store.known_request(left) for _ in range(3)] == ["duplicate"] * 3
        assert len(reads) == 2
    finally:
        store.close()
        other.close()


def test_a_streamed_feed_is_written_by_one_worker_at_a_time(tmp_path, clock):
    """The feed's claim: another worker's write is refused (nothing written, the mark kept)
    while the holder's claim lasts; once it expired the other takes the feed over from the
    durable mark, and the old holder's later write is refused in turn."""
    from scrapy_idempotent.store import FeedMark

    path = str(tmp_path / "f.sqlite3")
    a, b = SQLiteStore(path, clock=clock), SQLiteStore(path, clock=clock)
    a.open(fingerprinter="x")
    b.open(fingerprinter="x")
    run = a.begin_session("w1", "auto").run_id
    b.begin_session("w2", "auto")
    writes: list[str] = []

    def writer(name):
        def write(mark, fetch):
            writes.append(name)
            return FeedMark(seq=mark.seq + 1, offset=mark.offset + 10, batch_id=1,
                            items=mark.items + 1, first_seq=1, total=mark.total + 1,
                            base=mark.base)
        return write

    def stream(store, worker, *, release=False):
        return store.stream_feed(run, "stream out.jsonl", worker, lease_seconds=30,
                                 base=lambda: 5, holder_gone=lambda holder: False,
                                 write=writer(worker), release=release)

    try:
        assert stream(a, "w1") == FeedMark(1, 15, 1, 1, 1, 1, 5)  # from the base: 5 bytes
        assert stream(b, "w2") is None  # w1 holds it
        clock.advance(20)
        assert stream(a, "w1").seq == 2  # renewed by its write
        clock.advance(20)
        assert stream(b, "w2") is None  # 20 s after w1's last write: still w1's
        clock.advance(11)
        assert stream(b, "w2") == FeedMark(3, 35, 1, 3, 1, 3, 5)  # taken over at the mark
        assert stream(a, "w1") is None  # the late holder writes nothing
        assert stream(b, "w2", release=True).seq == 4  # a closing worker gives it up
        assert stream(a, "w1").seq == 5
        assert writes == ["w1", "w1", "w2", "w2", "w1"]
    finally:
        a.close()
        b.close()


def _leased(store: SQLiteStore, *, requests: int, claimed: int) -> list[str]:
    """``requests`` requests committed by worker w1, then the keys of the ``claimed`` it
    leases."""
    store.commit(UnitOfWork(requests=[
        NewRequest(key=f"k{i}", fingerprint=f"k{i}", url=f"https://a/{i}", priority=0,
                   data="{}") for i in range(requests)]), "w1")
    return [lease.key for lease in store.commit(UnitOfWork(claim=claimed), "w1").leased]


@contextlib.contextmanager
def _worker_store(path: Path, clock: Any) -> Iterator[SQLiteStore]:
    """A store at ``path`` with worker w1's session begun; closed after."""
    store = SQLiteStore(str(path), clock=clock)
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    try:
        yield store
    finally:
        store.close()


def _traced(store: SQLiteStore, *calls: Callable[[], object]) -> list[str]:
    """The SQL statements ``calls`` make on ``store``'s connection."""
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    try:
        for call in calls:
            call()
    finally:
        store.conn.set_trace_callback(None)
    return statements


def test_sqlite_a_finishing_session_reads_no_request_it_does_not_need(tmp_path, clock):
    # the last session's close asks whether any request is pending or leased before it marks
    # the run finished: each state's partial index answers; a read of the table went through
    # every done request (most of a second at two million)
    from scrapy_idempotent.store import Completion, RequestState

    with _worker_store(tmp_path / "f.sqlite3", clock) as store:
        leased = _leased(store, requests=50, claimed=50)
        store.commit(UnitOfWork(completions=[Completion(k, RequestState.DONE)
                                             for k in leased]), "w1")
        statements = _traced(store, lambda: store.end_session("w1", "finished"))
        assert store.runs()[-1].finished_at is not None
        reads = [s for s in statements if s.lstrip().startswith("SELECT")
                 and "FROM requests" in s]
        assert reads
        for statement in reads:
            plan = [str(row[3]) for row in store.conn.execute(
                f"EXPLAIN QUERY PLAN {statement}")]
            assert "SCAN requests" not in plan, (statement, plan)


def test_sqlite_a_units_statements_on_its_keys_find_their_rows_by_key(tmp_path, clock):
    # a worker holds many leases (claimed ahead, downloading): a page commit's statements on
    # its own keys (the fence, the counters of started, replayed and downloaded requests, a
    # give-back) look each key up, and never read every row the worker leases
    from scrapy_idempotent.store import Completion, RequestState

    with _worker_store(tmp_path / "f.sqlite3", clock) as store:
        leased = _leased(store, requests=200, claimed=100)
        statements = _traced(
            store,
            lambda: store.commit(UnitOfWork(started=leased[:3], downloaded=leased[:2],
                                            replayed=leased[2:3], give_back=leased[3:4],
                                            responses=[(leased[0], "{}", b"body")]), "w1"),
            lambda: store.commit(UnitOfWork(
                completions=[Completion(leased[0], RequestState.DONE)],
                requests=[NewRequest(key="child", fingerprint="child", url="https://a/child",
                                     priority=0, data="{}", parent_key=leased[0])]), "w1"))
        on_keys = [s for s in statements if "json_each" in s and "worker" in s
                   and ("FROM requests" in s or s.startswith("UPDATE requests"))]
        assert len(on_keys) >= 5
        for statement in on_keys:
            plan = " ".join(str(row[3]) for row in store.conn.execute(
                f"EXPLAIN QUERY PLAN {statement}"))
            assert "requests_leased" not in plan, (statement, plan)
            assert "USING INDEX sqlite_autoindex_requests_1 (key=?)" in plan, (statement, plan)


def test_a_page_started_and_downloaded_in_one_unit_is_written_once(tmp_path, clock):
    # its counters in one statement, not one a counter (each was a new version of the row
    # on PostgreSQL, and a round trip)
    with _worker_store(tmp_path / "f.sqlite3", clock) as store:
        leased = _leased(store, requests=3, claimed=3)
        statements = _traced(store, lambda: store.commit(
            UnitOfWork(started=leased, downloaded=leased), "w1"))
        updates = [s for s in statements if s.lstrip().startswith("UPDATE requests")]
        assert len(updates) == 1, updates
