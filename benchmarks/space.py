"""Disk space benchmark: does the database give back the space of big journaled responses?

    python benchmarks/space.py [--package PATH] [--pages 1000] [--size-mb 1] [--big-mb 0]

A local server answers ``--pages`` pages of ``--size-mb`` MB each (plus, with ``--big-mb``,
one page of that size); a spider crawls them at 16 concurrent requests with the add-on and
the response journal on (the default), one small item per page. The database file and its
``-wal`` are sampled every 0.1 s during the crawl; reported are their peaks, their sizes
after the crawl, the free pages left in the file and the crawl's wall time.

``--package PATH`` puts PATH first on ``PYTHONPATH`` of the crawl, to measure another copy of
the package (a checkout of an earlier commit) on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SPIDER = """
import scrapy


class BigPages(scrapy.Spider):
    name = "big"
    custom_settings = {"ADDONS": {"scrapy_idempotent.Addon": 0},
                       "IDEMPOTENT_NATURAL_KEYS": {"dict": "page"}, "ROBOTSTXT_OBEY": False,
                       "CONCURRENT_REQUESTS": 16, "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
                       "DOWNLOAD_MAXSIZE": 0, "DOWNLOAD_WARNSIZE": 0, "LOG_LEVEL": "INFO",
                       "IDEMPOTENT_LOG_INTERVAL_SECONDS": 0}

    def __init__(self, url, pages, big=0, **kwargs):
        super().__init__(**kwargs)
        self.base, self.pages, self.big = url, int(pages), int(big)

    async def start(self):
        for i in range(1, self.pages + 1):
            yield scrapy.Request(f"{self.base}/page/{i}")
        if self.big:
            yield scrapy.Request(f"{self.base}/big")

    def parse(self, response):
        yield {"page": response.url, "length": len(response.body)}
"""


def serve(size: int, big: int) -> tuple[ThreadingHTTPServer, str]:
    body = (b"<html><body>" + b"x" * size + b"</body></html>")
    big_body = b"<html><body>" + b"y" * big + b"</body></html>"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = big_body if self.path == "/big" else body
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path)
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--big-mb", type=float, default=0.0)
    args = parser.parse_args()
    environment = dict(os.environ)
    if args.package is not None:
        environment["PYTHONPATH"] = str(args.package)
    server, url = serve(int(args.size_mb * 2**20), int(args.big_mb * 2**20))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="space-bench-") as tmp:
        work = Path(tmp)
        (work / "big.py").write_text(SPIDER)
        db = work / "big.sqlite3"
        wal = work / "big.sqlite3-wal"
        began = time.monotonic()
        crawl = subprocess.Popen(
            [sys.executable, "-m", "scrapy", "runspider", str(work / "big.py"), "-a",
             f"url={url}", "-a", f"pages={args.pages}", "-a",
             f"big={int(args.big_mb * 2**20)}", "-s", f"IDEMPOTENT_DATABASE={db}",
             "-s", f"LOG_FILE={work / 'crawl.log'}"],
            cwd=work, env=environment, stdin=subprocess.DEVNULL)
        peak_db = peak_wal = peak_total = 0
        while crawl.poll() is None:
            d, w = size(db), size(wal)
            peak_db, peak_wal, peak_total = max(peak_db, d), max(peak_wal, w), \
                max(peak_total, d + w)
            time.sleep(0.1)
        wall = time.monotonic() - began
        conn = sqlite3.connect(db)
        free, pages, page_size = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in
                                  ("freelist_count", "page_count", "page_size"))
        records = conn.execute("SELECT count(*) FROM records").fetchone()[0]
        journal = conn.execute("SELECT count(*) FROM responses").fetchone()[0]
        final_db, final_wal = size(db), size(wal)
        conn.close()
        log = (work / "crawl.log").read_text(errors="replace")
    server.shutdown()
    mb = 2**20
    print(json.dumps({
        "pages": args.pages, "size_mb": args.size_mb, "big_mb": args.big_mb,
        "exit_code": crawl.returncode, "finished": "Spider closed (finished)" in log,
        "records": records, "journal_rows_left": journal, "wall_seconds": round(wall, 1),
        "peak_db_mb": round(peak_db / mb, 1), "peak_wal_mb": round(peak_wal / mb, 1),
        "peak_db_plus_wal_mb": round(peak_total / mb, 1),
        "final_db_mb": round(final_db / mb, 1), "final_wal_mb": round(final_wal / mb, 1),
        "free_pages": free, "page_count": pages,
        "free_mb": round(free * page_size / mb, 1),
        "load_average_before": load, "load_average_after": os.getloadavg(),
    }, indent=2))


if __name__ == "__main__":
    main()
