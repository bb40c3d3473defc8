"""Fencing with real processes: a worker stopped with SIGSTOP past its lease comes back to
find its requests done by another worker; nothing it then commits may change the database.

The lease is the fence of the whole unit of work: records, rejects, child requests, journal
rows and counters of a page are written only by the worker that still holds the page's lease.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite

from crawling import (
    EXAMPLE_PROJECT,
    close_reason,
    db_rows,
    done_requests,
    start_shop_crawl,
    wait_for,
)

pytestmark = pytest.mark.slow

LEASE = "IDEMPOTENT_LEASE_SECONDS=2"
CONCURRENCY = 4
SETTINGS = (LEASE, f"CONCURRENT_REQUESTS={CONCURRENCY}",
            f"CONCURRENT_REQUESTS_PER_DOMAIN={CONCURRENCY}", "LOG_LEVEL=INFO")




def stat(log: Path, name: str) -> int:
    """A counter from the stats Scrapy dumps at the end of a crawl log (0 when absent)."""
    found = re.findall(rf"'{re.escape(name)}': (\d+)", log.read_text(errors="replace"))
    return int(found[-1]) if found else 0


def records(db: Path) -> dict[str, tuple[Any, ...]]:
    return {row[0]: row[1:] for row in db_rows(
        db, "SELECT record_id, data, content_hash, first_seen, last_changed, changed_run_id"
            " FROM records")}


def test_a_stopped_worker_whose_leases_were_taken_writes_nothing_when_continued(
    tmp_path: Path,
) -> None:
    db = tmp_path / "shop.sqlite3"
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    with LocalSite(delay=0.05) as site:
        worker_a = start_shop_crawl(site.url, db, a_log, *SETTINGS)
        worker_b = None
        try:
            # A is working: pages done, and requests of A on the wire
            wait_for(lambda: done_requests(db) >= 30 and site.in_flight >= 2, 120,
                     "worker A in the middle of its crawl")
            worker_a.send_signal(signal.SIGSTOP)
            # every request A sent is answered (at the old prices) and waits in A's socket
            wait_for(lambda: site.in_flight == 0, 60, "A's requests to be answered")
            held_by_a = db_rows(db, "SELECT count(*) FROM requests WHERE state = 'leased'")
            assert held_by_a[0][0] >= 1
            site.set_price_version(1)  # the site changes while A is stopped
            worker_b = start_shop_crawl(site.url, db, b_log, *SETTINGS)
            assert worker_b.wait(timeout=300) == 0  # B took A's expired leases and finished
            assert close_reason(b_log) == "finished"
            stored_by_b = records(db)
            requests_before = site.request_count
            worker_a.send_signal(signal.SIGCONT)
            assert worker_a.wait(timeout=120) == 0
            requests_after = site.request_count
        finally:
            for worker in (worker_a, worker_b):
                if worker is not None and worker.poll() is None:
                    worker.send_signal(signal.SIGCONT)
                    worker.kill()
                    worker.wait()
        expected = site.expected_products()  # at price version 1
    assert close_reason(a_log) == "finished"
    # A, continued, changed no record (its responses carried the old prices)
    assert records(db) == stored_by_b
    # every record B wrote (changed after A stopped) has the new price
    changed_by_b = [data for data, *_ in stored_by_b.values()
                    if '"price":"' + expected[_sku(data)]["price"] + '"' in data]
    assert changed_by_b, "B stored no product at the new prices"
    # A counted its late completions as lost leases, not as done
    assert stat(a_log, "idempotent/requests/leases_lost") >= 1
    assert stat(a_log, "idempotent/requests/done") + stat(b_log, "idempotent/requests/done") \
        == 525
    assert db_rows(db, "SELECT sum(done) FROM runs") == [(525,)]
    assert db_rows(db, "SELECT state, count(*) FROM requests GROUP BY state") == [("done", 525)]
    assert db_rows(db, "SELECT count(*) FROM responses") == [(0,)]  # no late journal rows
    # A handed out nothing it had claimed ahead: at most what was already in its downloader
    assert requests_after - requests_before <= CONCURRENCY
    check = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "check", "--db", str(db)],
        cwd=EXAMPLE_PROJECT, capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


def _sku(data: str) -> str:
    match = re.search(r'"sku":"(SKU-\d+)"', data)
    assert match is not None, data
    return match.group(1)
