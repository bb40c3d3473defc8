"""What one scrape of ``scrapy idempotent metrics`` costs, at frontier sizes.

    python benchmarks/metrics_scrape.py [--sizes 10000,1000000] [--scrapes 5]

For each size N a new SQLite database is prefilled (not timed) with N requests, as a crawl
half-way leaves them: 45% done, 5% failed (three error kinds), 100 leased, the rest pending,
one run with its counters. Then the exporter's scrape is timed ``--scrapes`` times: open the
database read-only, :meth:`~scrapy_idempotent.store.base.FrontierStore.crawl_metrics`, close,
and render the Prometheus text (``prometheus_client.generate_latest``), as the HTTP server does
for each scrape (the first scrape, not timed, reads the frontier-wide figures; later ones
read the cheap figures and start a background read of the frontier-wide ones once ten times
that read's duration has passed); then the frontier-wide read
(:meth:`~scrapy_idempotent.store.base.FrontierStore.crawl_metrics`) and each of the reads it is
made of, once. Prints milliseconds (median and
slowest scrape) per size, with the machine's load average.

The package is imported from the environment: ``PYTHONPATH=/path/to/copy`` measures a copy.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = "bench-host:1:1"
BATCH = 10_000


def _data(url: str) -> str:
    # the shape and size (about 340 bytes) of a RequestCodec encoding of a plain link
    return ('{"url":"' + url + '","callback":"parse","errback":null,"headers":{"Referer":'
            '[{"$bytes":"aHR0cDovLzEyNy4wLjAuMTo4MDgwL2wvMTIuaHRtbA=="}]},"body":{"$bytes":""},'
            '"cookies":{},"meta":{"depth":3},"encoding":"utf-8","flags":[],"cb_kwargs":{},'
            '"dont_filter":false,"method":"GET","priority":0}')


def prefill(db: Path, size: int) -> None:
    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.base import NewRequest, RunMode, UnitOfWork

    store: Any = open_store(str(db), lease_seconds=3600)
    store.open(fingerprinter="benchmarks.metrics_scrape")
    store.begin_session(WORKER, RunMode.FRESH)
    for start in range(0, size, BATCH):
        batch = []
        for i in range(start, min(size, start + BATCH)):
            url = f"http://127.0.0.1:8080/p/{i // 1000}/{i}.html"
            fp = hashlib.sha1(url.encode()).hexdigest()
            batch.append(NewRequest(key=fp, fingerprint=fp, url=url, priority=0,
                                    data=_data(url), parent_key=None))
        store.commit(UnitOfWork(requests=batch), WORKER)
    store.close()
    # the states a crawl half-way leaves (straight in SQL: the benchmark measures reads)
    conn = sqlite3.connect(db)
    now = time.time()
    with conn:
        conn.execute("UPDATE requests SET state = 'done', finished_at = ?, attempts = 1"
                     " WHERE id % 20 < 9", (now,))
        conn.execute("UPDATE requests SET state = 'failed', finished_at = ?, attempts = 2,"
                     " error_kind = CASE id % 3 WHEN 0 THEN 'http_error/404' WHEN 1 THEN"
                     " 'download_error/TimeoutError' ELSE 'callback_error/ValueError' END"
                     " WHERE id % 20 = 9", (now,))
        conn.execute("UPDATE requests SET state = 'leased', worker = ?, leased_until = ?,"
                     " attempts = 1 WHERE id IN (SELECT id FROM requests"
                     " WHERE state = 'pending' LIMIT 100)", (WORKER, now + 3600))
        conn.execute("UPDATE runs SET leased = ?, done = ?, failed = ?",
                     (size // 2, size * 9 // 20, size // 20))
    conn.close()


def measure(db: Path, scrapes: int) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    from scrapy_idempotent.metrics import StoreCollector
    from scrapy_idempotent.store import open_store

    def opened() -> Any:
        store = open_store(str(db))
        store.open_existing(readonly=True)
        return store

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(opened))
    generate_latest(registry)  # warm the file cache, as a crawl's database is
    times = []
    for _ in range(scrapes):
        t0 = time.perf_counter()
        text = generate_latest(registry)
        times.append((time.perf_counter() - t0) * 1000)
    assert b"idempotent_store_up 1.0" in text, text[:500]
    store = opened()
    t0 = time.perf_counter()
    store.crawl_metrics()
    frontier_ms = (time.perf_counter() - t0) * 1000
    parts = {}
    for name in ("counts", "runs", "failure_counts", "request_summary", "lease_holders",
                 "live_workers", "outbox_counts"):
        t0 = time.perf_counter()
        getattr(store, name)()
        parts[name] = (time.perf_counter() - t0) * 1000
    store.close()
    return {"median_ms": statistics.median(times), "max_ms": max(times), "parts": parts,
            "frontier_ms": frontier_ms,
            "db_mb": sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--scrapes", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            db = Path(tmp) / f"metrics-{size}.sqlite3"
            t0 = time.perf_counter()
            prefill(db, size)
            print(f"{size:>10,} requests: prefilled in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            result = measure(db, args.scrapes)
            rows.append((size, result))
            for p in Path(tmp).glob(db.name + "*"):
                p.unlink()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n| requests | scrape, median ms | slowest ms | frontier-wide read ms | database MB | "
          + " | ".join(rows[0][1]["parts"]) + " (ms) |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(rows[0][1]["parts"]))
    for size, r in rows:
        print(f"| {size:,} | {r['median_ms']:.1f} | {r['max_ms']:.1f} | {r['frontier_ms']:.0f} | "
              f"{r['db_mb']:.0f} | "
              + " | ".join(f"{v:.1f}" for v in r["parts"].values()) + " |")


if __name__ == "__main__":
    main()
