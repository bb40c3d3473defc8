"""Crawl benchmark: scrapy_idempotent against Scrapy's own schedulers on one local static site.

    python benchmarks/crawl.py [--pages N] [--repeat R] [--quick]

Generates a static site of N pages (listing pages linking product pages, bounded out-degree,
2-5 KB each) in a temporary directory, serves it with nginx on 127.0.0.1 (a minimal
``nginx.conf`` in the temporary directory, ``nginx -c ... -g 'daemon off;'``; without nginx,
an asyncio server from this file: ``apt-get install -y nginx`` for the real thing), and crawls
it under each configuration, each crawl in its own ``CrawlerProcess`` subprocess, the
configurations alternating, R repetitions:

    a  Scrapy's default in-memory scheduler, a no-op item pipeline
    b  JOBDIR (Scrapy's disk queues and its on-disk dupefilter)
    c  scrapy_idempotent through its add-on
    d  scrapy_idempotent with IDEMPOTENT_RESPONSE_JOURNAL = False
    e  scrapy_idempotent with IDEMPOTENT_POLITENESS = "crawl" (limits kept by the claims)
    w  scrapy_idempotent with IDEMPOTENT_POLITENESS = "worker" (Scrapy's limits per process)
    z  (c) on a database already deep: ``--deep`` requests of another site done, each with
       its record (built once through the package's write path as ``depth.py`` builds
       them, in an unfinished run of this crawl; each crawl starts from a copy): what a
       worker pays per page when the key index and the records are far larger than
       SQLite's page cache, against (c)'s empty database

Every crawl: CONCURRENT_REQUESTS = CONCURRENT_REQUESTS_PER_DOMAIN = 32 (``--concurrency``),
no download delay, LOG_LEVEL = WARNING, no telnet console, robots.txt not fetched. The spider
follows every link and yields one item per product page, with its SKU as the natural key.

Reported per configuration (medians over the repetitions): pages/s over the crawl (Scrapy's
``elapsed_time_seconds``), the ratio to (a), CPU seconds of the crawl process (user + sys,
``os.wait4``), its peak RSS, the size of what it keeps on disk (database + WAL, or JOBDIR),
write transactions per page (every SQLite write transaction the store committed, and of
those the commit transactions, ``idempotent/transactions``), and a correctness check: every
page fetched once, one item (and for c/d one stored record) per product page.

``--variant NAME=PATH`` adds a configuration: (c) (``NAME=PATH@d``: (d)) with ``PATH`` first
on ``PYTHONPATH``, to measure a changed copy of the package against the installed one in the
same alternation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()

PRODUCTS_PER_LISTING = 20
RANDOM_LISTING_LINKS = 3
RELATED_PRODUCTS = 4

CONFIGS = {
    "a": "Scrapy memory scheduler",
    "b": "Scrapy JOBDIR",
    "c": "scrapy_idempotent (add-on)",
    "d": "scrapy_idempotent, no journal",
    "e": "scrapy_idempotent, IDEMPOTENT_POLITENESS = crawl",
    "w": "scrapy_idempotent, IDEMPOTENT_POLITENESS = worker",
    "z": "scrapy_idempotent (add-on), its database already --deep requests deep",
}
#: the deep database (z) every such crawl starts from: its path and what it holds
DEEP: dict[str, Any] = {}

_WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
    "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim",
    "ad", "minim", "veniam", "quis", "nostrud", "exercitation", "ullamco", "laboris", "nisi",
    "aliquip", "ex", "ea", "commodo", "consequat",
)


# -- the site ---------------------------------------------------------------------------------

def site_shape(pages: int) -> tuple[int, int]:
    """(listing pages, product pages) of a site of ``pages`` pages."""
    listings = max(1, -(-pages // (PRODUCTS_PER_LISTING + 1)))
    return listings, pages - listings


def _product_path(i: int) -> str:
    return f"/p/{i // 1000}/{i}.html"


def _listing_path(j: int) -> str:
    return f"/l/{j}.html"


def _filler(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def generate_site(root: Path, pages: int, seed: int = 1) -> dict[str, int]:
    """Write the site under ``root``; returns its shape. Deterministic for a given seed.

    Listing j links its (up to) 20 products, listings j-1, j+1 and 0, and 3 random listings;
    product i links its listing, listing 0 and 4 random products. Pages are 2-5 KB.
    """
    rng = random.Random(seed)
    listings, products = site_shape(pages)
    (root / "l").mkdir(parents=True, exist_ok=True)
    for d in range(products // 1000 + 1):
        (root / "p" / str(d)).mkdir(parents=True, exist_ok=True)
    links = 0
    for j in range(listings):
        hrefs = [_product_path(i) for i in
                 range(j * PRODUCTS_PER_LISTING, min(products, (j + 1) * PRODUCTS_PER_LISTING))]
        hrefs += [_listing_path(k) for k in {max(j - 1, 0), min(j + 1, listings - 1), 0}]
        hrefs += [_listing_path(rng.randrange(listings)) for _ in range(RANDOM_LISTING_LINKS)]
        links += len(hrefs)
        body = "\n".join(f'<li><a href="{h}">item {h}</a></li>' for h in hrefs)
        text = _filler(rng, rng.randint(1500, 3500))
        (root / "l" / f"{j}.html").write_text(
            f"<!DOCTYPE html><html><head><title>Listing {j}</title></head><body>"
            f"<h1>Listing {j}</h1><ul>\n{body}\n</ul><p>{text}</p></body></html>\n")
    for i in range(products):
        hrefs = [_listing_path(i // PRODUCTS_PER_LISTING), _listing_path(0)]
        hrefs += [_product_path(rng.randrange(products)) for _ in range(RELATED_PRODUCTS)]
        links += len(hrefs)
        body = "\n".join(f'<li><a href="{h}">related {h}</a></li>' for h in hrefs)
        text = _filler(rng, rng.randint(1800, 4500))
        price = f"{rng.randrange(100, 100000) / 100:.2f}"
        (root / "p" / str(i // 1000) / f"{i}.html").write_text(
            f"<!DOCTYPE html><html><head><title>Product {i}</title></head><body>"
            f'<h1>Product {i}</h1><span class="sku">SKU-{i:07d}</span>'
            f'<span class="price">{price}</span><p>{text}</p><ul>\n{body}\n</ul>'
            "</body></html>\n")
    shape = {"pages": pages, "listings": listings, "products": products, "links": links}
    (root / "shape.json").write_text(json.dumps(shape))
    return shape


# -- the server -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NGINX_CONF = """\
worker_processes 1;
error_log {tmp}/nginx/error.log warn;
pid {tmp}/nginx/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/nginx/client_body;
    proxy_temp_path {tmp}/nginx/proxy;
    fastcgi_temp_path {tmp}/nginx/fastcgi;
    uwsgi_temp_path {tmp}/nginx/uwsgi;
    scgi_temp_path {tmp}/nginx/scgi;
    types {{ text/html html; application/json json; }}
    default_type text/html;
    sendfile on;
    tcp_nodelay on;
    keepalive_timeout 120;
    keepalive_requests 10000000;
    server {{
        listen 127.0.0.1:{port};
        root {site};
        location / {{ }}
    }}
}}
"""


def start_server(tmp: Path, site: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """Serve ``site`` on 127.0.0.1: nginx when installed, else the asyncio server."""
    port = _free_port()
    nginx = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(p)), None)
    if nginx:
        (tmp / "nginx").mkdir(exist_ok=True)
        conf = tmp / "nginx" / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, site=site))
        proc = subprocess.Popen(
            [nginx, "-p", str(tmp / "nginx"), "-e", str(tmp / "nginx" / "error.log"),
             "-c", str(conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        kind = "nginx " + subprocess.run([nginx, "-v"], capture_output=True,
                                         text=True).stderr.strip().split("/")[-1]
    else:
        print("nginx is not installed (apt-get update && apt-get install -y nginx); "
              "falling back to the asyncio server in this file", file=sys.stderr)
        proc = subprocess.Popen([sys.executable, str(HERE), "--serve", str(site), str(port)])
        kind = "asyncio server (nginx not installed)"
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 10
    while True:
        try:
            with urllib.request.urlopen(url + _listing_path(0), timeout=2) as r:
                r.read()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise SystemExit(f"the server did not start: {err}") from None
            time.sleep(0.05)
    return proc, url, kind


async def _serve_async(root: Path, port: int) -> None:
    """A minimal HTTP/1.1 keep-alive static file server (GET only), for machines without
    nginx. Files are read once and kept in memory."""
    cache: dict[str, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
                path = line[1].split("?", 1)[0] if len(line) > 1 else "/"
                body = cache.get(path)
                if body is None:
                    file = (root / path.lstrip("/")).resolve()
                    if root in file.parents and file.is_file():
                        body = cache[path] = file.read_bytes()
                if body is None:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# -- one crawl (in a child process) -----------------------------------------------------------

def _crawl_child(config: str, url: str, workdir: Path, out: Path, concurrency: int) -> None:
    import scrapy
    from scrapy.crawler import CrawlerProcess

    class NoopPipeline:
        def process_item(self, item: Any) -> Any:
            return item

    class ShopSpider(scrapy.Spider):
        name = "bench"

        async def start(self) -> Any:
            # Not dont_filter: the site's links back to the home page are duplicates in
            # every configuration.
            yield scrapy.Request(url + _listing_path(0), callback=self.parse)

        def parse(self, response: Any) -> Any:
            sku = response.css("span.sku::text").get()
            if sku is not None:
                yield {"sku": sku, "name": response.css("h1::text").get(),
                       "price": response.css("span.price::text").get()}
            for href in response.css("a::attr(href)").getall():
                yield response.follow(href, callback=self.parse)

    settings: dict[str, Any] = {
        "CONCURRENT_REQUESTS": concurrency,
        "CONCURRENT_REQUESTS_PER_DOMAIN": concurrency,
        "DOWNLOAD_DELAY": 0,
        "LOG_LEVEL": "WARNING",
        "TELNETCONSOLE_ENABLED": False,
        "ROBOTSTXT_OBEY": False,
        "ITEM_PIPELINES": {NoopPipeline: 100},
    }
    if config == "b":
        settings["JOBDIR"] = str(workdir / "jobdir")
    elif config in ("c", "d", "e", "w", "z"):
        settings["ADDONS"] = {"scrapy_idempotent.Addon": 0}
        settings["IDEMPOTENT_DATABASE"] = str(workdir / "frontier.sqlite3")
        settings["IDEMPOTENT_NATURAL_KEYS"] = {"dict": "sku"}
        settings["IDEMPOTENT_RESPONSE_JOURNAL"] = config != "d"
        if config in ("e", "w"):
            settings["IDEMPOTENT_POLITENESS"] = "crawl" if config == "e" else "worker"
    process = CrawlerProcess(settings, install_root_handler=True)
    crawler = process.create_crawler(ShopSpider)
    held: dict[str, Any] = {}

    def opened() -> None:
        held["scheduler"] = crawler.engine.scheduler

    crawler.signals.connect(opened, signal=scrapy.signals.spider_opened)
    process.crawl(crawler)
    process.start()
    stats = {k: (v if isinstance(v, (int, float, str)) else str(v))
             for k, v in crawler.stats.get_stats().items()}
    store = getattr(held.get("scheduler"), "store", None)
    result = {"stats": stats, "store_transactions": getattr(store, "transactions", None),
              "scrapy": scrapy.__version__}
    if config in ("c", "d", "e", "w", "z"):
        import scrapy_idempotent

        result["package"] = os.path.dirname(scrapy_idempotent.__file__)
    out.write_text(json.dumps(result))


def _db_check(path: Path) -> dict[str, Any]:
    conn = sqlite3.connect(path)
    try:
        states = dict(conn.execute("SELECT state, count(*) FROM requests GROUP BY state"))
        records = conn.execute("SELECT count(*) FROM records").fetchone()[0]
        journal = conn.execute("SELECT count(*) FROM responses").fetchone()[0]
    finally:
        conn.close()
    return {"states": states, "records": records, "journal_left": journal}


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def run_one(name: str, config: str, pythonpath: str | None, url: str, tmp: Path,
            shape: dict[str, int], index: int, concurrency: int = 32) -> dict[str, Any]:
    """One crawl in a subprocess: its stats, resources and checks."""
    workdir = tmp / "runs" / f"{index:03d}-{name}"
    workdir.mkdir(parents=True)
    deep = {"done": 0, "records": 0}
    if config == "z":  # a copy of the deep database: every such crawl starts from the same
        shutil.copyfile(DEEP["path"], workdir / "frontier.sqlite3")
        deep = DEEP
    out = workdir / "result.json"
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with open(workdir / "log.txt", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE), "--child", config, "--url", url,
             "--workdir", str(workdir), "--out", str(out),
             "--concurrency", str(concurrency)],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not out.exists():
        log_text = (workdir / "log.txt").read_text(errors="replace")[-3000:]
        raise SystemExit(f"crawl {name} failed (exit {proc.returncode}):\n{log_text}")
    child = json.loads(out.read_text())
    stats = child["stats"]
    pages = int(stats.get("response_received_count", 0))
    elapsed = float(stats.get("elapsed_time_seconds", wall))
    row: dict[str, Any] = {
        "name": name, "config": config, "load_before": load, "pages": pages,
        "items": int(stats.get("item_scraped_count", 0)),
        "elapsed_s": elapsed, "wall_s": wall, "pages_per_s": pages / elapsed,
        "cpu_s": usage.ru_utime + usage.ru_stime, "cpu_user_s": usage.ru_utime,
        "cpu_sys_s": usage.ru_stime, "maxrss_mb": usage.ru_maxrss / 1024,
        "package": child.get("package"),
    }
    problems = []
    if pages != shape["pages"]:
        problems.append(f"{pages} pages fetched, site has {shape['pages']}")
    if row["items"] != shape["products"]:
        problems.append(f"{row['items']} items, site has {shape['products']} products")
    if config == "b":
        row["disk_mb"] = _disk_bytes(workdir / "jobdir") / 2**20
    elif config in ("c", "d", "e", "w", "z"):
        db = workdir / "frontier.sqlite3"
        row["disk_mb"] = sum(_disk_bytes(Path(f"{db}{s}")) for s in ("", "-wal")) / 2**20
        check = _db_check(db)
        row["db"] = check
        if check["records"] != shape["products"] + deep["records"]:
            problems.append(f"{check['records']} records stored, site has "
                            f"{shape['products']} products (and {deep['records']} before)")
        if (check["states"].get("done", 0) != shape["pages"] + deep["done"]
                or len(check["states"]) != 1):
            problems.append(f"frontier states {check['states']}, expected "
                            f"{shape['pages']} done (and {deep['done']} before)")
        txns = child["store_transactions"] or 0
        commits = int(stats.get("idempotent/transactions", 0))
        row["txn_per_page"] = txns / pages if pages else None
        row["commit_txn_per_page"] = commits / pages if pages else None
        row["journal_txn_per_page"] = (
            int(stats.get("idempotent/responses/journaled", 0)) / pages if pages else None)
    row["problems"] = problems
    return row


def build_deep(path: Path, requests: int) -> dict[str, Any]:
    """The deep database of (z): this crawl's (its identity: Scrapy's default ``BOT_NAME``,
    the spider ``bench``), ``requests`` requests of another site done with a record each,
    through the package's write path as ``depth.py`` builds them, in a run left unfinished
    (the crawl resumes it). Returns its path and counts."""
    sys.path.insert(0, str(HERE.parent))
    import depth

    from scrapy_idempotent.records import RECORD_ID_SCHEME
    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.base import CrawlIdentity

    store: Any = open_store(str(path))
    store.open(fingerprinter="scrapy.utils.request.RequestFingerprinter",
               identity=CrawlIdentity(project="scrapybot", spider="bench", source="bench"),
               record_id_scheme=RECORD_ID_SCHEME)
    store.close()
    t0 = time.perf_counter()
    depth.build(str(path), 0, requests, 10_000)
    check = _db_check(path)
    print(f"built {path}: {check} in {time.perf_counter() - t0:.0f} s, "
          f"{path.stat().st_size / 2**20:.0f} MiB", flush=True)
    return {"path": path, "done": check["states"].get("done", 0), "records": check["records"]}


# -- the report -------------------------------------------------------------------------------

def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(rows: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    by_name = {n: [r for r in rows if r["name"] == n] for n in names}
    base = _median(by_name.get("a", []), "pages_per_s")
    summary = []
    for name in names:
        runs = by_name[name]
        if not runs:
            continue
        pps = _median(runs, "pages_per_s")
        summary.append({
            "name": name, "label": CONFIGS.get(name, f"variant {name}"), "runs": len(runs),
            "pages_per_s": pps, "pages_per_s_all": [round(r["pages_per_s"], 1) for r in runs],
            "ratio_to_a": pps / base if base and pps else None,
            "cpu_s": _median(runs, "cpu_s"), "maxrss_mb": _median(runs, "maxrss_mb"),
            "disk_mb": _median(runs, "disk_mb"),
            "txn_per_page": _median(runs, "txn_per_page"),
            "commit_txn_per_page": _median(runs, "commit_txn_per_page"),
            "cpu_ms_per_page": 1000 * _median(runs, "cpu_s") / runs[0]["pages"],
            "correct": all(not r["problems"] for r in runs),
        })
    return summary


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(summary: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | pages/s (median) | ratio to (a) | CPU s | CPU ms/page | peak RSS MB "
        "| on disk MB | write txn/page (commit) | correct |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in summary:
        txn = ("-" if s["txn_per_page"] is None else
               f"{s['txn_per_page']:.2f} ({s['commit_txn_per_page']:.2f})")
        lines.append(
            f"| ({s['name']}) {s['label']} | {s['pages_per_s']:.0f} | "
            f"{_fmt(s['ratio_to_a'], '.3f')} | {s['cpu_s']:.1f} | {s['cpu_ms_per_page']:.2f} | "
            f"{s['maxrss_mb']:.0f} | {_fmt(s['disk_mb'], '.1f')} | {txn} | "
            f"{'yes' if s['correct'] else 'NO'} |")
    return "\n".join(lines)


def package_version() -> str:
    """Where scrapy_idempotent is imported from, with its git commit (``+dirty`` when its
    files differ from it), so a table says which code it measured."""
    import importlib.util

    spec = importlib.util.find_spec("scrapy_idempotent")
    if spec is None or spec.origin is None:
        return "scrapy_idempotent not installed"
    package = Path(spec.origin).parent
    try:
        commit = subprocess.run(  # the last commit that changed the package
            ["git", "-C", str(package), "log", "-1", "--format=%h", "--", "."],
            capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "."],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(package)
    return f"{package} at {commit}{'+dirty' if dirty else ''}"


# -- main -------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=None,
                        help="pages in the site (default 20000; --quick: 2000; max 200000)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="repetitions of each configuration (default 3; --quick: 2)")
    parser.add_argument("--quick", action="store_true", help="2,000 pages, 2 repetitions")
    parser.add_argument("--configs", default="a,b,c,d",
                        help="comma-separated configurations to run (default a,b,c,d)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=PATH",
                        help="also run (c) (or (d) with NAME=PATH@d) with PATH first on "
                        "PYTHONPATH, reported as NAME")
    parser.add_argument("--concurrency", type=int, default=32,
                        help="CONCURRENT_REQUESTS and CONCURRENT_REQUESTS_PER_DOMAIN (default 32)")
    parser.add_argument("--site-dir", type=Path, default=None,
                        help="keep the generated site here and reuse it on later runs")
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--deep", type=int, default=1_000_000,
                        help="(z): requests done in its database before it (default 1000000)")
    parser.add_argument("--deep-file", type=Path, default=None,
                        help="(z): build its database here once, and reuse it on later runs")
    # internal: one crawl, or the fallback server
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("DIR", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        asyncio.run(_serve_async(Path(args.serve[0]).resolve(), int(args.serve[1])))
        return
    if args.child:
        _crawl_child(args.child, args.url, args.workdir, args.out, args.concurrency)
        return

    pages = args.pages or (2000 if args.quick else 20000)
    repeat = args.repeat or (2 if args.quick else 3)
    if not 100 <= pages <= 200_000:
        parser.error("--pages must be between 100 and 200000")
    runs: list[tuple[str, str, str | None]] = [(c, c, None) for c in args.configs.split(",")]
    for c in args.configs.split(","):
        if c not in CONFIGS:
            parser.error(f"unknown configuration {c!r}")
    for variant in args.variant:
        name, _, path = variant.partition("=")
        path, _, config = path.partition("@")
        if not name or not path or name in CONFIGS or config not in ("", "c", "d"):
            parser.error(f"--variant wants NAME=PATH[@c|@d] with a new name, not {variant!r}")
        runs.append((name, config or "c", str(Path(path).resolve())))

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, terminate)  # still stop the server and clean up
    tmp = Path(tempfile.mkdtemp(prefix="idempotent-bench-"))
    os.chmod(tmp, 0o755)  # nginx workers run as another user when started by root
    server = None
    try:
        site = args.site_dir.resolve() if args.site_dir else tmp / "site"
        shape_file = site / "shape.json"
        if shape_file.exists() and json.loads(shape_file.read_text())["pages"] == pages:
            shape = json.loads(shape_file.read_text())
        else:
            if site.exists() and args.site_dir:
                shutil.rmtree(site)
            t0 = time.perf_counter()
            shape = generate_site(site, pages)
            print(f"generated {pages} pages ({shape['listings']} listings, "
                  f"{shape['products']} products, {shape['links']} links) "
                  f"in {time.perf_counter() - t0:.1f}s", flush=True)
        with contextlib.suppress(OSError):  # readable by nginx's worker user
            os.chmod(site, 0o755)
        if any(config == "z" for _, config, _ in runs):
            deep_file = args.deep_file.resolve() if args.deep_file else tmp / "deep.sqlite3"
            if deep_file.exists():
                check = _db_check(deep_file)
                DEEP.update(path=deep_file, done=check["states"].get("done", 0),
                            records=check["records"])
            else:
                DEEP.update(build_deep(deep_file, args.deep))
        server, url, server_kind = start_server(tmp, site)
        print(f"serving {site} with {server_kind} at {url}", flush=True)
        version = package_version()
        print(f"scrapy_idempotent: {version}", flush=True)
        rows: list[dict[str, Any]] = []
        index = 0
        for rep in range(repeat):
            order = runs[rep % len(runs):] + runs[:rep % len(runs)]  # rotate the order
            for name, config, pythonpath in order:
                index += 1
                row = run_one(name, config, pythonpath, url, tmp, shape, index,
                              args.concurrency)
                rows.append(row)
                print(f"rep {rep + 1}/{repeat} {name:>6}: {row['pages_per_s']:7.1f} pages/s, "
                      f"{row['elapsed_s']:6.1f}s, cpu {row['cpu_s']:6.1f}s, rss "
                      f"{row['maxrss_mb']:5.0f} MB, load before {row['load_before']:.2f}"
                      + (f", txn/page {row['txn_per_page']:.2f}"
                         if row.get("txn_per_page") is not None else "")
                      + (f"  PROBLEMS: {'; '.join(row['problems'])}" if row["problems"] else ""),
                      flush=True)
        if package_version() != version:
            print(f"WARNING: the package changed during the runs (now {package_version()})")
        names = [name for name, _, _ in runs]
        summary = summarise(rows, names)
        print()
        print(f"{pages} pages ({shape['products']} products), {repeat} repetitions, "
              f"{server_kind}, medians:")
        print(markdown_table(summary))
        if args.json:
            args.json.write_text(json.dumps(
                {"pages": pages, "repeat": repeat, "shape": shape, "server": server_kind,
                 "package": version,
                 "runs": rows, "summary": summary}, indent=1))
        if not all(s["correct"] for s in summary):
            raise SystemExit("some crawls were not correct (see PROBLEMS above)")
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
