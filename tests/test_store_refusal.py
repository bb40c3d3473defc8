"""A database of another crawl, or one that is not ours, is refused before anything in it
changes: real SQLite files, compared byte for byte (and no -wal or -shm left beside them)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from crawling import EXAMPLE_PROJECT
from scrapy_idempotent.exceptions import StoreError
from scrapy_idempotent.store import CrawlIdentity, NewRequest, SQLiteStore, UnitOfWork

SPIDER_A = CrawlIdentity(project="shop", spider="a", source="a")
SPIDER_B = CrawlIdentity(project="shop", spider="b", source="b")


def files(path: Path) -> dict[str, bytes]:
    """The database and whatever SQLite keeps beside it."""
    return {p.name: p.read_bytes() for p in sorted(path.parent.iterdir())
            if p.name.startswith(path.name)}


def make_database(path: Path, identity: CrawlIdentity) -> None:
    store = SQLiteStore(str(path))
    store.open(fingerprinter="x", identity=identity)
    store.begin_session("w1", "auto")
    store.commit(UnitOfWork(requests=[NewRequest(
        key=f"k{i}", fingerprint=f"k{i}", url=f"https://shop.example/{i}", priority=0,
        data="x" * 2000) for i in range(200)]), "w1")
    store.end_session("w1", "shutdown")
    store.close()


def as_earlier_version(path: Path, *, schema_3: bool, journal_mode: str) -> None:
    """Without incremental auto-vacuum, as versions before it wrote the file; with
    ``schema_3``, also the schema (and no application id) of version 3."""
    conn = sqlite3.connect(path, isolation_level=None)
    if schema_3:
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
        for column in ("seq", "byte_offset", "batch_id", "items", "first_seq", "total",
                       "writer", "writer_until"):  # schema 9
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
        conn.execute("PRAGMA application_id = 0")
    conn.execute(f"PRAGMA journal_mode = {journal_mode}").fetchall()
    conn.execute("PRAGMA auto_vacuum = NONE")
    conn.execute("VACUUM")
    assert conn.execute("PRAGMA auto_vacuum").fetchone() == (0,)
    conn.close()


@pytest.mark.parametrize(("schema_3", "journal_mode"), [
    (False, "wal"), (False, "delete"), (True, "wal"), (True, "delete")])
def test_another_spiders_database_is_refused_with_not_a_byte_changed(
    tmp_path: Path, schema_3: bool, journal_mode: str,
) -> None:
    path = tmp_path / "a.sqlite3"
    make_database(path, SPIDER_A)
    as_earlier_version(path, schema_3=schema_3, journal_mode=journal_mode)
    before = files(path)
    assert set(before) == {"a.sqlite3"}
    with pytest.raises(StoreError, match="belongs to spider 'a'") as caught:
        SQLiteStore(str(path)).open(fingerprinter="x", identity=SPIDER_B)
    assert "left untouched" in str(caught.value)
    assert files(path) == before  # no migration, no vacuum, no journal mode, no -wal/-shm
    # and its own crawl still opens it, migrates it and converts it
    store = SQLiteStore(str(path))
    store.open(fingerprinter="x", identity=SPIDER_A)
    assert store.conn.execute("PRAGMA auto_vacuum").fetchall() == [(2,)]
    assert store.conn.execute("SELECT count(*) FROM requests").fetchall() == [(200,)]
    store.close()


def test_a_file_that_is_not_ours_is_refused_with_not_a_byte_changed(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('spider', 'b')")
    conn.commit()
    conn.close()
    before = files(path)
    with pytest.raises(StoreError, match="not a scrapy_idempotent database"):
        SQLiteStore(str(path)).open(fingerprinter="x", identity=SPIDER_B)
    assert files(path) == before


# -- scrapy idempotent retry: the one command that writes ------------------------------------


def with_failed_requests(path: Path, identity: CrawlIdentity) -> None:
    make_database(path, identity)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE requests SET state = 'failed', error_kind = 'http_status',"
                     " finished_at = 1 WHERE id <= 5")
    conn.close()


def retry(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scrapy", "idempotent", "retry", *args],
                          cwd=EXAMPLE_PROJECT, capture_output=True, text=True, timeout=120,
                          check=False)


def test_retry_refuses_another_crawls_database_and_a_file_not_ours_untouched(
    tmp_path: Path,
) -> None:
    others = tmp_path / "a.sqlite3"
    with_failed_requests(others, SPIDER_A)
    before = files(others)
    result = retry("shop", "-s", f"IDEMPOTENT_DATABASE={others}")
    assert result.returncode == 1, result.stderr
    assert "belongs to spider 'a' of project 'shop'" in result.stderr, result.stderr
    assert "this crawl is spider 'shop'" in result.stderr
    assert files(others) == before

    not_ours = tmp_path / "not-ours.sqlite3"
    with_failed_requests(not_ours, SPIDER_A)
    conn = sqlite3.connect(not_ours)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")  # another program's table
    conn.close()
    before = files(not_ours)
    result = retry("--db", str(not_ours))
    assert result.returncode == 1, result.stderr
    assert "is not a scrapy_idempotent database (tables: " in result.stderr, result.stderr
    assert "orders" in result.stderr
    assert "left untouched" in result.stderr
    assert files(not_ours) == before

    # the spider's own database: its failed requests are put back
    own = tmp_path / "shop.sqlite3"
    with_failed_requests(own, CrawlIdentity(project="shop", spider="shop", source="shop"))
    result = retry("shop", "-s", f"IDEMPOTENT_DATABASE={own}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Put 5 failed requests back to pending"), result.stdout
    result = retry("--db", str(others))  # --db names no crawl: only "is it ours" is checked
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Put 5 failed requests back to pending"), result.stdout


def test_retry_names_the_cause_of_store_errors(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"not a database" * 400)
    result = retry("--db", str(garbage))
    assert result.returncode == 1
    assert "is not a scrapy_idempotent database, or is damaged" in result.stderr, result.stderr
    assert garbage.read_bytes() == b"not a database" * 400

    busy = tmp_path / "busy.sqlite3"
    with_failed_requests(busy, SPIDER_A)
    locker = sqlite3.connect(busy, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    try:
        result = retry("--db", str(busy), "-s", "IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.1")
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert result.returncode == 1
    assert "locked by another process longer than IDEMPOTENT_BUSY_TIMEOUT_SECONDS" \
        in result.stderr, result.stderr
