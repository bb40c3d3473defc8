"""Store errors name their real cause, with real files: a full disk, a read-only file, a
database that is not ours, a deleted write-ahead log, a lock held by another process. Only
the last one is :class:`~scrapy_idempotent.exceptions.StoreBusy`, the error worth retrying.
Also: whose database it is (the crawl identity recorded at creation)."""

from __future__ import annotations

import base64
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from crawling import fill_up, small_file_system
from scrapy_idempotent.exceptions import StoreBusy, StoreError
from scrapy_idempotent.store import CrawlIdentity, NewRequest, SQLiteStore, UnitOfWork
from scrapy_idempotent.store.sqlite import APPLICATION_ID

SHOP = CrawlIdentity(project="shop", spider="shop", source="shop")


def opened(path: Path, identity: CrawlIdentity | None = SHOP, **options: object) -> SQLiteStore:
    store = SQLiteStore(str(path), **options)  # type: ignore[arg-type]
    store.open(fingerprinter="x", identity=identity)
    store.begin_session("w1", "auto")
    return store


def new_request(key: str, size: int = 10) -> NewRequest:
    """A request of ``size`` characters of data, random: packing makes it no smaller (its
    row is about as large as the data given)."""
    data = base64.b85encode(os.urandom(size)).decode()[:size]
    return NewRequest(key=key, fingerprint=key, url=f"https://shop.example/{key}", priority=0,
                      data=data)


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``chattr +i``: not even root may write it (permission bits do not stop root)."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_full_disk_is_named_and_not_busy(tmp_path: Path) -> None:
    store = opened(tmp_path / "db.sqlite3")
    store.conn.execute("PRAGMA max_page_count = 40")  # the disk fills up
    with pytest.raises(StoreError) as caught:
        store.commit(UnitOfWork(requests=[new_request(f"k{i}", 4000) for i in range(100)]),
                     "w1")
    assert not isinstance(caught.value, StoreBusy)
    assert "full" in str(caught.value)
    assert "locked" not in str(caught.value)
    store.close()


