"""Recrawls with and without conditional requests: bytes and requests per recrawl.

A static shop (``tests/static_shop.py``: listing pages of 99 products, product pages of
``--filler`` characters of description) served by nginx (``ETag`` and ``Last-Modified``;
without nginx, the standard library's server, ``Last-Modified`` only), crawled once, then
``--changed`` percent of the products get a new price and the shop is crawled again, twice:
with ``IDEMPOTENT_CONDITIONAL_REQUESTS`` off (a full recrawl, as before) and on. Each crawl is
``python tests/static_shop.py`` in a subprocess of its own on a copy of the first crawl's
SQLite database. Prints, per recrawl: requests sent, responses 200 and 304, bytes received
(Scrapy's ``downloader/response_bytes``: status lines, headers and bodies), records updated
and unchanged, and the wall time; the figures go in docs/recrawls.rst.

    python benchmarks/recrawl.py [--pages 10000] [--changed 1] [--filler 8000]
"""

from __future__ import annotations

import argparse
import ast
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

from static_shop import StaticSite, change_products, write_shop  # noqa: E402


def stats_of(log: Path) -> dict[str, Any]:
    """The stats Scrapy dumped at the end of a crawl log."""
    text = log.read_text(errors="replace")
    dump = text[text.rindex("Dumping Scrapy stats:") + len("Dumping Scrapy stats:"):]
    dump = dump[:dump.index("}") + 1]
    dump = re.sub(r"datetime\.datetime\([^)]*\)", "None", dump)
    stats: dict[str, Any] = ast.literal_eval(dump.strip())
    return stats


def crawl(url: str, db: Path, log: Path, conditional: bool) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    subprocess.run([sys.executable, str(TESTS / "static_shop.py"), "--url", url, "--db",
                    str(db), "-s", f"IDEMPOTENT_CONDITIONAL_REQUESTS={str(conditional).lower()}",
                    "-s", "CONCURRENT_REQUESTS=32", "-s", "CONCURRENT_REQUESTS_PER_DOMAIN=32",
                    "-s", f"LOG_FILE={log}"], check=True, stdin=subprocess.DEVNULL)
    return stats_of(log), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=10000)
    parser.add_argument("--changed", type=float, default=1.0, help="percent of products")
    parser.add_argument("--filler", type=int, default=8000)
    args = parser.parse_args()
    listings = max(1, args.pages // 100)
    per_page = 99
    tmp = Path(tempfile.mkdtemp(prefix="recrawl-"))
    try:
        write_shop(tmp / "site", listings=listings, per_page=per_page, filler=args.filler)
        products = listings * per_page
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
            for conditional in (False, True):
                db = tmp / f"recrawl-{conditional}.sqlite3"
                shutil.copy(tmp / "first.sqlite3", db)
                stats, seconds = crawl(site.url, db, tmp / f"recrawl-{conditional}.log",
                                       conditional)
                get = stats.get
                print(f"{'conditional' if conditional else 'full':<13}"
                      f"{get('downloader/request_count', 0):>9}"
                      f"{get('downloader/response_status_count/200', 0):>7}"
                      f"{get('downloader/response_status_count/304', 0):>7}"
                      f"{get('downloader/response_bytes', 0):>13,}"
                      f"{get('idempotent/records/updated', 0):>9}"
                      f"{get('idempotent/records/unchanged', 0):>10}{seconds:>9.1f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
