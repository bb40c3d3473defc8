"""Recrawls with and without conditional requests: bytes and requests per recrawl.

A static shop (``tests/static_shop.py``: listing pages of 99 products, product pages of
``--filler`` characters of description) served by nginx (``ETag`` and ``Last-Modified``;
without nginx, the standard library's server, ``Last-Modified`` only), crawled once, then
``--changed`` percent of the products get a new price and the shop is crawled again, twice:
with ``IDEMPOTENT_CONDITIONAL_REQUESTS`` off (a full recrawl, as before) and on. Each crawl is
``python tests/static_shop.py`` in a subprocess of its own on a copy of the first crawl's
SQLite database. Prints, per recrawl: requests sent, responses 200 and 304, bytes received
(Scrapy's ``downloader/response_bytes``: status lines, headers and bodies), records updated
and unchanged, and the wall time; the figures go in docs/recrawls.rst. Then the conditional
recrawl once more, SIGKILLed ``--kills`` times at random moments (by the site's progress)
and run to its end: the requests the site served, and the records (from the database).
Each recrawl's feed (JSON lines) is checked: every product once, at its new price if it
changed.

    python benchmarks/recrawl.py [--pages 10000] [--changed 1] [--filler 8000] [--kills 5]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

from static_shop import (  # noqa: E402
    StaticSite,
    change_products,
    new_price,
    old_price,
    sku,
    write_shop,
)

from crawling import kill_crawls  # noqa: E402
from helpers.stored import stored_runs  # noqa: E402


def stats_of(log: Path) -> dict[str, Any]:
    """The stats Scrapy dumped at the end of a crawl log."""
    text = log.read_text(errors="replace")
    dump = text[text.rindex("Dumping Scrapy stats:") + len("Dumping Scrapy stats:"):]
    dump = dump[:dump.index("}") + 1]
    dump = re.sub(r"datetime\.datetime\([^)]*\)", "None", dump)
    stats: dict[str, Any] = ast.literal_eval(dump.strip())
    return stats


def command(url: str, db: Path, conditional: bool, feed: Path) -> list[str]:
    return [sys.executable, str(TESTS / "static_shop.py"), "--url", url, "--db", str(db),
            "-s", f"IDEMPOTENT_CONDITIONAL_REQUESTS={str(conditional).lower()}",
            "-s", "CONCURRENT_REQUESTS=32", "-s", "CONCURRENT_REQUESTS_PER_DOMAIN=32",
            "-s", "FEEDS=" + json.dumps({str(feed): {"format": "jsonlines"}})]


def crawl(url: str, db: Path, log: Path, conditional: bool) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    subprocess.run([*command(url, db, conditional, log.with_suffix(".jsonl")),
                    "-s", f"LOG_FILE={log}"], check=True, stdin=subprocess.DEVNULL)
    return stats_of(log), time.monotonic() - started


def body_bytes(site: StaticSite, lines: tuple[int, int]) -> int | None:
    """The body bytes nginx served for the requests of its access log's ``lines`` (a
    range; None without nginx): a killed crawl's Scrapy stats are lost with it."""
    log = site.conf_dir / "access.log"
    if not site.nginx or not log.exists():
        return None
    served = log.read_text(errors="replace").splitlines()[lines[0]:lines[1]]
    # combined format: ... "GET /path HTTP/1.1" status bytes "referer" "agent"
    return sum(int(line.split('" ', 1)[1].split()[1]) for line in served)


def feed_check(feed: Path, products: int, changed: list[int]) -> str:
    """Whether ``feed`` holds every product once at its price (new if it changed)."""
    entries = [json.loads(line) for line in feed.read_text().splitlines()]
    prices = {e["sku"]: e["price"] for e in entries}
    expected = {sku(n): new_price(n) if n in changed else old_price(n)
                for n in range(1, products + 1)}
    if len(entries) == len(prices) and prices == expected:
        return "feed exact"
    wrong = sum(1 for code, price in expected.items() if prices.get(code) != price)
    return f"feed WRONG: {len(entries)} entries, {wrong} products missing or mispriced"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=10000)
    parser.add_argument("--changed", type=float, default=1.0, help="percent of products")
    parser.add_argument("--filler", type=int, default=8000)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    listings = max(1, args.pages // 100)
    per_page = 99
    tmp = Path(tempfile.mkdtemp(prefix="recrawl-"))
    try:
        write_shop(tmp / "site", listings=listings, per_page=per_page, filler=args.filler)
        products = listings * per_page
        pages = listings + products
        changed = random.Random(1).sample(range(1, products + 1),
                                          round(products * args.changed / 100))
        with StaticSite(tmp / "site", tmp / "nginx") as site:
            print(f"site: {listings + products} pages ({products} products of "
                  f"{args.filler} characters), served by {site.kind}")
            first, seconds = crawl(site.url, tmp / "first.sqlite3", tmp / "first.log", True)
            print(f"first crawl: {first['downloader/request_count']} requests, "
                  f"{first['downloader/response_bytes']:,} bytes, {seconds:.1f} s")
            change_products(tmp / "site", changed, filler=args.filler)
            print(f"changed: {len(changed)} products ({args.changed:g}%)")
            print(f"{'recrawl':<13}{'requests':>9}{'200':>7}{'304':>7}{'bytes':>13}"
                  f"{'updated':>9}{'unchanged':>10}{'seconds':>9}")
            served: dict[str, int | None] = {}
            for conditional in (False, True):
                db = tmp / f"recrawl-{conditional}.sqlite3"
                shutil.copy(tmp / "first.sqlite3", db)
                before = site.request_count
                stats, seconds = crawl(site.url, db, tmp / f"recrawl-{conditional}.log",
                                       conditional)
                served["conditional" if conditional else "full"] = body_bytes(
                    site, (before, site.request_count))
                get = stats.get
                print(f"{'conditional' if conditional else 'full':<13}"
                      f"{get('downloader/request_count', 0):>9}"
                      f"{get('downloader/response_status_count/200', 0):>7}"
                      f"{get('downloader/response_status_count/304', 0):>7}"
                      f"{get('downloader/response_bytes', 0):>13,}"
                      f"{get('idempotent/records/updated', 0):>9}"
                      f"{get('idempotent/records/unchanged', 0):>10}{seconds:>9.1f}  "
                      + feed_check(tmp / f"recrawl-{conditional}.jsonl", products, changed))
            if args.kills:
                db = tmp / "recrawl-killed.sqlite3"
                shutil.copy(tmp / "first.sqlite3", db)
                (tmp / "kills").mkdir()
                before, started = site.request_count, time.monotonic()
                kill_crawls(site, command(site.url, db, True, tmp / "recrawl-killed.jsonl"),
                            tmp / "kills", random.Random(5), args.kills,
                            more=(max(3, pages // (4 * args.kills)),
                                  max(5, pages // (2 * args.kills))))
                run = stored_runs(db)[1]
                served[f"{args.kills} kills"] = body_bytes(site, (before, site.request_count))
                print(f"{f'{args.kills} kills':<13}{site.request_count - before:>9}"
                      f"{'':>27}{run.records_updated:>9}{run.records_unchanged:>10}"
                      f"{time.monotonic() - started:>9.1f}  "
                      + feed_check(tmp / "recrawl-killed.jsonl", products, changed))
        full = served["full"]
        if full:
            print("body bytes served (nginx's access log): " + ", ".join(
                f"{name} {size:,} ({100 * size / full:.1f}%)" for name, size in served.items()
                if size is not None))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
