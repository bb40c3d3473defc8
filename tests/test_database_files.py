"""Database files in trouble: missing directories, an unwritable path, a corrupt or newer
file, an old schema, file permissions, a full disk, a neighbour holding the write lock.

Every test runs the real thing: crawls through Scrapy's engine against a local site, real
SQLite files, real processes for the neighbours. Each one checks that nothing committed is
lost and that the message tells the operator what happened and what to do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import (
    PagesSpider,
    crawl_settings,
    db_rows,
    frontier_counts,
    package_messages,
    pages,
    run_crawl,
)
from helpers.catalogue_spider import CatalogueSpider
from scrapy_idempotent.codec import loads

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "scrapy_idempotent"
EXAMPLE_PROJECT = ROOT / "example_project"



KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}}


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()



@deferred_f_from_coro_f
async def test_missing_directories_of_the_database_are_created(
    site: LocalSite, tmp_path: Path
) -> None:
    db = tmp_path / "not" / "there" / "yet" / "{spider}.sqlite3"
    crawler = await run_crawl(PagesSpider, crawl_settings(db, **KEYS), url=site.url,
                              paths=pages(site, 2),
                              make_output=lambda r: [{"sku": r.url}])
    created = tmp_path / "not" / "there" / "yet" / "pages.sqlite3"
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert created.is_file()
    assert frontier_counts(created) == {"done": 2}
    assert len(db_rows(created, "SELECT * FROM records")) == 2


def _crawl_shop(site_url: str, database: Path, *settings: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
               "-s", f"IDEMPOTENT_DATABASE={database}", "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_unwritable_database_path_stops_scrapy_crawl_before_any_request(
    site: LocalSite, tmp_path: Path
) -> None:
    """What a real ``scrapy crawl`` does when the database cannot be created: a directory in
    the path is a regular file (root ignores permission bits, so chmod would prove nothing),
    or a directory sits where the file should be. Both crawls run at once."""
    (tmp_path / "afile").write_text("a regular file, not a directory\n")
    under_a_file = tmp_path / "afile" / "db.sqlite3"
    (tmp_path / "adir.sqlite3").mkdir()
    a_directory = tmp_path / "adir.sqlite3"
    why = {under_a_file: r"(?i)not a directory|file exists|is a file",
           a_directory: r"(?i)is a directory"}
    crawls = {path: _crawl_shop(site.url, path) for path in (under_a_file, a_directory)}
    outputs = {path: proc.communicate(timeout=120)[0] for path, proc in crawls.items()}
    assert site.request_count == 0
    assert (tmp_path / "afile").read_text() == "a regular file, not a directory\n"
    assert os.listdir(a_directory) == []
    for path, proc in crawls.items():
        output = outputs[path]
        assert proc.returncode != 0, output
        errors = "\n".join(line for line in output.splitlines()
                           if "ERROR" in line or "Error:" in line)
        assert str(path) in errors, output
        # the error says why, and which setting to change
        assert re.search(why[path], errors), errors
        assert "IDEMPOTENT_DATABASE" in errors, errors
        # no follow-up noise from closing a frontier that was never opened
        assert "error while closing the frontier" not in output, output
        assert "Crawled (" not in output


def _corrupt(path: Path) -> None:
    import random

    path.write_bytes(random.Random(8).randbytes(16384))


def _newer(path: Path) -> None:
    """A database of a later scrapy_idempotent (its application id, a later schema)."""
    from scrapy_idempotent.store.sqlite import APPLICATION_ID

    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute("PRAGMA user_version = 99")
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.commit()
    conn.close()


def _sqlite_file(*statements: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        conn = sqlite3.connect(path)
        for statement in statements:
            conn.execute(statement)
        conn.commit()
        conn.close()
    return make


#: Databases of other applications: refused before anything in them changes (no WAL switch,
#: no table, no user_version), with a message that says so and names the setting.
_FOREIGN = "not a scrapy_idempotent database"


@pytest.mark.parametrize(("make", "hint"), [
    pytest.param(_corrupt, "IDEMPOTENT_DATABASE", id="random-bytes"),
    pytest.param(_newer, "upgrade", id="schema-99"),
    pytest.param(_sqlite_file("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)",
                              "INSERT INTO users VALUES (1, 'ann')"), _FOREIGN,
                 id="users-table-version-0"),
    pytest.param(_sqlite_file("CREATE TABLE records (x)"), _FOREIGN, id="records-table"),
    pytest.param(_sqlite_file("PRAGMA user_version = 7"), _FOREIGN, id="empty-version-7"),
    pytest.param(_sqlite_file(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "CREATE TABLE users (id INTEGER)", "PRAGMA user_version = 1"), _FOREIGN,
        id="version-1-with-a-foreign-table"),
])
@deferred_f_from_coro_f
async def test_corrupt_or_newer_database_stops_the_crawl_and_is_left_untouched(
    site: LocalSite, db_path: Path, caplog: Any, make: Callable[[Path], None], hint: str
) -> None:
    make(db_path)
    before = file_digest(db_path)
    names = sorted(os.listdir(db_path.parent))
    # refused at open: the spider closes as idempotent_store_error, nothing fetched
    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 2), make_output=lambda r: [{"sku": r.url}])
    assert crawler.stats.get_value("finish_reason") == "idempotent_store_error"
    assert file_digest(db_path) == before  # no WAL switch, no table, no user_version
    assert sorted(os.listdir(db_path.parent)) == names  # no -wal/-shm/-journal either
    assert site.request_count == 0
    message = crawler.stats.get_value("idempotent/error")
    assert message.startswith("cannot open the frontier database: ")
    assert str(db_path) in message
    assert hint in message, message
    assert not [m for m in package_messages(caplog, logging.ERROR)
                if "error while closing" in m]


@deferred_f_from_coro_f
async def test_database_at_schema_version_0_is_migrated_forward(
    site: LocalSite, db_path: Path
) -> None:
    """Version 0 is what an empty file is; the only migration step (0 -> 1) runs on it."""
    from scrapy_idempotent.store.sqlite import SCHEMA_VERSION

    db_path.write_bytes(b"")
    assert db_rows(db_path, "PRAGMA user_version") == [(0,)]
    crawler = await run_crawl(PagesSpider, crawl_settings(db_path, **KEYS), url=site.url,
                              paths=pages(site, 3), make_output=lambda r: [{"sku": r.url}])
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert db_rows(db_path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    assert db_rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    assert frontier_counts(db_path) == {"done": 3}
    assert len(db_rows(db_path, "SELECT * FROM records")) == 3
    tables = {name for (name,) in db_rows(db_path,
                                           "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"meta", "runs", "sessions", "requests", "records", "responses",
            "rejects"} <= tables


@deferred_f_from_coro_f
async def test_new_database_files_are_private_to_their_owner(
    site: LocalSite, tmp_path: Path
) -> None:
    db = tmp_path / "private" / "frontier.sqlite3"
    old_umask = os.umask(0o002)  # a permissive umask: group and others could read
    try:
        crawler = await run_crawl(PagesSpider, crawl_settings(db, **KEYS), url=site.url,
                                  paths=pages(site, 1), make_output=lambda r: [{"sku": "P"}])
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in db.parent.iterdir()}
    finally:
        os.umask(old_umask)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert modes["frontier.sqlite3"] == 0o600
    for name, mode in modes.items():  # -wal and -shm hold the same data
        assert mode & 0o077 == 0, (name, oct(mode))


def _records_by_sku(db_path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for data, request_key in db_rows(db_path, "SELECT data, request_key FROM records"):
        found.setdefault(loads(data)["sku"], []).append(request_key)
    return found


def _assert_done_means_stored(db_path: Path, count: int) -> None:
    """Done is the last write: each done item page has its record, the done listing has all
    its children, and every record belongs to a done request."""
    rows = db_rows(db_path, "SELECT key, url, state FROM requests")
    state_of = {key: state for key, _, state in rows}
    records = _records_by_sku(db_path)
    for key, url, state in rows:
        path = urlsplit(url).path
        if state == "done" and path.startswith("/item/"):
            assert records.get(f"S-{path.rsplit('/', 1)[1]}") == [key], path
        if state == "done" and path == "/list":
            assert len(rows) == count + 1
    for sku, keys in records.items():
        assert len(keys) == 1 and state_of.get(keys[0]) == "done", sku


@deferred_f_from_coro_f
async def test_disk_full_during_commits_closes_cleanly_and_the_next_crawl_completes(
    site: LocalSite, db_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    """SQLITE_FULL, simulated with ``PRAGMA max_page_count`` on every connection the store
    opens: the database stops growing part-way through the crawl."""
    count = 60
    site.add_catalogue(count, filler=3000)
    settings = crawl_settings(db_path, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
                              CONCURRENT_REQUESTS=4)
    real_connect = sqlite3.connect

    def connect_with_a_small_disk(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, **kwargs)
        if os.fspath(args[0]) == os.fspath(db_path):
            conn.execute("PRAGMA max_page_count = 60")  # 240 KiB: about half the catalogue
        return conn

    with monkeypatch.context() as patched:
        patched.setattr(sqlite3, "connect", connect_with_a_small_disk)
        full = await run_crawl(CatalogueSpider, settings, url=site.url)
    stats = full.stats.get_stats()
    assert stats["finish_reason"] == "idempotent_store_error"
    store_error = stats["idempotent/error"]
    assert db_rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    done_paths = {urlsplit(url).path for (url,) in
                  db_rows(db_path, "SELECT url FROM requests WHERE state = 'done'")}
    assert 1 <= len(done_paths) < count + 1, frontier_counts(db_path)
    _assert_done_means_stored(db_path, count)
    errors = package_messages(caplog, logging.ERROR)
    inserted_before = stats.get("idempotent/records/inserted", 0)

    site.reset_counts()
    resumed = await run_crawl(CatalogueSpider, settings, url=site.url)
    stats = resumed.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert frontier_counts(db_path) == {"done": count + 1}
    records = _records_by_sku(db_path)
    assert sorted(records) == sorted(f"S-{i}" for i in range(1, count + 1))
    assert inserted_before + stats.get("idempotent/records/inserted", 0) == count
    assert "idempotent/records/updated" not in stats
    _assert_done_means_stored(db_path, count)
    # only what was not done is leased again (fetched, or replayed from the journal)
    assert stats["idempotent/requests/leased"] == count + 1 - len(done_paths)
    assert not [path for path in done_paths if site.hits(path)]
    # the messages name the real cause, and tell the operator what to do
    assert "full" in store_error, store_error
    assert any("full" in m and re.search(r"(?i)resum|again", m) for m in errors), errors


#: A neighbour process: waits until the crawl has done ``min_done`` requests, then holds the
#: database's write lock (``BEGIN IMMEDIATE``) for ``hold`` seconds.
LOCKER = r"""
import sqlite3, sys, time
path, min_done, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.time() + 60
conn = sqlite3.connect(path, isolation_level=None, timeout=0.01)
while min_done > 0 and time.time() < deadline:
    try:
        conn = sqlite3.connect(path, isolation_level=None, timeout=0.01)
        done = conn.execute("SELECT count(*) FROM requests WHERE state = 'done'").fetchone()[0]
        if done >= min_done:
            break
    except sqlite3.Error:
        pass
    time.sleep(0.01)
