"""Politeness for the whole crawl: per-site limits over several workers, and throughput.

``python benchmarks/politeness.py [--workers 1,2,4] [--limits 1,2,4] [--sites 8]
[--modes crawl] [--delay 0]``

Serves ``--sites`` sites, each on a loopback address of its own (127.0.0.10, .11, ...: one
download slot each), each answering a page in ``--answer-seconds`` and recording the
requests it has in flight and when each arrived. For every per-site limit L
(``CONCURRENT_REQUESTS_PER_DOMAIN = L``) and every number of workers W, W ``scrapy
runspider`` processes crawl one frontier (a new SQLite file) with
``IDEMPOTENT_POLITENESS`` each of ``--modes`` (``crawl``, ``worker``), ``DOWNLOAD_DELAY =
--delay`` and ``CONCURRENT_REQUESTS = --per-worker``, each yielding the same ``--pages``
pages of every site. Printed per crawl: pages/s (first request to last answer at the
sites), the most requests any site had in flight (never above L when the limits hold), each
page fetched once, the pages each worker fetched (told by its ``USER_AGENT``), and the
workers' CPU seconds.

While the sites have room (``sites x L`` above what one worker sends at once), the crawl's
rate grows with its workers; once every site is at its limit, more workers add nothing, and
no site sees more than L at once, however many workers there are.
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SPIDER = '''
import scrapy


class SitesSpider(scrapy.Spider):
    name = "sites"
    custom_settings = {
        "ADDONS": {"scrapy_idempotent.Addon": 0}, "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "LOG_LEVEL": "WARNING", "IDEMPOTENT_NATURAL_KEYS": {"dict": "url"}}

    def __init__(self, sites, pages, **kwargs):
        super().__init__(**kwargs)
        self.sites, self.pages = sites.split(","), int(pages)

    async def start(self):
        for n in range(self.pages):  # the sites interleaved, as a seed list would be
            for site in self.sites:
                yield scrapy.Request(f"{site}/p{n}", dont_filter=True)

    def parse(self, response):
        yield {"url": response.url}
'''


class Site(ThreadingHTTPServer):
    """Answers every GET after ``answer_seconds``; counts requests in flight."""

    daemon_threads = True

    def __init__(self, host: str, answer_seconds: float) -> None:
        self.answer_seconds = answer_seconds
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0
        self.arrivals: list[float] = []
        self.answered_at = 0.0
        self.paths: dict[str, int] = {}
        self.agents: dict[str, int] = {}  # requests per worker (its User-Agent)
        super().__init__((host, 0), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Site

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        site = self.server
        with site.lock:
            site.in_flight += 1
            site.most_in_flight = max(site.most_in_flight, site.in_flight)
            site.arrivals.append(time.monotonic())
            site.paths[self.path] = site.paths.get(self.path, 0) + 1
            agent = self.headers.get("User-Agent", "")
            site.agents[agent] = site.agents.get(agent, 0) + 1
        try:
            time.sleep(site.answer_seconds)
            body = b"<html><body>ok</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        finally:
            with site.lock:
                site.in_flight -= 1
                site.answered_at = time.monotonic()


def crawl(workdir: Path, spider: Path, sites: list[Site], *, workers: int, limit: int,
          per_worker: int, pages: int, mode: str = "crawl",
          delay: float = 0.0, repetition: int = 0) -> dict[str, Any]:
    database = workdir / f"{mode}-w{workers}-l{limit}-r{repetition}.sqlite3"
    command = [sys.executable, "-m", "scrapy", "runspider", str(spider), "-L", "WARNING",
               "-a", "sites=" + ",".join(site.url for site in sites), "-a", f"pages={pages}",
               "-s", f"IDEMPOTENT_DATABASE={database}",
               "-s", f"CONCURRENT_REQUESTS={per_worker}",
               "-s", f"CONCURRENT_REQUESTS_PER_DOMAIN={limit}",
               "-s", f"IDEMPOTENT_POLITENESS={mode}", "-s", f"DOWNLOAD_DELAY={delay}",
               "-s", "IDEMPOTENT_RUN_MODE=resume"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    processes = [subprocess.Popen([*command, "-s", f"USER_AGENT=worker-{n}"], cwd=workdir,
                                  stdin=subprocess.DEVNULL)
                 for n in range(workers)]
    codes = [process.wait() for process in processes]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    first = min(site.arrivals[0] for site in sites if site.arrivals)
    last = max(site.answered_at for site in sites)
    fetched = sum(len(site.arrivals) for site in sites)
    return {
        "workers": workers, "limit": limit, "codes": codes, "mode": mode,
        "pages/s": fetched / (last - first),
        "most in flight": max(site.most_in_flight for site in sites),
        "each page once": all(set(site.paths.values()) == {1} and len(site.paths) == pages
                              for site in sites),
        "per worker": [sum(site.agents.get(f"worker-{n}", 0) for site in sites)
                       for n in range(workers)],
        "cpu s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="numbers of workers (default 1,2,4)")
    parser.add_argument("--limits", default="1,2,4",
                        help="CONCURRENT_REQUESTS_PER_DOMAIN values (default 1,2,4)")
    parser.add_argument("--sites", type=int, default=8, help="sites (default 8)")
    parser.add_argument("--pages", type=int, default=40, help="pages per site (default 40)")
    parser.add_argument("--per-worker", type=int, default=4,
                        help="CONCURRENT_REQUESTS of each worker (default 4)")
    parser.add_argument("--modes", default="crawl",
                        help="IDEMPOTENT_POLITENESS values (default crawl)")
    parser.add_argument("--delay", type=float, default=0.0,
                        help="DOWNLOAD_DELAY (default 0)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="crawls of each combination, alternating (default 1)")
    parser.add_argument("--answer-seconds", type=float, default=0.2,
                        help="each site's time to answer (default 0.2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="idempotent-politeness-") as tmp:
        workdir = Path(tmp)
        spider = workdir / "sites_spider.py"
        spider.write_text(SPIDER)
        print(f"{args.sites} sites answering in {args.answer_seconds} s, {args.pages} pages "
              f"each, CONCURRENT_REQUESTS={args.per_worker} per worker, DOWNLOAD_DELAY="
              f"{args.delay}; load average {os.getloadavg()[0]:.2f} at the start")
        print("| mode | per-site limit | workers | pages/s | most in flight at a site | "
              "limits held | each page once | pages per worker | workers' CPU s | exit codes |")
        print("|---|---:|---:|---:|---:|---|---|---|---:|---|")
        for limit, workers, repetition, mode in itertools.product(
                (int(v) for v in args.limits.split(",")),
                [int(v) for v in args.workers.split(",")], range(args.repeat),
                args.modes.split(",")):
            sites = [Site(f"127.0.0.{10 + n}", args.answer_seconds)
                     for n in range(args.sites)]
            threads = [threading.Thread(target=site.serve_forever, daemon=True)
                       for site in sites]
            for thread in threads:
                thread.start()
            try:
                row = crawl(workdir, spider, sites, workers=workers, limit=limit,
                            per_worker=args.per_worker, pages=args.pages, mode=mode,
                            delay=args.delay, repetition=repetition)
            finally:
                for site in sites:
                    site.shutdown()
                    site.server_close()
            print(f"| {mode} | {limit} | {workers} | {row['pages/s']:.1f} | "
                  f"{row['most in flight']} | "
                  f"{'yes' if row['most in flight'] <= limit else 'NO'} | "
                  f"{'yes' if row['each page once'] else 'NO'} | "
                  f"{', '.join(map(str, row['per worker']))} | {row['cpu s']:.1f} | "
                  f"{','.join(map(str, row['codes']))} |", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
