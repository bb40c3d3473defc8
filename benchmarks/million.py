"""A crawl of a million pages end to end, killed three times: SQLite, and PostgreSQL with two
workers.

    python benchmarks/million.py [--pages N] [--store sqlite|postgresql|both]
        [--kills 0.25,0.45,0.75] [--workers 2] [--concurrency 32] [--database URL]
        [--json OUT] [--package PATH] [--keep DIR] [-s NAME=VALUE ...] [--statements N]

The site: nginx on 127.0.0.1 (``apt-get install -y nginx``) answering from its configuration
alone, no files: listing page ``/l/J/`` (J < N / 100) links its 99 products ``/l/J/0`` ..
``/l/J/98``; a product page links back to its listing (a rediscovered link, refused as a
duplicate). Pages are tiny (about 1.5 KB for a listing, 90 bytes for a product). The spider's
``start()`` yields the N / 100 listing pages (``dont_filter=True``, as Scrapy's own start
requests); each page yields one item (its ``id`` is the natural key): N records in all.

Each store: a fresh database, the workers (``scrapy runspider``, one process on SQLite,
``--workers`` on PostgreSQL, each ``--concurrency`` concurrent requests) started, and every
worker SIGKILLed when the requests the site has served pass each fraction of ``--kills``
(of N), then started again at once; the crawl runs until every worker has finished.

Printed per tenth of the crawl (the pages the site served, repeats included, from nginx's
``stub_status``): pages/s, the workers' CPU milliseconds per page (steadier than pages/s on a
loaded machine), the peak RSS of each worker seen in the tenth (``VmRSS``, sampled every
0.5 s), whether a kill fell into it, and the load average. At the end: the database's size
(SQLite: the file and its WAL; PostgreSQL: ``pg_database_size``), the workers' CPU per page
(``os.wait4`` of every worker process, killed ones too), the requests served against N, and the
check: N records, one per item, each record's data the page's (``id``, ``listing``, ``rank``).
On PostgreSQL also the server's CPU time per page (user + system of the postmaster and every
backend, read from ``/proc``: the postmaster's own and its reaped children's times, plus the
live backends') and the page rate one server core would carry at that cost.

Without ``--database`` the PostgreSQL server is a throwaway cluster of the tests'
``tests/postgres_server.py`` (fsync off, as in the tests), run as ``nobody`` under root.
``--package PATH`` crawls with another copy of the package (``git archive`` of a commit);
``-s NAME=VALUE`` gives every worker a Scrapy setting (``-s IDEMPOTENT_POLITENESS=worker``).
``--statements N`` (the throwaway cluster) loads ``pg_stat_statements`` and reports the crawl's
statements: their execution time, calls, buffers and write-ahead log a page, and the N that
took longest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
PRODUCTS = 99  #: products per listing page: a listing and its products are 100 pages
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

SPIDER = """
import scrapy


class Million(scrapy.Spider):
    name = "million"
    custom_settings = {"ADDONS": {"scrapy_idempotent.Addon": 0},
                       "IDEMPOTENT_NATURAL_KEYS": {"dict": "id"}, "ROBOTSTXT_OBEY": False,
                       "TELNETCONSOLE_ENABLED": False, "LOG_LEVEL": "INFO"}

    def __init__(self, url, listings, **kwargs):
        super().__init__(**kwargs)
        self.base, self.listings = url, int(listings)

    async def start(self):
        for j in range(self.listings):
            yield scrapy.Request(f"{self.base}/l/{j}/", dont_filter=True)

    def parse(self, response):
        kind, listing, rank = response.css("b::text").get().split("-")
        yield {"id": f"{kind}-{listing}-{rank}", "listing": int(listing), "rank": int(rank)}
        yield from response.follow_all(css="a")
