#!/usr/bin/env python3
"""Streamed feeds: the lag from a record's transaction to its line in the feed, and the CPU a
crawl spends with a streamed JSON Lines feed against the same feed written at the close.

    python benchmarks/feed_stream.py [--pages 50] [--per-page 40]

Each crawl is ``scrapy crawl shop`` of the example project against the tests' local shop
(``tests/local_site.py``), on a fresh SQLite database. While the streamed crawl runs, the feed
is read every 10 ms: a line's lag is when it was first seen minus its record's ``seen_at``
(taken in the transaction that stored it, before that transaction's commit). CPU is the crawl
process's user + system time (``os.wait4``).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from local_site import LocalSite  # noqa: E402


def crawl(site_url: str, workdir: Path, streaming: bool) -> tuple[float, list[float], int]:
    db, feed = workdir / "db.sqlite3", workdir / "feed.jsonl"
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
               "-s", f"IDEMPOTENT_DATABASE={db}", "-s", "LOG_LEVEL=WARNING",
               "-s", "CONCURRENT_REQUESTS=16", "-s", "CONCURRENT_REQUESTS_PER_DOMAIN=16",
               "-s", f"IDEMPOTENT_FEED_STREAMING={streaming}", "-o", str(feed)]
    process = subprocess.Popen(command, cwd=ROOT / "example_project",
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[str, float] = {}
    offset = 0
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)  # reaped here, not by poll()
        if pid:
            break
        if feed.exists():
            with feed.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            now = time.time()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            offset += len(complete)
            for line in complete.splitlines():
                seen.setdefault(json.loads(line)["sku"], now)
        time.sleep(0.01)
    process.returncode = status
    assert status == 0, status
    cpu = usage.ru_utime + usage.ru_stime
    lags: list[float] = []
    if streaming:
        conn = sqlite3.connect(db)
        for data, seen_at in conn.execute("SELECT data, seen_at FROM records"):
            sku = json.loads(data)["sku"]
            if sku in seen:  # the last lines may only be read after the exit
                lags.append(seen[sku] - seen_at)
        conn.close()
    records = len(feed.read_text().splitlines())
    return cpu, lags, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=50)
    parser.add_argument("--per-page", type=int, default=40)
    args = parser.parse_args()
    print("load before:", os.getloadavg())
    with LocalSite(listing_pages=args.pages, products_per_page=args.per_page) as site:
        for streaming in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                cpu, lags, records = crawl(site.url, Path(tmp), streaming)
            line = f"streaming={streaming}: {records} records, CPU {cpu:.2f} s"
            if lags:
                lags.sort()
                line += (f"; lag median {statistics.median(lags) * 1000:.0f} ms, p95 "
                         f"{lags[int(len(lags) * 0.95)] * 1000:.0f} ms, max "
                         f"{lags[-1] * 1000:.0f} ms over {len(lags)} lines")
            print(line, flush=True)
    print("load after:", os.getloadavg())


if __name__ == "__main__":
    main()
