"""A database of another crawl, or one that is not ours, is refused before anything in it
changes: real SQLite files, compared byte for byte (and no -wal or -shm left beside them)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

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
    assert store.query("PRAGMA auto_vacuum") == [(2,)]
    assert store.query("SELECT count(*) FROM requests") == [(200,)]
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