"""

NGINX_CONF = """\
worker_processes 1;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type text/html;
    tcp_nodelay on;
    keepalive_timeout 120;
    keepalive_requests 100000000;
    server {{
        listen 127.0.0.1:{port};
        location = /status {{ stub_status; }}
        location ~ ^/l/(\\d+)/$ {{
            return 200 '<html><body><b>l-$1-0</b> {links}</body></html>'; }}
        location ~ ^/l/(\\d+)/(\\d+)$ {{
            return 200 '<html><body><b>p-$1-$2</b> <a href="./">listing</a></body></html>'; }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Site:
    """nginx serving the generated site; :meth:`served` reads ``stub_status``."""

    def __init__(self, tmp: Path) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(nginx):
            raise SystemExit("nginx is needed: apt-get install -y nginx")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        links = "".join(f'<a href="{k}">{k}</a> ' for k in range(PRODUCTS))
        conf = tmp / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=self.port, links=links))
        self.process = subprocess.Popen(
            [nginx, "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(conf),
             "-g", "daemon off;"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        self.polls = 0
        deadline = time.monotonic() + 30
        while True:
            try:
                self.served()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("nginx did not start") from None
                time.sleep(0.05)
        self.base = self.served()

    def served(self) -> int:
        """Requests served so far, without the status reads."""
        with urllib.request.urlopen(self.url + "/status", timeout=10) as answer:
            text = answer.read().decode()
        self.polls += 1
        requests = int(text.splitlines()[2].split()[2])
        return requests - self.polls

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def proc_times(pid: int) -> tuple[float, float, int]:
    """(own user+system, reaped children's user+system) seconds, parent pid."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    # after the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15)
    own = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    children = (int(fields[13]) + int(fields[14])) / CLOCK_TICKS
    return own, children, int(fields[1])


def server_cpu(postmaster: int) -> float:
    """CPU seconds of a PostgreSQL server: the postmaster's own and its reaped children's,
    and every live child's own."""
    own, reaped, _ = proc_times(postmaster)
    total = own + reaped
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == postmaster:
            continue
        try:
            child_own, _, parent = proc_times(int(entry))
        except (OSError, IndexError, ValueError):
            continue
        if parent == postmaster:
            total += child_own
    return total


class Crawl:
    """The worker processes of one store's crawl, killed and started again."""

    def __init__(self, args: argparse.Namespace, site: Site, work: Path, database: str,
                 workers: int, extra: tuple[str, ...]) -> None:
        self.args, self.site, self.work, self.database = args, site, work, database
        self.workers, self.extra = workers, extra
        self.spider = work / "million.py"
        self.spider.write_text(SPIDER)
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * workers
        self.starts = 0
        self.cpu = 0.0
        self.exit_codes: list[int] = []

    def start(self, n: int) -> None:
        self.starts += 1
        log = self.work / f"worker{n}-{self.starts}.log"
        command = [sys.executable, "-m", "scrapy", "runspider", str(self.spider),
                   "-a", f"url={self.site.url}", "-a", f"listings={self.args.pages // 100}",
                   "-s", f"IDEMPOTENT_DATABASE={self.database}", "-s", f"LOG_FILE={log}",
                   "-s", f"CONCURRENT_REQUESTS={self.args.concurrency}",
                   "-s", f"CONCURRENT_REQUESTS_PER_DOMAIN={self.args.concurrency}"]
        for setting in self.extra:
            command += ["-s", setting]
        environment = dict(os.environ)
        if self.args.package is not None:
            environment["PYTHONPATH"] = os.pathsep.join(
                [str(self.args.package), environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.processes[n] = subprocess.Popen(
            command, cwd=self.work, env=environment, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def reap(self, n: int, kill: bool = False) -> None:
        process = self.processes[n]
        assert process is not None
        if kill:
            process.kill()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        self.cpu += usage.ru_utime + usage.ru_stime
        self.exit_codes.append(process.returncode)
        self.processes[n] = None

    def kill_all(self) -> None:
        for n in range(self.workers):
            if self.processes[n] is not None:
                self.reap(n, kill=True)
        for n in range(self.workers):
            self.start(n)

    def running(self) -> list[int]:
        alive = []
        for n, process in enumerate(self.processes):
            if process is None:
                continue
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                process.returncode = os.waitstatus_to_exitcode(status)
                self.cpu += usage.ru_utime + usage.ru_stime
                self.exit_codes.append(process.returncode)
                self.processes[n] = None
            else:
                alive.append(process.pid)
        return alive

    def stop(self) -> None:
        for n in range(self.workers):
            if self.processes[n] is not None:
                self.reap(n, kill=True)


def run_crawl(args: argparse.Namespace, site: Site, work: Path, database: str, workers: int,
              extra: tuple[str, ...], server: Any = None) -> dict[str, Any]:
    """Crawl to the end with the kills; the per-tenth figures."""
    n_pages = args.pages
    kills = sorted(float(k) for k in args.kills.split(",") if k)
    crawl = Crawl(args, site, work, database, workers, extra)
    base = site.served()
    server_base = server() if server else 0.0
    began = time.monotonic()
    for n in range(workers):
        crawl.start(n)
    tenths: list[dict[str, Any]] = []
    tenth_began, tenth_served = began, 0

    def worker_cpu() -> float:
        """CPU seconds of every worker so far: the reaped ones' and the live ones'."""
        live = 0.0
        for process in crawl.processes:
            if process is not None:
                with contextlib.suppress(OSError, IndexError, ValueError):
                    live += proc_times(process.pid)[0]
        return crawl.cpu + live

    tenth_cpu = 0.0
    peak: dict[int, int] = {}
    killed_in_tenth: list[float] = []
    next_kill = 0
    served = 0
    try:
        while True:
            alive = crawl.running()
            served = site.served() - base
            for pid in alive:
                peak[pid] = max(peak.get(pid, 0), rss_kb(pid))
            boundary = (len(tenths) + 1) * n_pages / 10
            if (len(tenths) < 9 and served >= boundary) or not alive:
                now = time.monotonic()
                tenths.append({
                    "tenth": len(tenths) + 1,
                    "pages_per_s": round((served - tenth_served) / (now - tenth_began), 1),
                    "peak_rss_mb": sorted(round(kb / 1024, 1) for kb in peak.values()),
                    "worker_cpu_ms_per_page": round(
                        1000 * (worker_cpu() - tenth_cpu) / max(served - tenth_served, 1), 2),
                    "kills": killed_in_tenth, "seconds": round(now - tenth_began, 1),
                    "load": [round(x, 2) for x in os.getloadavg()],
                    "server_cpu_s": round(server() - server_base, 2) if server else None,
                })
                print(json.dumps(tenths[-1]), flush=True)
                tenth_began, tenth_served, tenth_cpu = now, served, worker_cpu()
                peak = {pid: rss_kb(pid) for pid in alive}
                killed_in_tenth = []
                if not alive:
                    break
            if next_kill < len(kills) and served >= kills[next_kill] * n_pages:
                crawl.kill_all()
                killed_in_tenth.append(kills[next_kill])
                print(f"killed at {served} pages served ({kills[next_kill]})", flush=True)
                next_kill += 1
                peak.update({p.pid: 0 for p in crawl.processes if p is not None})
            time.sleep(0.5)
    finally:
        crawl.stop()
    elapsed = time.monotonic() - began
    result: dict[str, Any] = {
        "pages": n_pages, "workers": workers, "concurrency": args.concurrency,
        "kills": kills, "kills_done": next_kill, "seconds": round(elapsed, 1),
        "pages_per_s": round(n_pages / elapsed, 1), "requests_served": served,
        "repeated_requests": served - n_pages,
        "worker_cpu_ms_per_page": round(1000 * crawl.cpu / n_pages, 3),
        "exit_codes": crawl.exit_codes, "tenths": tenths,
        "first_to_last_tenth_rate": (round(tenths[0]["pages_per_s"] / tenths[-1]["pages_per_s"], 3)
                                     if tenths and tenths[-1]["pages_per_s"] else None),
    }
    if tenths and tenths[0]["peak_rss_mb"] and tenths[-1]["peak_rss_mb"]:
        result["last_to_first_tenth_rss"] = round(
            max(tenths[-1]["peak_rss_mb"]) / max(tenths[0]["peak_rss_mb"]), 3)
    if server:
        cpu = server() - server_base
        result["server_cpu_s"] = round(cpu, 1)
        result["server_cpu_ms_per_page"] = round(1000 * cpu / n_pages, 3)
        result["pages_per_s_one_server_core"] = round(n_pages / cpu) if cpu else None
    return result


def expected(listing: int, rank: int, kind: str) -> dict[str, Any]:
    return {"id": f"{kind}-{listing}-{rank}", "listing": listing, "rank": rank}


def check(rows: Any, n_pages: int) -> dict[str, Any]:
    """N records, one per item, each with its page's data."""
    seen: set[str] = set()
    wrong = 0
    count = 0
    for natural_key, data in rows:
        count += 1
        item = json.loads(data) if isinstance(data, str) else data
        if natural_key.startswith("["):  # the key fields' values, as JSON
            natural_key = json.loads(natural_key)[0]
        _kind, listing, rank = natural_key.split("-")
        if item.get("id") != natural_key or item.get("listing") != int(listing) \
                or item.get("rank") != int(rank) or natural_key in seen:
            wrong += 1
        seen.add(natural_key)
    listings = n_pages // 100
    missing = sum(1 for j in range(listings) if f"l-{j}-0" not in seen) + sum(
        1 for j in range(listings) for k in range(PRODUCTS) if f"p-{j}-{k}" not in seen)
    return {"records": count, "distinct": len(seen), "wrong": wrong, "missing": missing,
            "ok": count == n_pages and len(seen) == n_pages and not wrong and not missing}


def sqlite_run(args: argparse.Namespace, site: Site, work: Path) -> dict[str, Any]:
    db = work / "million.sqlite3"
    result = run_crawl(args, site, work, str(db), 1, tuple(args.setting))
    result["store"] = "sqlite"
    sizes = {p.name: p.stat().st_size for p in work.glob("million.sqlite3*")}
    result["database_mb"] = round(sum(sizes.values()) / 2**20, 1)
    result["database_files_mb"] = {k: round(v / 2**20, 1) for k, v in sizes.items()}
    conn = sqlite3.connect(db)
    try:
        result["check"] = check(conn.execute("SELECT natural_key, data FROM records"),
                                args.pages)
        result["frontier"] = dict(conn.execute(
            "SELECT state, count(*) FROM requests GROUP BY state").fetchall())
    finally:
        conn.close()
    return result


def postgresql_run(args: argparse.Namespace, site: Site, work: Path) -> dict[str, Any]:
    import psycopg

    def crawl(url: str, postmaster: int | None) -> dict[str, Any]:
        server = (lambda: server_cpu(postmaster)) if postmaster else None
        result = run_crawl(args, site, work, f"{url}?schema=million", args.workers,
                           ("IDEMPOTENT_RUN_MODE=resume", *args.setting), server)
        result["store"] = "postgresql"
        with psycopg.connect(url, autocommit=True) as conn:
            if args.statements:  # (before this benchmark's own reads below)
                result["statements"] = statements(conn, args.pages, args.statements)
            result["database_mb"] = round(conn.execute(
                "SELECT pg_database_size(current_database())").fetchone()[0] / 2**20, 1)
            conn.execute("SET search_path TO million")
            result["tables_mb"] = {name: round(size / 2**20, 1) for name, size in conn.execute(
                "SELECT relname, pg_total_relation_size(oid) FROM pg_class"
                " WHERE relkind = 'r' AND relnamespace = 'million'::regnamespace"
                " ORDER BY 2 DESC LIMIT 6").fetchall()}
            result["check"] = check(conn.execute("SELECT natural_key, data FROM records"),
                                    args.pages)
            result["frontier"] = dict(conn.execute(
                "SELECT state, count(*) FROM requests GROUP BY state").fetchall())
        return result

    if args.database:
        return crawl(args.database, None)
    sys.path.insert(0, str(ROOT / "tests"))
    from postgres_server import INSTALL_HINT, find_binaries, running_cluster

    bindir = find_binaries()
    if bindir is None:
        raise SystemExit(INSTALL_HINT)
    settings = ("-c shared_preload_libraries=pg_stat_statements -c track_io_timing=on"
                if args.statements else "")
    with running_cluster(bindir, settings) as cluster:
        url = cluster.new_database()
        if args.statements:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION pg_stat_statements")
                conn.execute("SELECT pg_stat_statements_reset()")  # the crawl's alone
        postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
        return crawl(url, postmaster)


def statements(conn: Any, pages: int, top: int) -> dict[str, Any]:
    """The server's statements over the crawl (``pg_stat_statements``, every database's
    statement of the run): their execution time, buffers and write-ahead log a page, and the
    ``top`` statements by execution time, each with its calls, rows and buffers a call."""
    total = conn.execute(
        "SELECT sum(total_exec_time), sum(calls), sum(shared_blks_hit + shared_blks_read),"
        " sum(wal_bytes) FROM public.pg_stat_statements").fetchone()
    rows = conn.execute(
        "SELECT total_exec_time, calls, rows, shared_blks_hit + shared_blks_read,"
        " left(regexp_replace(query, '\\s+', ' ', 'g'), 200) FROM public.pg_stat_statements"
        " ORDER BY total_exec_time DESC LIMIT %s", (top,)).fetchall()
    return {
        "exec_ms_per_page": round(float(total[0]) / pages, 3),
        "calls_per_page": round(int(total[1]) / pages, 2),
        "buffers_per_page": round(int(total[2]) / pages, 1),
        "wal_bytes_per_page": round(int(total[3]) / pages),
        "top": [{"exec_ms_per_page": round(ms / pages, 4), "calls": calls, "rows": n,
                 "buffers_per_call": round(buffers / max(calls, 1), 1), "query": query}
                for ms, calls, n, buffers, query in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--store", choices=("sqlite", "postgresql", "both"), default="both")
    parser.add_argument("--kills", default="0.25,0.45,0.75",
                        help="fractions of the pages at which every worker is SIGKILLed")
    parser.add_argument("--workers", type=int, default=2, help="PostgreSQL workers")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--database", help="a PostgreSQL URL instead of a throwaway cluster")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--package", type=Path, help="package root to put first on PYTHONPATH")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it")
    parser.add_argument("--setting", "-s", action="append", default=[], metavar="NAME=VALUE",
                        help="a Scrapy setting of every worker (repeatable)")
    parser.add_argument("--statements", type=int, default=0, metavar="N",
                        help="PostgreSQL (the throwaway cluster): the server's statements"
                        " (pg_stat_statements): totals a page and the N slowest")
    args = parser.parse_args()
    if args.pages % 100:
        raise SystemExit("--pages must be a multiple of 100")
    results: dict[str, Any] = {"load_average": os.getloadavg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="million-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        site = Site(work)
        try:
            for store, run in (("sqlite", sqlite_run), ("postgresql", postgresql_run)):
                if args.store in (store, "both"):
                    print(f"-- {store}: {args.pages} pages", flush=True)
                    (work / store).mkdir(exist_ok=True)
                    os.chmod(work / store, 0o755)
                    results[store] = run(args, site, work / store)
                    print(json.dumps({k: v for k, v in results[store].items()
                                      if k != "tenths"}), flush=True)
        finally:
            site.stop()
    results["load_average_after"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
