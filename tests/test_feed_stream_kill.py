"""Streamed feeds through ten SIGKILLs: an appended JSON Lines feed (``-o``), an overwritten
JSON feed and a batched CSV feed (``FEEDS``) grow while each crawl runs, as far as the records
committed (checked against the store while the crawl runs), and end with exactly one entry per
record of the run, equal to ``scrapy idempotent export``."""

from __future__ import annotations

import csv
import io
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite

from crawling import EXAMPLE_PROJECT, db_rows
from helpers.feeds import exported_rows, product_rows, record_count

BATCH = 120
#: products of the site: ten crawls of 20 to 40 records each (the site holds every request
#: once a crawl has stored its share, until it is killed) leave work for the last one
PRODUCTS = 60 * 20


def _command(site_url: str, db: Path, log: Path, out: Path) -> list[str]:
    feeds = {str(out / "replaced.json"): {"format": "json", "overwrite": True},
             str(out / "part-%(batch_id)d.csv"): {"format": "csv", "batch_item_count": BATCH}}
    return [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
            "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={log}",
            "-s", "CONCURRENT_REQUESTS=4", "-s", "CONCURRENT_REQUESTS_PER_DOMAIN=4",
            "-s", f"FEEDS={json.dumps(feeds)}", "-o", str(out / "appended.jsonl")]


def _run_skus(db: Path) -> list[str]:
    """The SKUs of the run's records in commit order (their sequence of first sight)."""
    try:
        return [json.loads(d)["sku"] for (d,) in db_rows(
            db, "SELECT data FROM records WHERE seen_run_id = (SELECT max(run_id) FROM runs)"
            " ORDER BY seen_seq")]
    except Exception:  # the database is being created or migrated
        return []


def _appended_skus(path: Path) -> list[str]:
    """The complete lines of the run's part of the appended feed (after the earlier line)."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")[:-1]  # a last line without its newline: cut
    return [json.loads(line)["sku"] for line in lines[1:]]


def _read_csv_batches(out: Path) -> list[list[dict[str, Any]]]:
    batches, n = [], 1
    while (out / f"part-{n}.csv").exists():
        with (out / f"part-{n}.csv").open(newline="") as f:
            batches.append(list(csv.DictReader(f)))
        n += 1
    return batches


def _wait_file_covers(process: subprocess.Popen[bytes], db: Path, feed: Path) -> bool:
    """While the crawl runs: the appended feed is, at every reading, the store's commit order
    up to some point (no entry twice, none out of order), and it catches up with a reading of
    the store taken before (the records committed then reach the file while the crawl goes
    on). False when the crawl ended first."""
    committed = _run_skus(db)
    deadline = time.monotonic() + 120  # a failure guard, not a synchronisation
    while process.poll() is None:
        written = _appended_skus(feed)
        stored = _run_skus(db)  # read after the file: the file never holds more
        assert written == stored[:len(written)], "the feed is not the store's commit order"
        if len(written) >= len(committed):
            return True
        assert time.monotonic() < deadline, "the feed did not catch up with the store"
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_streamed_feeds_through_ten_sigkills_hold_each_record_of_the_run_once(
    tmp_path: Path
) -> None:
    out, db = tmp_path / "out", tmp_path / "db.sqlite3"
    out.mkdir()
    appended, replaced = out / "appended.jsonl", out / "replaced.json"
    appended.write_text('{"sku": "from an earlier crawl"}\n')
    replaced.write_text('["from an earlier crawl"]')
    rng = random.Random(26)
    caught_up = 0
    with LocalSite(listing_pages=60, products_per_page=20, delay=0.01) as site:
        for kill in range(1, 11):
            log = tmp_path / f"kill{kill}.log"
            target = record_count(db) + 20 + rng.randrange(20)  # each crawl stores some first
            process = subprocess.Popen(_command(site.url, db, log, out), cwd=EXAMPLE_PROJECT,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 180
                while record_count(db) < target and process.poll() is None:
                    assert time.monotonic() < deadline, f"crawl {kill} stored too little"
                    time.sleep(0.02)
                # the crawl's requests are held from here: it stays open, with requests on
                # the wire, however fast this machine crawls, while its feed catches up
                site.hold()
                if _wait_file_covers(process, db, appended):
                    caught_up += 1
                assert process.poll() is None, f"crawl {kill} ended before its kill"
                process.send_signal(signal.SIGKILL)
            finally:
                process.kill()
                process.wait()
                site.release()
        log = tmp_path / "final.log"
        final = subprocess.run(_command(site.url, db, log, out), cwd=EXAMPLE_PROJECT,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, timeout=600)
        assert final.returncode == 0, log.read_text()
    assert caught_up == 10
    exported = exported_rows(db, tmp_path)
    assert len(exported) == PRODUCTS
    lines = [json.loads(line) for line in appended.read_text().splitlines()]
    assert lines[0] == {"sku": "from an earlier crawl"}  # -o: what was there stays
    assert product_rows(lines[1:]) == exported
    assert len(lines) == PRODUCTS + 1
    entries = json.loads(replaced.read_text())  # -O: replaced by the run; valid JSON
    assert product_rows(entries) == exported and len(entries) == PRODUCTS
    batches = _read_csv_batches(out)
    assert [len(b) for b in batches] == [BATCH] * (PRODUCTS // BATCH) + (
        [PRODUCTS % BATCH] if PRODUCTS % BATCH else [])
    rows = [row for batch in batches for row in batch]
    assert product_rows(rows) == exported and len(rows) == PRODUCTS
    assert all(list(row) == ["sku", "name", "price", "url"] for row in rows)
    # each file once: every CSV batch has one header line
    for n in range(1, len(batches) + 1):
        text = (out / f"part-{n}.csv").read_text()
        assert next(csv.reader(io.StringIO(text))) == ["sku", "name", "price", "url"]
        assert text.count("sku,name,price,url") == 1
    assert db_rows(db, "SELECT reason FROM runs") == [("finished",)]
