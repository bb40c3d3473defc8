"""Crawl benchmark on PostgreSQL: 1, 2 and 4 worker processes on one crawl.

    python benchmarks/postgresql_workers.py [--workers 1,2,4] [--listing-pages 100]
        [--products-per-page 40] [--concurrency 16] [--database URL]

Starts the example shop (``example_project/shop/site.py``) with the given size and, without
``--database``, a throwaway PostgreSQL cluster (the tests' ``tests/postgres_server.py``). For
each worker count, on a fresh database: that many ``scrapy crawl shop`` processes of the
example project started at once (``IDEMPOTENT_RUN_MODE = resume``, so the late ones join the
run), run until every one has finished. Reported: pages/s (all pages over the wall time from
the first start to the last exit), write transactions per page (``idempotent/transactions``
summed over the workers' stats), CPU seconds of all the worker processes, requests the shop
served (pages fetched twice show here), records stored, and each worker's finish reason.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
EXAMPLE = ROOT / "example_project"
sys.path.insert(0, str(EXAMPLE))
sys.path.insert(0, str(ROOT / "tests"))


def stat(log: str, name: str) -> Any:
    match = re.search(rf"'{re.escape(name)}': ([^,\n]+)", log)
    return None if match is None else ast.literal_eval(match.group(1))


def run(workers: int, url: str, site: Any, concurrency: int, tmp: Path) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:  # a fresh crawl
        for (schema,) in conn.execute(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%'").fetchall():
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    site.reset_counts()
    logs = [tmp / f"w{workers}-{n}.log" for n in range(workers)]
    began = time.monotonic()
    processes = [subprocess.Popen(
        [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site.url}",
         "-s", f"IDEMPOTENT_DATABASE={url}", "-s", f"LOG_FILE={log}", "-s", "LOG_LEVEL=INFO",
         "-s", "IDEMPOTENT_RUN_MODE=resume", "-s", f"CONCURRENT_REQUESTS={concurrency}",
         "-s", f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
         "-s", "TELNETCONSOLE_ENABLED=False"],
        cwd=EXAMPLE, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT) for log in logs]
    cpu = 0.0
    for process in processes:
        _, _status, usage = os.wait4(process.pid, 0)
        cpu += usage.ru_utime + usage.ru_stime
    wall = time.monotonic() - began
    texts = [log.read_text(errors="replace") for log in logs]
    transactions = sum(stat(t, "idempotent/transactions") or 0 for t in texts)
    with psycopg.connect(url, autocommit=True) as conn:
        [schema] = [name for (name,) in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%'")]
        (records,) = conn.execute(f'SELECT count(*) FROM "{schema}".records').fetchone() or (0,)
    pages = site.page_count
    return {"workers": workers, "pages": pages, "wall_s": round(wall, 2),
            "pages_per_s": round(pages / wall, 1), "cpu_s": round(cpu, 1),
            "transactions_per_page": round(transactions / pages, 3),
            "requests": site.request_count, "records": records,
            "reasons": [stat(t, "finish_reason") for t in texts],
            "wakeups": sum(stat(t, "idempotent/wakeups") or 0 for t in texts),
            "load": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--listing-pages", type=int, default=100)
    parser.add_argument("--products-per-page", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--database", help="a postgresql:// URL (default: a throwaway cluster)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from shop.site import ShopSite

    results = []
    with tempfile.TemporaryDirectory(prefix="idempotent-pgworkers-") as tmp, \
            ShopSite(port=0, listing_pages=args.listing_pages,
                     products_per_page=args.products_per_page) as site:

        def measure(url: str) -> None:
            for workers in (int(n) for n in args.workers.split(",")):
                result = run(workers, url, site, args.concurrency, Path(tmp))
                results.append(result)
                print(json.dumps(result), flush=True)

        if args.database:
            measure(args.database)
        else:
            from postgres_server import INSTALL_HINT, find_binaries, running_cluster

            bindir = find_binaries()
            if bindir is None:
                raise SystemExit(INSTALL_HINT)
            with running_cluster(bindir) as cluster:
                measure(cluster.new_database())
    print("\n| workers | pages | wall s | pages/s | CPU s (all workers) | transactions/page "
          "| requests | records | finish reasons | wake-ups | load |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in results:
        print(f"| {r['workers']} | {r['pages']:,} | {r['wall_s']} | {r['pages_per_s']} | "
              f"{r['cpu_s']} | {r['transactions_per_page']} | {r['requests']:,} | "
              f"{r['records']:,} | {', '.join(map(str, r['reasons']))} | {r['wakeups']} | "
              f"{r['load']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
