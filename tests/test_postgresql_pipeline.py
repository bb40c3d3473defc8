"""The page commit on PostgreSQL sends its statements in psycopg's pipeline mode, and reads
an answer only where it needs one. Once the server flushes answers early (a large answer
fills its output buffer), an answer can arrive while the client sends a later statement; it
must still reach the statement that asked for it, never the fetch of a later one (seen in a
crawl: a commit's claim failed with "the last operation didn't produce records (command
status: INSERT 0 1)", the answer of the journal's insert sent before it)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from scrapy_idempotent.store import CrawlIdentity

psycopg = pytest.importorskip("psycopg")
from scrapy_idempotent.store.postgresql import PostgreSQLStore  # noqa: E402


@pytest.fixture
def store(postgres_url: str) -> Iterator[PostgreSQLStore]:
    store = PostgreSQLStore(postgres_url, heartbeat_seconds=None)
    try:
        store.open(fingerprinter="f", identity=CrawlIdentity("p", "shop", "shop"))
        yield store
    finally:
        store.close()


def answer_waiting(conn: psycopg.Connection[object]) -> None:
    """Wait until an answer to a statement sent in the pipeline has come in, unread (state,
    not time)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with conn.lock:
            conn.pgconn.consume_input()
        if not conn.pgconn.is_busy():
            return
        time.sleep(0.01)
    raise AssertionError("no answer from the server in 60 s")


def test_a_statement_reads_its_own_answer_when_earlier_ones_arrive_meanwhile(
        store: PostgreSQLStore) -> None:
    with store._pipelined("testing") as cur:
        cur.executemany("INSERT INTO meta (key, value) VALUES (%s, %s)"
                        " ON CONFLICT (key) DO NOTHING", [("pipeline-test", "1")])
        # larger than the server's output buffer: the answers so far are flushed
        cur.execute("SELECT repeat('y', 20000) FROM generate_series(1, 3)")
        answer_waiting(cur.connection)
        rows = cur.execute("SELECT 'its own answer'").fetchall()
    assert rows == [("its own answer",)]
    assert store._select("SELECT value FROM meta WHERE key = 'pipeline-test'") == [("1",)]
