"""Resume benchmark: how fast a crawl gets back to work after a SIGKILL.

    python benchmarks/resume.py [--package PATH] [--only inflight|starts] [--starts N]

Two scenarios, each crawl a real ``scrapy runspider`` of a spider script in a subprocess,
against the example shop (``example_project/shop/site.py``) on
127.0.0.1:

* ``inflight``: ``CONCURRENT_REQUESTS`` = ``CONCURRENT_REQUESTS_PER_DOMAIN`` = 300 against
  a shop of 15,000 products answering after ``--delay`` seconds (default 1), crawled by a
  spider whose start requests are the 300 listing pages, so that about 300 requests are on
  the wire. Once product pages flow (1,000 records stored, 200 requests on the wire), the
  download rate over ``--warmup`` seconds (default 12; requests reaching the site per
  second) is the reference, and the crawl is SIGKILLed. The crawl is started again:
  reported are the seconds from the new process's start until a window of twice the delay
  (requests leave in waves) first reaches 80% of the reference rate, and until every
  request that was on the wire at the kill (in flight, not journaled) has reached the site
  again (capped by ``--cap``).
* ``starts``: a spider whose ``start()`` yields N start requests (default 150,000). A first
  crawl enqueues them all and is SIGKILLed; the database is then changed so that all but the
  last 1,000 are done and those 1,000 are unknown (as if the first crawl had done them before
  reaching the end of the list). Reported: seconds from the start of the resumed crawl to its
  first download (which needs start() to be replayed up to the 1,000 new requests), and to
  the end of the crawl.

``--package PATH`` puts PATH first on ``PYTHONPATH`` of the crawls, to measure another copy
of the package (a checkout of an earlier commit) on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
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

from shop.site import ShopSite  # noqa: E402


def env(package: Path | None) -> dict[str, str]:
    environment = dict(os.environ)
    if package is not None:
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(package), environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return environment


WIDE_SPIDER = """
import scrapy