def test_read_only_file_is_named_at_open(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    opened(path).close()
    with immutable(path):
        store = SQLiteStore(str(path))
        with pytest.raises(StoreError) as caught:
            store.open(fingerprinter="x", identity=SHOP)
    assert not isinstance(caught.value, StoreBusy)
    assert "read-only" in str(caught.value) and str(path) in str(caught.value)
    assert "IDEMPOTENT_DATABASE" in str(caught.value)


def test_read_only_directory_for_a_new_database_is_named(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    with immutable(directory), pytest.raises(StoreError) as caught:
        SQLiteStore(str(directory / "db.sqlite3")).open(fingerprinter="x")
    assert "read-only" in str(caught.value) or "not writable" in str(caught.value)
    assert "IDEMPOTENT_DATABASE" in str(caught.value)


def test_a_schema_changed_by_hand_is_named_and_not_busy(tmp_path: Path) -> None:
    store = opened(tmp_path / "db.sqlite3")
    other = sqlite3.connect(tmp_path / "db.sqlite3")
    other.execute("DROP TABLE records")
    other.commit()
    other.close()
    from scrapy_idempotent.store import Record

    record = Record(record_id="r", source="shop", natural_key='["a"]', item_type="dict",
                    data="{}", content_hash="h")
    with pytest.raises(StoreError) as caught:
        store.commit(UnitOfWork(records=[(record, None)]), "w1")
    assert not isinstance(caught.value, StoreBusy)
    assert "schema" in str(caught.value)
    store.close()


def test_a_deleted_write_ahead_log_stops_the_writes(tmp_path: Path) -> None:
    """SQLite goes on writing into a -wal file deleted under it, and everything written so is
    gone when the process ends: the store notices and refuses to write."""
    path = tmp_path / "db.sqlite3"
    store = opened(path)
    store.commit(UnitOfWork(requests=[new_request("a")]), "w1")
    os.unlink(f"{path}-wal")
    with pytest.raises(StoreError) as caught:
        store.commit(UnitOfWork(requests=[new_request("b")]), "w1")
    assert not isinstance(caught.value, StoreBusy)
    assert "-wal was deleted" in str(caught.value)
    store.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_file_deleted_or_replaced_stops_the_writes(tmp_path: Path, how: str) -> None:
    """SQLite in WAL mode goes on writing into a database file deleted (or renamed over) under
    its connection: every later commit lands in a file no one will read. The store compares
    the path's file with the one it opened before each write and refuses to write."""
    path = tmp_path / "db.sqlite3"
    store = opened(path)
    store.commit(UnitOfWork(requests=[new_request("a")]), "w1")
    if how == "deleted":
        os.unlink(path)
    else:
        other = tmp_path / "other.sqlite3"
        sqlite3.connect(other).close()
        os.replace(other, path)
    with pytest.raises(StoreError) as caught:
        store.commit(UnitOfWork(requests=[new_request("b")]), "w1")
    assert not isinstance(caught.value, StoreBusy)
    assert f"the database {path} was deleted or replaced" in str(caught.value)
    store.close()


def test_only_a_lock_held_elsewhere_is_busy(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    store = opened(path, busy_timeout_seconds=0.05)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreBusy) as caught:
            store.commit(UnitOfWork(requests=[new_request("a")]), "w1")
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert "IDEMPOTENT_BUSY_TIMEOUT_SECONDS" in str(caught.value)
    store.commit(UnitOfWork(requests=[new_request("a")]), "w1")  # the lock is gone: it works
    store.close()


# -- whose database it is --------------------------------------------------------------------


def meta(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT key, value FROM meta"))
    finally:
        conn.close()


def test_the_identity_is_recorded_at_creation_and_another_crawl_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "db.sqlite3"
    opened(path).close()
    assert {k: meta(path)[k] for k in ("project", "spider", "source")} == {
        "project": "shop", "spider": "shop", "source": "shop"}
    opened(path).close()  # the same crawl again
    for other, setting in [
        (CrawlIdentity(project="shop", spider="many", source="many"), "IDEMPOTENT_DATABASE"),
        (CrawlIdentity(project="other", spider="shop", source="shop"), "IDEMPOTENT_DATABASE"),
        (CrawlIdentity(project="shop", spider="shop", source="renamed"), "IDEMPOTENT_SOURCE"),
    ]:
        store = SQLiteStore(str(path))
        with pytest.raises(StoreError) as caught:
            store.open(fingerprinter="x", identity=other)
        message = str(caught.value)
        assert "belongs to spider 'shop' of project 'shop'" in message, message
        assert setting in message, message
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM sessions").fetchone() == (2,)
    conn.close()


def test_a_database_of_an_earlier_version_gets_its_identity_at_the_first_open(
    tmp_path: Path,
) -> None:
    """A database as versions before the application id wrote it: no id, no identity."""
    path = tmp_path / "db.sqlite3"
    opened(path, identity=None).close()
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM meta WHERE key IN ('project', 'spider', 'source')")
    conn.execute("PRAGMA application_id = 0")
    # as schema version 3 wrote it (the last one without an application id)
    for trigger in ("requests_pending_added", "requests_pending_again"):  # schema 19
        conn.execute(f"DROP TRIGGER {trigger}")
    conn.execute("DROP TABLE linked_requests")  # schema 17
    conn.execute("ALTER TABLE page_validators DROP COLUMN links")
    for index in ("requests_failed", "requests_redirected"):  # schema 16
        conn.execute(f"DROP INDEX {index}")
    for column in ("body_bytes", "revisit_seconds", "due_at", "outcome"):  # schema 15
        conn.execute(f"ALTER TABLE page_validators DROP COLUMN {column}")
    conn.execute("DROP TABLE page_validators")  # schema 14
    conn.execute("ALTER TABLE requests DROP COLUMN downloads")  # schema 13
    conn.execute("DROP TABLE robots")  # schema 12
    conn.execute("DROP TABLE record_keys")  # schema 11
    for index in ("requests_slot_pending", "requests_slot_leased"):  # schema 10
        conn.execute(f"DROP INDEX {index}")
    conn.execute("ALTER TABLE requests DROP COLUMN slot")
    conn.execute("DROP TABLE slots")
    for column in ("seq", "byte_offset", "batch_id", "items", "first_seq", "total", "writer",
                   "writer_until"):  # schema 9
        conn.execute(f"ALTER TABLE feeds DROP COLUMN {column}")
    conn.execute("DROP TABLE samples")  # schema 8
    # schema 21's, then 6's
    for column in ("observed_at", "records_stale", "leases_reclaimed", "leases_lost"):
        conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    conn.execute("ALTER TABLE records DROP COLUMN observed_at")  # schema 7
    conn.execute("ALTER TABLE records DROP COLUMN version")
    conn.execute("DROP TABLE outbox")  # schema 6
    conn.execute("DROP INDEX records_seen")  # schema 5
    conn.execute("ALTER TABLE records DROP COLUMN seen_seq")
    conn.execute("ALTER TABLE runs DROP COLUMN seen_seq")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    opened(path).close()
    assert meta(path)["spider"] == "shop"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,)
    conn.close()
    with pytest.raises(StoreError, match="belongs to spider 'shop'"):
        SQLiteStore(str(path)).open(fingerprinter="x", identity=CrawlIdentity("p", "s", "s"))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real file system of 256 KiB (tmpfs), filled up."""
    with small_file_system(tmp_path / "small", "256k") as mount:
        fill_up(mount)
        yield mount


def test_a_full_disk_at_open_is_named(full_disk: Path) -> None:
    with pytest.raises(StoreError) as caught:
        SQLiteStore(str(full_disk / "db.sqlite3")).open(fingerprinter="x", identity=SHOP)
    assert not isinstance(caught.value, StoreBusy)
    assert "full" in str(caught.value), caught.value
    assert "locked" not in str(caught.value)


def test_a_full_disk_at_the_open_of_a_crawl_s_database_is_named_and_loses_nothing(
        tmp_path: Path) -> None:
    """The disk of an existing crawl's database filled up while no crawl ran: the next open
    says the disk is full (SQLite's own code is an I/O error of its -shm file), and the
    database keeps what it held."""
    # (1 MB: a new database's migrations leave a WAL of about 400 KB beside its file)
    with small_file_system(tmp_path / "small", "1m") as mount:
        path = mount / "db.sqlite3"
        store = SQLiteStore(str(path))
        store.open(fingerprinter="x", identity=SHOP)
        store.begin_session("w1", "auto")
        store.commit(UnitOfWork(requests=[
            NewRequest(key=f"k{n}", fingerprint=f"k{n}", url=f"https://shop.example/{n}",
                       priority=0, data="{}") for n in range(50)]), "w1")
        store.end_session("w1", "shutdown")
        store.close()
        filler = fill_up(mount)
        with pytest.raises(StoreError) as caught:
            SQLiteStore(str(path)).open(fingerprinter="x", identity=SHOP)
        assert not isinstance(caught.value, StoreBusy)
        assert f"the disk holding the database {path} is full" in str(caught.value)
        assert "deleted or truncated" not in str(caught.value)
        filler.unlink()
        conn = sqlite3.connect(path)
        assert conn.execute("SELECT count(*) FROM requests").fetchone() == (50,)
        conn.close()
