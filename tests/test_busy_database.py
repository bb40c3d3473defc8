"""A database locked by another process does not stall the crawl's downloads: the crawl's
writes wait on the writer's thread, requests claimed ahead are still handed out and
downloaded, and everything is written once the lock is released."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import (
    close_reason,
    db_rows,
    done_requests,
    frontier_counts,
    start_shop_crawl,
    stored_products,
    wait_for,
)

pytestmark = pytest.mark.slow

CONCURRENCY = 2
#: requests claimed ahead: the downloads that need no write while the lock is held
LEASE_BATCH = 24


def test_downloads_go_on_while_another_process_holds_the_write_lock(tmp_path: Path) -> None:
    db = tmp_path / "shop.sqlite3"
    log = tmp_path / "crawl.log"
    with LocalSite(delay=0.02) as site:
        crawl = start_shop_crawl(
            site.url, db, log, f"CONCURRENT_REQUESTS={CONCURRENCY}",
            f"CONCURRENT_REQUESTS_PER_DOMAIN={CONCURRENCY}",
            f"IDEMPOTENT_LEASE_BATCH={LEASE_BATCH}", "LOG_LEVEL=INFO",
            # per-process limits: with the crawl's, a request holds its site's place until its
            # page commits, so a locked database stops the site's downloads too
            "IDEMPOTENT_POLITENESS=worker",
            # long enough for the lock below on a loaded machine; each attempt waits so long
            "IDEMPOTENT_BUSY_TIMEOUT_SECONDS=60")
        lock = None
        try:
            wait_for(lambda: done_requests(db) >= 40, 120, "the crawl to get going")
            lock = sqlite3.connect(db, isolation_level=None, timeout=60)
            lock.execute("BEGIN IMMEDIATE")  # another process holds the write lock now
            downloads_at_lock = site.request_count
            done_at_lock = done_requests(db)  # readers do not wait for the lock
            # More downloads than were on the wire when the lock was taken: the crawl hands
            # out requests and downloads them while none of its writes can commit.
            wait_for(lambda: site.request_count >= downloads_at_lock + CONCURRENCY + 8, 120,
                     "downloads while the database is locked")
            assert done_requests(db) == done_at_lock  # nothing was written meanwhile
            assert crawl.poll() is None
            lock.execute("ROLLBACK")
            lock.close()
            lock = None
            assert crawl.wait(timeout=300) == 0
        finally:
            if lock is not None:
                lock.close()
            if crawl.poll() is None:
                crawl.kill()
                crawl.wait()
        requests = site.request_count
    assert close_reason(log) == "finished"
    assert requests == 525  # every page fetched once
    assert frontier_counts(db) == {"done": 525}
    assert len(stored_products(db)) == 500
    assert db_rows(db, "SELECT count(*) FROM responses") == [(0,)]