conn.execute("BEGIN IMMEDIATE")
print("locked", time.time(), flush=True)
time.sleep(hold)
conn.execute("ROLLBACK")
print("released", time.time(), flush=True)
"""


async def _crawl_while_locked(db_path: Path, site: LocalSite, settings: dict[str, Any],
                              hold_seconds: float) -> tuple[Any, dict[str, int]]:
    """Crawl the catalogue while a neighbour takes the write lock after 5 pages for
    ``hold_seconds``; returns the crawler and the frontier once the neighbour is gone."""
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db_path), "5",
                               str(hold_seconds)], stdout=subprocess.PIPE, text=True)
    try:
        crawler = await run_crawl(CatalogueSpider, settings, url=site.url)
    finally:
        locker_output, _ = locker.communicate(timeout=60)
    assert "locked" in locker_output and "released" in locker_output
    assert db_rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    return crawler, frontier_counts(db_path)


def _assert_catalogue_once(db_path: Path, site: LocalSite, count: int) -> None:
    assert frontier_counts(db_path) == {"done": count + 1}
    assert sorted(_records_by_sku(db_path)) == sorted(f"S-{i}" for i in range(1, count + 1))
    _assert_done_means_stored(db_path, count)
    assert max(site.counts_by_path().values()) <= 2


@deferred_f_from_coro_f
async def test_neighbour_holding_the_write_lock_briefly_is_waited_for(
    db_path: Path, caplog: Any
) -> None:
    """Another process holds the write lock for 0.5 s; IDEMPOTENT_BUSY_TIMEOUT_SECONDS is 0.2
    (five attempts and back-off: about 1.75 s of patience). The crawl waits, says so in the
    log, and finishes with every record once."""
    count = 30
    with LocalSite(keep_alive=False, delay=0.02) as site:
        site.add_catalogue(count)
        settings = crawl_settings(db_path, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.2, CONCURRENT_REQUESTS=4)
        crawler, _ = await _crawl_while_locked(db_path, site, settings, 0.5)
        assert crawler.stats.get_value("finish_reason") == "finished"
        _assert_catalogue_once(db_path, site, count)
    warnings = package_messages(caplog, logging.WARNING)
    assert any("busy" in m or "locked" in m for m in warnings), warnings


@deferred_f_from_coro_f
async def test_neighbour_holding_the_write_lock_too_long_closes_and_next_crawl_completes(
    db_path: Path, caplog: Any
) -> None:
    """The lock is held for 2.5 s while IDEMPOTENT_BUSY_TIMEOUT_SECONDS is 0.05 (about 1 s of
    patience): the crawl closes with ``idempotent_store_error`` while the lock is still held
    (so it cannot even release its leases), and the next crawl, here in the same Python
    process as with ``CrawlerRunner``, must complete it without losing a request."""
    count = 30
    with LocalSite(keep_alive=False, delay=0.02) as site:
        site.add_catalogue(count)
        settings = crawl_settings(db_path, IDEMPOTENT_NATURAL_KEYS={"dict": "sku"},
                                  IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.05, CONCURRENT_REQUESTS=4)
        first, after_first = await _crawl_while_locked(db_path, site, settings, 2.5)
        assert first.stats.get_value("finish_reason") == "idempotent_store_error"
        _assert_done_means_stored(db_path, count)
        errors = package_messages(caplog, logging.ERROR)
        second = await run_crawl(CatalogueSpider, settings, url=site.url)
        assert second.stats.get_value("finish_reason") == "finished"
        assert frontier_counts(db_path) == {"done": count + 1}, after_first
        _assert_catalogue_once(db_path, site, count)
    # says what happened and what to do (raise the timeout, or run the crawl again)
    assert any("locked" in m and re.search(
        r"IDEMPOTENT_BUSY_TIMEOUT_SECONDS|(?i:resum|again)", m) for m in errors), errors


@deferred_f_from_coro_f
async def test_neighbour_holding_the_write_lock_when_the_crawl_starts(
    site: LocalSite, db_path: Path
) -> None:
    """The lock is already held (for 1 s) when the crawl opens the database. Writes during the
    crawl would wait 5 x 0.2 s plus back-off (about 1.75 s) before giving up; opening the
    database should be as patient, then start and finish."""
    settings = crawl_settings(db_path, IDEMPOTENT_BUSY_TIMEOUT_SECONDS=0.2, **KEYS)
    earlier = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 1),
                              make_output=lambda r: [{"sku": r.url}])
    assert earlier.stats.get_value("finish_reason") == "finished"
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db_path), "0", "1"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout is not None
        assert locker.stdout.readline().startswith("locked")
        crawler = await run_crawl(PagesSpider, settings, url=site.url, paths=pages(site, 3),
                                  make_output=lambda r: [{"sku": r.url}])
    finally:
        locker.communicate(timeout=60)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert frontier_counts(db_path) == {"done": 3}
    assert len(db_rows(db_path, "SELECT * FROM records")) == 3
