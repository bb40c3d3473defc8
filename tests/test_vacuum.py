"""Giving space back never holds the write lock long while other crawls work: the one-time
VACUUM of an older database waits until no other crawl runs (another real process here), and
the incremental vacuum goes in bounded steps."""

from __future__ import annotations

import base64
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scrapy_idempotent.store import CrawlIdentity, NewRequest, SQLiteStore, UnitOfWork
from scrapy_idempotent.store.sqlite import RECLAIM_STEP_PAGES

SHOP = CrawlIdentity(project="shop", spider="shop", source="shop")

#: Another crawl's session in its own process: it opens the store, begins a session under a
#: real worker id, says "ready", and ends its session when told to.
WORKER = textwrap.dedent("""
    import sys
    from scrapy_idempotent.store import CrawlIdentity, SQLiteStore
    from scrapy_idempotent.workers import worker_id

    store = SQLiteStore(sys.argv[1])
    store.open(fingerprinter="x", identity=CrawlIdentity("shop", "shop", "shop"))
    worker = worker_id()
    store.begin_session(worker, "auto")
    print("ready", flush=True)
    sys.stdin.readline()
    store.end_session(worker, "finished")
    store.close()
    print("ended", flush=True)
""")


def auto_vacuum(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA auto_vacuum").fetchone()[0])
    finally:
        conn.close()


def as_earlier_version(path: Path) -> None:
    """Without incremental auto-vacuum, as versions before it wrote the file."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA auto_vacuum = NONE")
    conn.execute("VACUUM")
    conn.close()
    assert auto_vacuum(path) == 0


def make_database(path: Path) -> None:
    store = SQLiteStore(str(path))
    store.open(fingerprinter="x", identity=SHOP)
    store.begin_session("w1", "auto")
    store.end_session("w1", "finished")
    store.close()


@contextmanager
def other_crawl(path: Path) -> Iterator[subprocess.Popen[str]]:
    with subprocess.Popen([sys.executable, "-c", WORKER, str(path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline() == "ready\n"
            yield process
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()


def open_and_close(path: Path) -> None:
    store = SQLiteStore(str(path))
    store.open(fingerprinter="x", identity=SHOP)
    store.close()


def test_the_one_time_vacuum_waits_until_no_other_crawl_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "db.sqlite3"
    make_database(path)
    with other_crawl(path) as process:
        as_earlier_version(path)  # while the other crawl's connection is open
        with caplog.at_level(logging.WARNING, logger="scrapy_idempotent"):
            open_and_close(path)
            open_and_close(path)
        assert auto_vacuum(path) == 0  # not converted while the other crawl runs
        waits = [r.getMessage() for r in caplog.records if "waits until no other" in
                 r.getMessage()]
        assert len(waits) == 1, waits  # said once
        assert f":{process.pid}:" in waits[0]
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("end\n")
        process.stdin.flush()
        assert process.stdout.readline() == "ended\n"
    open_and_close(path)  # alone now: converted
    assert auto_vacuum(path) == 2


def test_the_session_of_a_killed_crawl_does_not_hold_the_vacuum_back(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    make_database(path)
    with other_crawl(path) as process:
        process.send_signal(signal.SIGKILL)
        process.wait()
    as_earlier_version(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM sessions WHERE ended_at IS NULL").fetchone() \
        == (1,)  # its session never ended
    conn.close()
    open_and_close(path)
    assert auto_vacuum(path) == 2


def _incompressible(size: int) -> str:
    """``size`` random characters: a stored request that packing makes no smaller."""
    return base64.b85encode(os.urandom(size)).decode()[:size]


def test_free_space_is_given_back_in_bounded_steps(tmp_path: Path) -> None:
    store = SQLiteStore(str(tmp_path / "db.sqlite3"))
    store.open(fingerprinter="x", identity=SHOP)
    store.begin_session("w1", "auto")
    for batch in range(4):
        store.commit(UnitOfWork(requests=[NewRequest(
            key=f"k{batch}-{i}", fingerprint=f"k{batch}-{i}", url="https://shop.example/",
            priority=0, data=_incompressible(8000)) for i in range(500)]), "w1")
    store.conn.execute("DELETE FROM requests").fetchall()
    free = store.conn.execute("PRAGMA freelist_count").fetchall()[0][0]
    assert free > 3 * RECLAIM_STEP_PAGES
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    freed = store.reclaim_space(everything=True)
    store.conn.set_trace_callback(None)
    steps = [s for s in statements if "incremental_vacuum" in s]
    assert steps == [f"PRAGMA incremental_vacuum({RECLAIM_STEP_PAGES});"] * len(steps)
    assert len(steps) >= 4
    assert store.conn.execute("PRAGMA freelist_count").fetchall() == [(0,)]
    assert freed == free * store.conn.execute("PRAGMA page_size").fetchall()[0][0]
    store.close()
