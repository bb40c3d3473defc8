"""Claims under crawl-wide politeness against the number of sites in the frontier.

    python benchmarks/sites.py --sites 1000,10000,100000
    python benchmarks/sites.py --sites 1000,10000 --postgres

A broad crawl's frontier holds requests of many sites (download slots). With
``IDEMPOTENT_POLITENESS = "crawl"`` (the default) a claim reads the slots that may send. For
each number of sites N, a new frontier (a SQLite file, or a schema of a throwaway PostgreSQL
cluster with ``--postgres``, or of ``--database URL``) gets ``--per-site`` pending requests of
each of N sites through the package's write path (``FrontierStore.commit``, in transactions of
10,000), the crawl's slot limits (one request at a time per site, no delay), then
``--claims`` claims of ``--count`` requests each, each its own transaction as the scheduler
makes them, timed one by one. Printed per N: the median and p90 claim in milliseconds, the
requests each took, and the milliseconds per request claimed; the load average before and
after. The package is imported from the environment (``PYTHONPATH=/path/to/copy`` measures a
copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def build(store: Any, sites: int, per_site: int) -> float:
    from scrapy_idempotent.store import NewRequest, UnitOfWork
    from scrapy_idempotent.store.base import SlotLimits

    store.open()
    store.begin_session("sites-bench", "resume")
    store.keep_slot_limits(SlotLimits(concurrency=1))
    total = sites * per_site
    started = time.perf_counter()
    for first in range(0, total, 10_000):
        requests = [NewRequest(key=f"{n:040x}", fingerprint=f"{n:040x}",
                               url=f"https://site-{n % sites}.test/page/{n // sites}",
                               priority=0, data="{}", slot=f"site-{n % sites}.test")
                    for n in range(first, min(first + 10_000, total))]
        store.commit(UnitOfWork(requests=requests), "sites-bench")
    return time.perf_counter() - started


def claims(store: Any, count: int, rounds: int) -> dict[str, float]:
    from scrapy_idempotent.store import UnitOfWork

    times: list[float] = []
    taken: list[int] = []
    for _ in range(rounds):
        started = time.perf_counter()
        result = store.commit(UnitOfWork(claim=count), "sites-bench")
        times.append((time.perf_counter() - started) * 1000)
        taken.append(len(result.leased))
    times.sort()
    median = statistics.median(times)
    per_claim = statistics.mean(taken)
    return {"claim_ms_median": round(median, 2),
            "claim_ms_p90": round(times[int(len(times) * 0.9) - 1], 2),
            "requests_per_claim": round(per_claim, 1),
            "ms_per_request": round(median / per_claim, 3) if per_claim else float("nan")}


def measure(make: Any, sites: int, args: argparse.Namespace) -> dict[str, Any]:
    store = make(sites)
    try:
        built = build(store, sites, args.per_site)
        out = {"sites": sites, "pending": sites * args.per_site, "built_s": round(built, 1)}
        out.update(claims(store, args.count, args.claims))
    finally:
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", default="1000,10000,100000",
                        help="numbers of sites, comma-separated")
    parser.add_argument("--per-site", type=int, default=5)
    parser.add_argument("--count", type=int, default=16, help="requests asked by a claim")
    parser.add_argument("--claims", type=int, default=50)
    parser.add_argument("--postgres", action="store_true",
                        help="a throwaway PostgreSQL cluster (tests/postgres_server.py)")
    parser.add_argument("--database", help="a postgresql:// URL (a schema per size)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sites.split(",")]
    print("load average before:", os.getloadavg(), flush=True)

    def run(url: str | None) -> None:
        directory = tempfile.mkdtemp(prefix="sites-bench-")

        def make(sites: int) -> Any:
            if url is None:
                from scrapy_idempotent.store.sqlite import SQLiteStore

                return SQLiteStore(str(Path(directory) / f"sites-{sites}.sqlite3"))
            from scrapy_idempotent.store.postgresql import PostgreSQLStore

            separator = "&" if "?" in url else "?"
            return PostgreSQLStore(f"{url}{separator}schema=sites_{sites}",
                                   heartbeat_seconds=None, dead_after_seconds=None)

        for sites in sizes:
            print(json.dumps({"store": "sqlite" if url is None else "postgresql",
                              **measure(make, sites, args)}), flush=True)

    if args.database:
        run(args.database)
    elif args.postgres:
        sys.path.insert(0, str(ROOT / "tests"))
        from postgres_server import INSTALL_HINT, find_binaries, running_cluster

        bindir = find_binaries()
        if bindir is None:
            sys.exit(INSTALL_HINT)
        with running_cluster(bindir) as cluster:
            run(cluster.new_database())
    else:
        run(None)
    print("load average after:", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