class WideShop(scrapy.Spider):
    # the shop, every listing page a start request: hundreds of products on the wire
    name = "wide"
    custom_settings = {"ADDONS": {"scrapy_idempotent.Addon": 0},
                       "IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}, "ROBOTSTXT_OBEY": False}

    def __init__(self, url, listings, **kwargs):
        super().__init__(**kwargs)
        self.base, self.listings = url, int(listings)

    async def start(self):
        for n in range(1, self.listings + 1):
            yield scrapy.Request(f"{self.base}/list/{n}", dont_filter=True)

    def parse(self, response):
        yield from response.follow_all(css="a.product", callback=self.parse_product)

    def parse_product(self, response):
        yield {"sku": response.css("span.sku::text").get(),
               "price": response.css("span.price::text").get()}
"""


def shop_crawl(site: ShopSite, db: Path, log: Path, package: Path | None,
               *settings: str) -> subprocess.Popen[bytes]:
    spider = log.parent / "wide.py"
    spider.write_text(WIDE_SPIDER)
    command = [sys.executable, "-m", "scrapy", "runspider", str(spider), "-a",
               f"url={site.url}", "-a", "listings=300", "-s", f"IDEMPOTENT_DATABASE={db}",
               "-s", f"LOG_FILE={log}", "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=log.parent, env=env(package),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def sample(site: ShopSite, seconds: float, until: Any = None) -> list[tuple[float, int]]:
    """``(monotonic time, requests so far)`` every 0.1 s for ``seconds`` (or until
    ``until()``)."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until is not None and until()):
        samples.append((time.monotonic(), site.request_count))
        time.sleep(0.1)
    return samples


def rate(samples: list[tuple[float, int]], start: float, end: float) -> float:
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def records(db: Path) -> int:
    try:
        conn = sqlite3.connect(db, timeout=30)
        try:
            return int(conn.execute("SELECT count(*) FROM records").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def inflight(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    db = work / "inflight.sqlite3"
    settings = ("CONCURRENT_REQUESTS=300", "CONCURRENT_REQUESTS_PER_DOMAIN=300",
                "DOWNLOAD_TIMEOUT=60", "IDEMPOTENT_LOG_INTERVAL_SECONDS=0")
    with ShopSite(port=0, listing_pages=300, products_per_page=50, delay=args.delay) as site:
        first = shop_crawl(site, db, work / "first.log", args.package, *settings)
        try:
            # steady state: product pages flowing (the listing pages are processed)
            while site.in_flight < 200 or records(db) < 1000:
                if first.poll() is not None:
                    raise SystemExit("the first crawl ended early; see first.log")
                time.sleep(0.2)
            before = sample(site, args.warmup)
            peak_in_flight = max(site.in_flight, 0)
            first.kill()
            first.wait()
            killed_at = time.monotonic()
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        reference = rate(before, killed_at - args.warmup, killed_at)
        while site.in_flight:
            time.sleep(0.05)
        conn = sqlite3.connect(db)
        suspects = {url.split("/", 3)[3] for (url,) in conn.execute(
            "SELECT url FROM requests WHERE state = 'leased' AND unfinished > 0"
            " AND key NOT IN (SELECT key FROM responses)")}  # journaled ones are not fetched
        conn.close()
        site.reset_counts()
        started = time.monotonic()
        second = shop_crawl(site, db, work / "second.log", args.package, *settings)
        seen: set[str] = set()

        def replayed() -> bool:
            seen.update(path.lstrip("/") for path, _ in site.arrivals()
                        if path.lstrip("/") in suspects)
            return len(seen) >= len(suspects)

        try:
            after = sample(site, args.cap, until=replayed)
        finally:
            second.kill()
            second.wait()
        replay_seconds = (time.monotonic() - started) if replayed() else None
    # requests leave in waves of the server's delay: rates over a window of twice the delay
    window = max(2.0, 2 * args.delay)
    reached = None
    for t, _ in after:
        if t - started >= window and rate(after, t - window, t) >= 0.8 * reference:
            reached = round(t - started, 1)
            break
    windows = [round(rate(after, started + i, started + i + window), 1)
               for i in range(0, int(min(args.cap, after[-1][0] - started - window)), 2)]
    return {"reference_rate_per_s": round(reference, 1), "in_flight_at_kill": peak_in_flight,
            "suspects": len(suspects), "seconds_to_80_percent": reached,
            "seconds_to_replay_all_in_flight": (round(replay_seconds, 1)
                                                if replay_seconds is not None else None),
            "replayed_within_cap": len(seen), "cap_seconds": args.cap,
            "rate_window_seconds": window,
            "rate_every_2_seconds_after_restart": windows[:20]}


START_SPIDER = """
import scrapy


class ManyStarts(scrapy.Spider):
    name = "starts"
    custom_settings = {"ADDONS": {"scrapy_idempotent.Addon": 0},
                       "IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}, "ROBOTSTXT_OBEY": False,
                       "CONCURRENT_REQUESTS": 16, "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
                       "LOG_LEVEL": "INFO", "IDEMPOTENT_LOG_INTERVAL_SECONDS": 0}

    def __init__(self, url, count, **kwargs):
        super().__init__(**kwargs)
        self.base, self.count = url, int(count)

    async def start(self):
        for i in range(1, self.count + 1):
            yield scrapy.Request(f"{self.base}/product/SKU-{i % 500 + 1:05d}?n={i}",
                                 dont_filter=True)

    def parse(self, response):
        yield {"sku": response.url}
"""


def starts(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    db = work / "starts.sqlite3"
    spider = work / "starts.py"
    spider.write_text(START_SPIDER)
    new = 1000

    def crawl(log: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "scrapy", "runspider", str(spider), "-a",
             f"url={site.url}", "-a", f"count={args.starts}",
             "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={work / log}"],
            cwd=work, env=env(args.package), stdin=subprocess.DEVNULL)

    with ShopSite(port=0, delay=0.05) as site:
        first = crawl("starts-first.log")
        try:
            while True:
                time.sleep(1)
                try:
                    conn = sqlite3.connect(db, timeout=30)
                    rows = conn.execute("SELECT count(*) FROM requests").fetchone()[0]
                    conn.close()
                except sqlite3.Error:
                    rows = 0
                if rows >= args.starts:
                    break
                if first.poll() is not None:
                    raise SystemExit("the first crawl ended early")
            first.kill()
            first.wait()
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        last = conn.execute("SELECT max(id) FROM requests").fetchone()[0]
        conn.execute("DELETE FROM requests WHERE id > ?", (last - new,))
        conn.execute("UPDATE requests SET state = 'done', worker = NULL, leased_until = NULL,"
                     " unfinished = 0, attempts = max(attempts, 1), finished_at = enqueued_at")
        conn.execute("DELETE FROM responses")
        conn.execute("COMMIT")
        conn.close()
        site.reset_counts()
        began = time.monotonic()
        second = crawl("starts-second.log")
        first_download = None
        try:
            while second.poll() is None:
                if first_download is None and site.request_count:
                    first_download = time.monotonic() - began
                time.sleep(0.02)
            if first_download is None and site.request_count:
                first_download = time.monotonic() - began
        finally:
            if second.poll() is None:
                second.kill()
                second.wait()
        ended = time.monotonic() - began
        fetched = site.request_count
    return {"start_requests": args.starts, "known": args.starts - new, "new": new,
            "seconds_to_first_download": (round(first_download, 1)
                                          if first_download is not None else None),
            "seconds_to_finish": round(ended, 1), "requests_fetched": fetched,
            "exit_code": second.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, help="package root to put first on PYTHONPATH")
    parser.add_argument("--only", choices=("inflight", "starts"))
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--warmup", type=float, default=12.0)
    parser.add_argument("--cap", type=float, default=60.0)
    parser.add_argument("--starts", type=int, default=150_000)
    args = parser.parse_args()
    results: dict[str, Any] = {"load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="resume-bench-") as tmp:
        work = Path(tmp)
        if args.only in (None, "inflight"):
            results["inflight"] = inflight(args, work)
        if args.only in (None, "starts"):
            results["starts"] = starts(args, work)
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
