"""What one scrape of ``scrapy idempotent metrics`` costs, at frontier sizes.

    python benchmarks/metrics_scrape.py [--sizes 10000,1000000] [--scrapes 5] [--postgres]
                                        [--chart-rows]

For each size N a new SQLite database (``--postgres``: a new database of a throwaway
PostgreSQL cluster, the tests' ``tests/postgres_server.py``) is prefilled (not timed) with N
requests, as a crawl half-way leaves them: 45% done, 5% failed (three error kinds), 100 leased,
the rest pending, one run with its counters, a day of progress samples (1,440). Then the
exporter's scrape is timed ``--scrapes`` times: open the
database read-only, :meth:`~scrapy_idempotent.store.base.FrontierStore.crawl_metrics`, close,
and render the Prometheus text (``prometheus_client.generate_latest``), as the HTTP server does
for each scrape (the first scrape, not timed, reads the frontier-wide figures; later ones
read the cheap figures and start a read of the frontier-wide ones on a thread once ten times
that read's duration has passed, waited for when it took a second or less: the timed
scrapes come sooner than that, so they measure the cheap part); then the frontier-wide read
(:meth:`~scrapy_idempotent.store.base.FrontierStore.crawl_metrics`) and each of the reads it is
made of, once; and the read of the chart of ``status --chart`` (from the samples; with
``--chart-rows`` also counted from the stored rows, as for a run without samples). Prints
milliseconds (median and slowest scrape) per size, with the machine's load average.

The package is imported from the environment: ``PYTHONPATH=/path/to/copy`` measures a copy.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sqlite3
import statistics
import sys
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


def prefill(db: str, size: int) -> None:
    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.base import NewRequest, RunMode, UnitOfWork

    store: Any = open_store(db, lease_seconds=3600)
    store.open(fingerprinter="benchmarks.metrics_scrape")
    store.begin_session(WORKER, RunMode.FRESH)
    schema = getattr(store, "schema", None)
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
    now = time.time()
    statements = [
        ("UPDATE requests SET state = 'done', finished_at = ?, attempts = 1"
         " WHERE id % 20 < 9", (now,)),
        ("UPDATE requests SET state = 'failed', finished_at = ?, attempts = 2,"
         " error_kind = CASE id % 3 WHEN 0 THEN 'http_error/404' WHEN 1 THEN"
         " 'download_error/TimeoutError' ELSE 'callback_error/ValueError' END"
         " WHERE id % 20 = 9", (now,)),
        ("UPDATE requests SET state = 'leased', worker = ?, leased_until = ?,"
         " attempts = 1 WHERE id IN (SELECT id FROM requests"
         " WHERE state = 'pending' LIMIT 100)", (WORKER, now + 3600)),
        (f"UPDATE {'sessions' if schema else 'runs'} SET leased = ?, done = ?, failed = ?",
         (size // 2, size * 9 // 20, size // 20)),
    ]
    samples = [(1, slot, now - 60 * (1440 - slot), *(slot * size // 2880 for _ in range(10)), 50)
               for slot in range(1440)]
    sample_sql = "INSERT INTO samples VALUES (" + ", ".join("?" * 14) + ")"
    if schema is None:
        conn = sqlite3.connect(db)
        with conn:
            for sql, params in statements:
                conn.execute(sql, params)
            conn.executemany(sample_sql, samples)
        conn.close()
        return
    import psycopg

    with psycopg.connect(db, autocommit=False) as pg:
        pg.execute(f"SET search_path TO {schema}")
        for sql, params in statements:
            pg.execute(sql.replace("%", "%%").replace("?", "%s"), params)
        with pg.cursor() as cur:
            cur.executemany(sample_sql.replace("?", "%s"), samples)
        pg.commit()
    with psycopg.connect(db, autocommit=True) as pg:  # as autovacuum leaves a table
        pg.execute(f"SET search_path TO {schema}")
        pg.execute("VACUUM ANALYZE")


def measure(db: str, scrapes: int, chart_rows: bool) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, generate_latest

    from scrapy_idempotent.commands import chart
    from scrapy_idempotent.metrics import StoreCollector
    from scrapy_idempotent.store import open_store

    def opened() -> Any:
        store = open_store(db)
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
                 "live_workers", "heartbeats", "outbox_counts", "outbox_backlog"):
        t0 = time.perf_counter()
        getattr(store, name)()
        parts[name] = (time.perf_counter() - t0) * 1000
    t0 = time.perf_counter()
    _, series = chart.per_minute(store)
    chart_ms = (time.perf_counter() - t0) * 1000
    assert sum(series["pages done"].values()), series
    rows_ms = None
    if chart_rows:
        t0 = time.perf_counter()
        chart.from_rows(store, 1)
        rows_ms = (time.perf_counter() - t0) * 1000
    store.close()
    return {"median_ms": statistics.median(times), "max_ms": max(times), "parts": parts,
            "frontier_ms": frontier_ms, "chart_ms": chart_ms, "chart_rows_ms": rows_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--postgres", action="store_true",
                        help="start a throwaway PostgreSQL cluster and measure on it")
    parser.add_argument("--chart-rows", action="store_true",
                        help="also time the chart counted from the stored rows")
    args = parser.parse_args()
    if args.postgres:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from postgres_server import INSTALL_HINT, find_binaries, running_cluster

        bindir = find_binaries()
        if bindir is None:
            raise SystemExit(INSTALL_HINT)
        with running_cluster(bindir) as cluster:
            print(f"PostgreSQL from {bindir}", flush=True)
            _measure(args, cluster.new_database)
        return
    with tempfile.TemporaryDirectory() as tmp:
        sizes = iter(range(1000))
        _measure(args, lambda: str(Path(tmp) / f"metrics-{next(sizes)}.sqlite3"))


def _measure(args: argparse.Namespace, new_database: Any) -> None:
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        db = new_database()
        t0 = time.perf_counter()
        prefill(db, size)
        print(f"{size:>10,} requests: prefilled in {time.perf_counter() - t0:.1f} s",
              flush=True)
        result = measure(db, args.scrapes, args.chart_rows)
        rows.append((size, result))
        if not args.postgres:
            for p in Path(db).parent.glob(Path(db).name + "*"):
                p.unlink()
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n| requests | scrape, median ms | slowest ms | frontier-wide read ms | chart ms | "
          "chart from rows ms | " + " | ".join(rows[0][1]["parts"]) + " (ms) |")
    print("|---:|---:|---:|---:|---:|---:|" + "---:|" * len(rows[0][1]["parts"]))
    for size, r in rows:
        from_rows = "-" if r["chart_rows_ms"] is None else f"{r['chart_rows_ms']:.0f}"
        print(f"| {size:,} | {r['median_ms']:.1f} | {r['max_ms']:.1f} | {r['frontier_ms']:.0f} | "
              f"{r['chart_ms']:.1f} | {from_rows} | "
              + " | ".join(f"{v:.1f}" for v in r["parts"].values()) + " |")


if __name__ == "__main__":
    main()
