"""A frontier at depth: bytes per row, claim and commit latency, and the operator commands.

    python benchmarks/depth.py --postgres --pending 1000000 --done 200000
    python benchmarks/depth.py --postgres --pending 800000 --done 200000 --copies 9
    python benchmarks/depth.py --sqlite /big/disk/depth.sqlite3 --pending 1000000

The frontier is built through the package's own write path (``FrontierStore.commit``, in
transactions of ``--batch`` requests): ``--pending`` requests as a crawl stores the links it
found (each encoded by :class:`~scrapy_idempotent.codec.RequestCodec` from a
``scrapy.Request`` with a ``Referer`` header and a depth, as Scrapy's middlewares leave it;
the key and fingerprint Scrapy's fingerprint; the parent's key the fingerprint of the page
in its ``Referer``; the slot its host), then ``--done`` of them
claimed and completed, each with one record (an item of 6 fields keyed by its SKU), as page
commits do in bulk. ``--empty`` requests (default 10,000) are built the same way in a
database of their own: the empty frontier the latencies are compared with.

Then, on each database:

* bytes: the requests table (heap, TOAST, each index) and the records table per row, the
  average stored size of each column of a pending row, of a done row and of a record
  (``pg_column_size`` on PostgreSQL, ``length()`` on SQLite; SQLite's table and index
  bytes from ``dbstat`` when the library has it);
* latency: ``--pages`` page commits as the scheduler makes them (1 completion with its
  record, 8 new child requests, a claim of 1), each timed, and as many claims of 1 alone,
  on the deep and the empty frontier in turns (blocks of 100: both under the same load);
  the worker's CPU per page (this process; its user CPU apart) and its ``read`` and
  ``write`` calls per page (``/proc/self/io``), on PostgreSQL the server's CPU (its
  processes' CPU time), and the ratios deep / empty;
* commands: ``scrapy idempotent status``, ``check``, ``failed``, ``export`` (every record,
  JSON Lines, to /dev/null), one ``metrics`` scrape (:class:`~.metrics.StoreCollector`, as
  the HTTP exporter answers it) and ``migrate`` (of a database already at the current
  version: its checks), each timed as a user runs it (a new process).

``--keep`` leaves the SQLite files built (``--reuse`` measures them, or a ``--database``'s,
again without building: their open, timed, migrates them to this release's schema; the
empty frontier is built again, as its measured pages grow it);
``--skip-commands`` measures bytes and latency only; ``--pragma`` sets a SQLite pragma on the
measured stores' connections (a page cache or memory map of another size); ``--page-size``
builds SQLite files of another page size than the package gives new files; ``--compare
PATH`` measures the latency of another file built before (and its ``PATH-empty``) in the
same turns as ``--sqlite``'s (files of another page size, under the same load). The
machine's load average is printed before and after. The package is imported from the environment:
``PYTHONPATH=/path/to/copy`` measures a copy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = "depth-host:1:1"
HOSTS = 50  #: the sites of the frontier (download slots)
SPIDER = '''
import scrapy


class Depth(scrapy.Spider):
    name = "depth"

    def parse(self, response):
        pass
'''


def _spider() -> Any:
    import scrapy

    class Depth(scrapy.Spider):
        name = "depth"

        def parse(self, response: Any) -> None:
            pass

    return Depth()


class Builder:
    """Requests and records as a crawl stores them, numbered from 0."""

    def __init__(self) -> None:
        import scrapy
        from scrapy.utils.request import RequestFingerprinter

        from scrapy_idempotent.codec import RequestCodec

        self.spider = _spider()
        self.codec = RequestCodec(self.spider)
        self.fingerprint = RequestFingerprinter().fingerprint
        self.request_class = scrapy.Request

    def url(self, n: int) -> str:
        return f"https://shop{n % HOSTS}.example.com/product/{n}-widget-{n % 97}.html"

    def request(self, n: int) -> Any:
        from scrapy_idempotent.store.base import NewRequest

        url = self.url(n)
        host = f"shop{n % HOSTS}.example.com"
        referer = f"https://{host}/category/{n % 1000}?page={n % 40}"
        request = self.request_class(
            url, callback=self.spider.parse, meta={"depth": 2}, headers={"Referer": referer})
        key = self.fingerprint(request).hex()
        # the page that linked it, as a crawl stores it (the parent's key: its fingerprint)
        parent_key = self.fingerprint(self.request_class(referer)).hex()
        return NewRequest(key=key, fingerprint=key, url=url, priority=0,
                          data=self.codec.encode(request), parent_key=parent_key, slot=host)

    def record(self, n: int) -> Any:
        from scrapy_idempotent.records import record_id_of
        from scrapy_idempotent.store.base import Record, RecordKey

        sku = f"SKU-{n:09d}"
        data = json.dumps({"sku": sku, "name": f"Widget {n}", "price": f"{n % 1000}.99",
                           "currency": "EUR", "url": self.url(n), "in_stock": n % 3 > 0},
                          separators=(",", ":"))
        return Record(record_id=record_id_of("depth", "dict", [sku]), source="depth",
                      natural_key=json.dumps([sku]), item_type="dict", data=data,
                      content_hash=hashlib.sha256(data.encode()).hexdigest(),
                      key=RecordKey(record_type="dict", item_type="dict", fields=("sku",)))


#: ``--pragma`` settings given to each SQLite connection of the stores measured
PRAGMAS: list[str] = []


def open_built(db: str) -> Any:
    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.base import RunMode

    store: Any = open_store(db, lease_seconds=3600)
    store.open(fingerprinter="scrapy.utils.request.RequestFingerprinter")
    for conn in (getattr(store, "_conn", None), getattr(store, "_read", None)):
        for pragma in PRAGMAS if conn is not None else ():
            conn.execute(f"PRAGMA {pragma}").fetchall()
    store.begin_session(WORKER, RunMode.RESUME)
    return store


def build(db: str, pending: int, done: int, batch: int) -> dict[str, Any]:
    """``pending + done`` requests through the write path, ``done`` of them completed with
    their record; returns the seconds each part took."""
    from scrapy_idempotent.store.base import Completion, RequestState, UnitOfWork

    builder = Builder()
    store = open_built(db)
    total = pending + done
    t0 = time.perf_counter()
    for start in range(0, total, batch):
        store.commit(UnitOfWork(requests=[builder.request(n) for n in
                                          range(start, min(total, start + batch))]), WORKER)
        if start // batch % 50 == 49:
            print(f"  {start + batch:,} requests in {time.perf_counter() - t0:.0f} s",
                  flush=True)
    inserted_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    completed = 0
    while completed < done:
        leased = store.commit(UnitOfWork(claim=min(batch, done - completed)), WORKER).leased
        if not leased:
            break
        records = []
        for lease in leased:
            n = int(json.loads(lease.data)["url"].split("/product/")[1].split("-")[0])
            records.append((builder.record(n), lease.key))
        store.commit(UnitOfWork(records=records, completions=[
            Completion(lease.key, RequestState.DONE) for lease in leased]), WORKER)
        completed += len(leased)
        if completed // batch % 50 == 0:
            print(f"  {completed:,} done in {time.perf_counter() - t0:.0f} s", flush=True)
    completed_s = time.perf_counter() - t0
    store.close()
    return {"insert_s": inserted_s, "complete_s": completed_s, "done": completed}


_NEW_URL = "regexp_replace({url}, '/product/[0-9]+-', '/product/' || ({n} + %(shift)s) || '-')"
_NEW_KEY = "left(encode(sha256(convert_to({url}, 'UTF8')), 'hex'), 40)"
#: the columns a request's copy keeps as they are (its key, fingerprint, URL and stored
#: request are new)
_KEPT = ("priority", "is_start", "fifo", "state", "parent_key", "worker", "leased_until",
         "attempts", "unfinished", "replays", "enqueued_at", "finished_at", "error_kind",
         "error_message", "run_id", "slot", "downloads")
_PRODUCT = re.compile(r"/product/([0-9]+)-")
_RECORD_COPY = f"""
INSERT INTO records (record_id, source, natural_key, item_type, data, content_hash, first_seen,
    last_changed, first_run_id, changed_run_id, request_key, seen_run_id, seen_at, seen_seq,
    observed_at, version)
SELECT left(encode(sha256(convert_to('["depth","dict",["' || sku || '"]]', 'UTF8')), 'hex'),
            32),
    source, '["' || sku || '"]', item_type, d, encode(sha256(convert_to(d, 'UTF8')), 'hex'),
    first_seen, last_changed, first_run_id, changed_run_id, {_NEW_KEY.format(url="u")},
    seen_run_id, seen_at, nextval('records_seen_seq'), observed_at, version
FROM (SELECT x.*, replace(replace(x.data, x.old_sku, x.sku), x.old_url, x.u) AS d
      FROM (SELECT r.*, r.data::json->>'url' AS old_url,
                   {_NEW_URL.format(url="(r.data::json->>'url')", n="r.n")} AS u,
                   'SKU-' || lpad((r.n + %(shift)s)::text, 9, '0') AS sku,
                   'SKU-' || lpad(r.n::text, 9, '0') AS old_sku
            FROM (SELECT *, substring(natural_key from 'SKU-([0-9]+)')::bigint AS n
                  FROM records) AS r
            WHERE r.seen_seq <= %(last_record)s) AS x) AS y
ORDER BY seen_seq"""


def replicate(db: str, copies: int) -> float:
    """Copy the built rows (requests and records) ``copies`` times, each copy with new URLs,
    keys, SKUs and record IDs computed as the write path computes them (the key a hash of
    the URL of the same length as Scrapy's fingerprint): a frontier of the same rows, as
    large as wanted, without waiting for the write path to store each one. Requests are
    read back and written again by this process (their stored request unpacked and packed
    again with its new URL, as the store does: a packed request's dictionary is its URL),
    through ``COPY``; records in SQL. PostgreSQL only; returns the seconds it took."""
    import psycopg

    from scrapy_idempotent.store import open_store
    from scrapy_idempotent.store.postgresql import _split_url

    store: Any = open_store(db, lease_seconds=3600)  # (not opened: its codec of rows only)
    url, schema = _split_url(db)
    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn, psycopg.connect(url) as reader:
        for each in (conn, reader):
            each.execute(f'SET search_path TO "{schema}"')
        last, count = conn.execute("SELECT max(id), count(*) FROM requests").fetchone()
        last_record = conn.execute("SELECT coalesce(max(seen_seq), 0) FROM records"
                                   ).fetchone()[0]
        numbers = conn.execute("SELECT max(substring(url from '/product/([0-9]+)-')::bigint)"
                               " FROM requests").fetchone()[0]
        # the key's type: text (40 hex digits) or bytea, as the release measured has it
        key_type = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 'requests'::regclass AND attname = 'key'").fetchone()[0]
        as_key: Any = bytes.fromhex if key_type == "bytea" else str
        data_read = store.DATA_READ.format(r="")
        columns = ("key", "fingerprint", "url", "data", "packed", *_KEPT)
        for copy in range(1, copies + 1):
            shift = copy * (numbers + 1)
            with conn.transaction(), reader.transaction(), reader.cursor(name="source") as rows, \
                    conn.cursor().copy(f"COPY requests ({', '.join(columns)}) FROM STDIN") as out:
                rows.itersize = 10_000
                rows.execute(f"SELECT url, fingerprint IS NOT NULL, {data_read}, "
                             f"{', '.join(_KEPT)} FROM requests WHERE id <= %s ORDER BY id",
                             (last,))
                for old_url, has_fingerprint, stored, *kept in rows:
                    match = _PRODUCT.search(old_url)
                    assert match is not None, old_url
                    new_url = (f"{old_url[:match.start()]}/product/{int(match[1]) + shift}-"
                               f"{old_url[match.end():]}")
                    key = as_key(hashlib.sha256(new_url.encode()).hexdigest()[:40])
                    text = store._request_data(stored, old_url).replace(old_url, new_url)
                    out.write_row((key, key if has_fingerprint else None, new_url,
                                   *store._stored_data(text, new_url), *kept))
            with conn.transaction():
                conn.execute(_RECORD_COPY, {"shift": shift, "last_record": last_record})
            print(f"  copy {copy} of {copies}: {(copy + 1) * count:,} requests in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        conn.execute("VACUUM ANALYZE")
        newest = conn.execute("SELECT key FROM requests ORDER BY id DESC LIMIT 1").fetchone()[0]
    # the last copy reads back through the store as written: its own URL in its request
    store = open_built(db)
    entry = store.entry(newest.hex() if isinstance(newest, bytes) else newest)
    store.close()
    assert entry is not None and json.loads(entry.data)["url"] == entry.url, entry
    return time.perf_counter() - t0


# -- bytes ----------------------------------------------------------------------------------

def summary(out: dict[str, Any]) -> dict[str, float]:
    """The bytes of a pending request: its heap (:func:`pg_bytes`' pages of pending rows) and
    its entries in the indexes of every row (their size per row) and of pending rows (their
    size per pending row)."""
    requests = out["requests"]
    rows, pending = requests["rows"], max(out["states"].get("pending", 0), 1)
    indexes = requests["indexes"]
    parts = {"heap": out["pending_heap_per_row"]}
    for name in ("requests_key_key", "requests_pkey"):  # the id's: PostgreSQL before 18
        if name in indexes:
            parts[name] = indexes[name] / rows
    for name in ("requests_pending", "requests_slot_pending"):
        parts[name] = indexes.get(name, 0) / pending
    parts = {name: round(value, 1) for name, value in parts.items()}
    parts["total"] = round(sum(parts.values()), 1)
    return parts


def pg_bytes(db: str) -> dict[str, Any]:
    import psycopg

    from scrapy_idempotent.store.postgresql import _split_url

    url, schema = _split_url(db)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        conn.execute("VACUUM ANALYZE requests")
        conn.execute("VACUUM ANALYZE records")
        out: dict[str, Any] = {"schema": schema}
        for table in ("requests", "records"):
            rows = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            # (the table of this schema: the search path names it)
            heap, toast = conn.execute(
                "SELECT pg_relation_size(c.oid), coalesce(pg_total_relation_size("
                "nullif(c.reltoastrelid, 0)), 0) FROM pg_class c WHERE c.oid = %s::regclass",
                (table,)).fetchone()
            indexes = dict(conn.execute(
                "SELECT i.relname, pg_relation_size(i.oid) FROM pg_index x"
                " JOIN pg_class i ON i.oid = x.indexrelid"
                " WHERE x.indrelid = %s::regclass ORDER BY 1", (table,)).fetchall())
            out[table] = {"rows": rows, "heap": heap, "toast": toast, "indexes": indexes}
        states = dict(conn.execute("SELECT state, count(*) FROM requests GROUP BY 1").fetchall())
        out["states"] = states
        # the heap a pending row takes: the pages holding pending rows (written by inserts
        # only, at the table's fillfactor) per pending row
        pages = conn.execute("SELECT count(DISTINCT (ctid::text::point)[0]) FROM requests"
                             " WHERE state = 'pending'").fetchone()[0]
        out["pending_heap_per_row"] = pages * 8192 / max(states.get("pending", 0), 1)
        out["per_pending_request"] = summary(out)
        # every column of the release measured (``packed`` from schema 20)
        requests_columns = [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'requests'::regclass"
            " AND attnum > 0 AND NOT attisdropped ORDER BY attnum").fetchall()]
        sums = ", ".join(f"avg(pg_column_size({c}))" for c in requests_columns)
        for state in ("pending", "done"):
            row = conn.execute(
                f"SELECT avg(pg_column_size(requests.*)), {sums} FROM (SELECT * FROM requests"
                " WHERE state = %s LIMIT 100000) AS requests", (state,)).fetchone()
            out[f"{state}_row"] = float(row[0] or 0)
            out[f"{state}_columns"] = {c: float(v or 0) for c, v in
                                       zip(requests_columns, row[1:], strict=True)}
        columns = [r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'records'::regclass"
            " AND attnum > 0 AND NOT attisdropped ORDER BY attnum").fetchall()]
        row = conn.execute(
            "SELECT avg(pg_column_size(r.*)), "
            + ", ".join(f"avg(pg_column_size({c}))" for c in columns)
            + " FROM (SELECT * FROM records LIMIT 100000) AS r").fetchone()
        out["record_row"] = float(row[0] or 0)
        out["record_columns"] = {c: float(v or 0) for c, v in zip(columns, row[1:], strict=True)}
        out["database"] = conn.execute("SELECT pg_database_size(current_database())"
                                       ).fetchone()[0]
    return out


def sqlite_bytes(path: str) -> dict[str, Any]:
    import sqlite3

    conn = sqlite3.connect(path)
    out: dict[str, Any] = {"file": os.path.getsize(path)}
    try:
        sizes = dict(conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"))
    except sqlite3.OperationalError:  # a library built without dbstat
        sizes = {}
    out["objects"] = sizes
    out["states"] = dict(conn.execute("SELECT state, count(*) FROM requests GROUP BY 1"))
    columns = [r[1] for r in conn.execute("PRAGMA table_info(requests)")]
    for state in ("pending", "done"):
        row = conn.execute(
            "SELECT " + ", ".join(f"avg(coalesce(length(CAST({c} AS BLOB)), 0))"
                                  for c in columns)
            + " FROM (SELECT * FROM requests WHERE state = ? LIMIT 100000)", (state,)).fetchone()
        out[f"{state}_columns"] = dict(zip(columns, row, strict=True))
    columns = [r[1] for r in conn.execute("PRAGMA table_info(records)")]
    row = conn.execute("SELECT " + ", ".join(f"avg(coalesce(length(CAST({c} AS BLOB)), 0))"
                                             for c in columns)
                       + " FROM (SELECT * FROM records LIMIT 100000)").fetchone()
    out["record_columns"] = dict(zip(columns, row, strict=True))
    out["records"] = conn.execute("SELECT count(*) FROM records").fetchone()[0]
    out["requests"] = sum(out["states"].values())
    conn.close()
    return out


# -- latency --------------------------------------------------------------------------------

def server_cpu(postmaster: int | None) -> float:
    """CPU seconds of the PostgreSQL server's processes (the postmaster's children)."""
    if postmaster is None:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == postmaster or int(pid) == postmaster:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class Pages:
    """Page commits as the scheduler makes them (1 completion with its record, 8 new child
    requests, a claim of 1) and claims of 1, on one database, timed one by one."""

    def __init__(self, db: str, offset: int, postmaster: int | None) -> None:
        from scrapy_idempotent.store.base import UnitOfWork

        self.builder = Builder()
        self.store = open_built(db)
        self.numbers = iter(range(offset, offset + 10**9))
        self.postmaster = postmaster
        self.leased = list(self.store.commit(UnitOfWork(claim=1), WORKER).leased)
        self.page_ms: list[float] = []
        self.claim_ms: list[float] = []
        self.worker_s = self.server_s = self.wall_s = self.user_s = 0.0
        self.io = {"syscr": 0, "syscw": 0}

    def pages(self, count: int) -> None:
        from scrapy_idempotent.store.base import Completion, RequestState, UnitOfWork

        work = [([self.builder.request(next(self.numbers)) for _ in range(8)],
                 self.builder.record(next(self.numbers))) for _ in range(count)]
        cpu0, server0, user0, io0 = _cpu(), server_cpu(self.postmaster), _user(), _io()
        t_all = time.perf_counter()
        for children, record in work:
            lease = self.leased.pop()
            t0 = time.perf_counter()
            result = self.store.commit(UnitOfWork(
                requests=children, records=[(record, lease.key)],
                completions=[Completion(lease.key, RequestState.DONE)], claim=1), WORKER)
            self.page_ms.append(1000 * (time.perf_counter() - t0))
            self.leased.extend(result.leased)
        self.wall_s += time.perf_counter() - t_all
        self.worker_s += _cpu() - cpu0
        self.user_s += _user() - user0
        self.server_s += server_cpu(self.postmaster) - server0
        io = _io()
        for name in self.io:
            self.io[name] += io.get(name, 0) - io0.get(name, 0)

    def claims(self, count: int) -> None:
        from scrapy_idempotent.store.base import UnitOfWork

        for _ in range(count):
            t0 = time.perf_counter()
            self.leased.extend(self.store.commit(UnitOfWork(claim=1), WORKER).leased)
            self.claim_ms.append(1000 * (time.perf_counter() - t0))

    def report(self) -> dict[str, Any]:
        self.store.close()
        pages = len(self.page_ms)

        def pct(values: list[float], q: float) -> float:
            return sorted(values)[min(len(values) - 1, int(q * len(values)))]

        return {"pages": pages, "page_ms_median": statistics.median(self.page_ms),
                "page_ms_p99": pct(self.page_ms, 0.99),
                "claim_ms_median": statistics.median(self.claim_ms),
                "claim_ms_p99": pct(self.claim_ms, 0.99), "pages_per_s": pages / self.wall_s,
                "worker_cpu_ms_per_page": 1000 * self.worker_s / pages,
                "worker_user_ms_per_page": 1000 * self.user_s / pages,
                "reads_per_page": self.io["syscr"] / pages,
                "writes_per_page": self.io["syscw"] / pages,
                "server_cpu_ms_per_page": 1000 * self.server_s / pages}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _user() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def _io() -> dict[str, int]:
    """The ``read`` and ``write`` calls of this process so far (``/proc/self/io``; none
    where there is no such file)."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return {}
    return {name: int(value) for name, value in (line.split(": ") for line in lines)}


def latency(deep: str, empty: str, pages: int, postmaster: int | None,
            offset: int, compared: tuple[str, ...] = ()) -> dict[str, Any]:
    """Pages and claims on the deep and the empty frontier in turns (blocks of 100), so
    both see the same load; ``offset`` numbers the new children so they are new requests.
    Each of ``compared`` (SQLite files built before, each with its ``-empty`` beside) is
    measured in the same turns, its figures under its path."""
    pairs = {"": (deep, empty), **{path: (path, path + "-empty") for path in compared}}
    measured = {(name, side): Pages(db, offset * (1 + n), postmaster)
                for name, dbs in pairs.items()
                for n, (side, db) in enumerate(zip(("deep", "empty"), dbs, strict=True))}
    for _ in range(max(1, pages // 100)):
        for pages_of in measured.values():
            pages_of.pages(100)
            pages_of.claims(100)
    out: dict[str, Any] = {}
    for name in pairs:
        figures = {side: measured[name, side].report() for side in ("deep", "empty")}
        figures["ratio"] = {key: figures["deep"][key] / figures["empty"][key]
                            for key in figures["deep"]
                            if key != "pages" and figures["empty"][key]}
        if name:
            out[name] = figures
        else:
            out.update(figures)
    return out


# -- commands -------------------------------------------------------------------------------

def commands(db: str, work: Path, migrate: bool, only: set[str]) -> dict[str, float]:
    """Seconds of each operator command, run as a user runs it (a new process each);
    ``migrate`` (SQLite only, the command's source) copies the crawl into a new
    file beside (then removed)."""
    (work / "depth_spider.py").write_text(SPIDER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(work), env.get("PYTHONPATH")]))
    env["SCRAPY_SETTINGS_MODULE"] = "depth_settings"
    (work / "depth_settings.py").write_text(
        "SPIDER_MODULES = ['depth_spider']\nADDONS = {'scrapy_idempotent.Addon': 0}\n"
        f"IDEMPOTENT_DATABASE = {db!r}\n"
        "REQUEST_FINGERPRINTER_CLASS = 'scrapy.utils.request.RequestFingerprinter'\n")
    runs = {
        "status": ["status", "depth"],
        "check": ["check", "depth"],
        "failed": ["failed", "depth"],
        "export": ["export", "depth", "-o", "-", "--format", "jsonl"],
    }
    copy = None
    if migrate and not db.startswith(("postgresql://", "postgres://")):
        # (migrate copies from SQLite only: here into a new SQLite file beside)
        copy = db + "-copy"
        runs["migrate"] = ["migrate", "depth", "--to", copy]
    times: dict[str, float] = {}
    for name, argv in runs.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "scrapy", "idempotent", *argv], cwd=work,
                              env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL if name == "export" else subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, check=False)
        times[name] = time.perf_counter() - t0
        if done.returncode:  # (check answers 1 for a problem that needs a person)
            print(f"  {name} exited {done.returncode}: {(done.stdout or '')[-1500:]}"
                  f"{done.stderr[-1500:]}", flush=True)
    if not only or "metrics" in only:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", METRICS, db], env=env, check=True)
        times["metrics"] = time.perf_counter() - t0
    if copy is not None:
        drop_copy(copy)
    return times


def drop_copy(copy: str) -> None:
    if not copy.startswith(("postgresql://", "postgres://")):
        for path in Path(copy).parent.glob(Path(copy).name + "*"):
            path.unlink()
        return
    import psycopg

    from scrapy_idempotent.store.postgresql import _split_url

    url, schema = _split_url(copy)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


METRICS = '''
import sys
from prometheus_client import CollectorRegistry, generate_latest
from scrapy_idempotent.metrics import StoreCollector
from scrapy_idempotent.store import open_store

def opened():
    store = open_store(sys.argv[1])
    store.open_existing(readonly=True)
    return store

registry = CollectorRegistry(auto_describe=False)
registry.register(StoreCollector(opened))
assert b"idempotent_store_up 1.0" in generate_latest(registry)
'''


# -- main -----------------------------------------------------------------------------------

def measure(db: str, args: argparse.Namespace, postmaster: int | None,
            work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    postgres = db.startswith(("postgresql://", "postgres://"))
    out["bytes"] = pg_bytes(db) if postgres else sqlite_bytes(db)
    print(json.dumps({"bytes": out["bytes"]}, indent=1), flush=True)
    if not args.skip_commands:
        out["commands"] = commands(db, work, args.migrate,
                                   set(filter(None, args.commands.split(","))))
        print(json.dumps({"commands": out["commands"]}, indent=1), flush=True)
    return out


def fresh_empty(empty: str, deep: str, count: int, batch: int) -> None:
    """A new empty frontier of ``count`` requests for a ``--reuse`` run (each run adds 8
    requests a page to the frontiers it measures: an empty one kept from run to run grows,
    and the deep frontier is compared with a larger one each time); on SQLite of the deep
    file's page size."""
    from scrapy_idempotent.store import sqlite as sqlite_store

    drop_copy(empty)
    saved = sqlite_store.NEW_PAGE_SIZE
    if not deep.startswith(("postgresql://", "postgres://")):
        import sqlite3

        conn = sqlite3.connect(f"file:{deep}?mode=ro", uri=True)
        sqlite_store.NEW_PAGE_SIZE = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.close()
    t0 = time.perf_counter()
    try:
        build(empty, count, 0, batch)
    finally:
        sqlite_store.NEW_PAGE_SIZE = saved
    print(f"empty: built again, {count:,} in {time.perf_counter() - t0:.0f} s", flush=True)


def run(args: argparse.Namespace, deep: str, empty: str, postmaster: int | None,
        work: Path) -> None:
    print(f"load average before: {os.getloadavg()}", flush=True)
    for name, db, pending, done in (("empty", empty, args.empty, 0),
                                    ("deep", deep, args.pending, args.done)):
        if not args.reuse:
            t0 = time.perf_counter()
            built = build(db, pending, done, args.batch)
            if name == "deep" and args.copies:
                built["copies_s"] = replicate(db, args.copies)
            print(f"{name}: built {pending:,} + {done:,} in {time.perf_counter() - t0:.0f} s "
                  f"{built}", flush=True)
        elif name == "empty":
            fresh_empty(db, deep, args.empty, args.batch)
        else:  # an existing database: its open migrates it to this release's schema
            t0 = time.perf_counter()
            open_built(db).close()
            print(f"{name}: opened (and migrated) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        sub = argparse.Namespace(**{**vars(args), "pending": pending, "done": done})
        print(f"== {name}", flush=True)
        measure(db, sub, postmaster, work)
    for path in args.compare:
        fresh_empty(path + "-empty", path, args.empty, args.batch)
    if args.pages:
        print(f"== latency, deep and empty in turns (load {os.getloadavg()})", flush=True)
        # the new children's numbers: past the built ones, and new in each run (a
        # ``--reuse`` run again must add new requests, not duplicates of the last run's)
        measured = latency(deep, empty, args.pages, postmaster,
                           10 * (args.copies + 2) * (args.pending + args.done)
                           + time.time_ns() // 1000, tuple(args.compare))
        print(json.dumps({"latency": measured}, indent=1), flush=True)
    print(f"load average after: {os.getloadavg()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--done", type=int, default=200_000)
    parser.add_argument("--empty", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--pages", type=int, default=2000)
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--database", help="a postgresql:// URL (schemas depth_deep and "
                        "depth_empty are made in it)")
    parser.add_argument("--sqlite", help="the SQLite file to build (and PATH-empty beside)")
    parser.add_argument("--copies", type=int, default=0,
                        help="PostgreSQL: then copy the rows built this many times in SQL")
    parser.add_argument("--postmaster", type=int,
                        help="with --database on this machine: the server's PID, to count "
                        "its CPU")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--reuse", action="store_true")
    parser.add_argument("--skip-commands", action="store_true")
    parser.add_argument("--commands", default="",
                        help="only these commands (comma-separated: status, check, failed, "
                        "export, migrate, metrics)")
    parser.add_argument("--migrate", action="store_true",
                        help="also time `migrate --to` a new database (a copy of the crawl)")
    parser.add_argument("--pragma", action="append", default=[],
                        help="SQLite: a pragma for the connections of the stores measured "
                        "(e.g. cache_size=-262144, mmap_size=2147418112); repeatable")
    parser.add_argument("--compare", action="append", default=[],
                        help="SQLite: a file built before (with --keep; its -empty beside) "
                        "whose latency is measured in the same turns; repeatable")
    parser.add_argument("--page-size", type=int,
                        help="SQLite: the page size of the files built (default the "
                        "package's for new files)")
    args = parser.parse_args()
    PRAGMAS.extend(args.pragma)
    if args.page_size:
        from scrapy_idempotent.store import sqlite as sqlite_store

        sqlite_store.NEW_PAGE_SIZE = args.page_size
    with tempfile.TemporaryDirectory(prefix="depth-bench-") as tmp:
        work = Path(tmp)
        if args.sqlite:
            run(args, args.sqlite, args.sqlite + "-empty", None, work)
            if not args.keep:
                for path in Path(args.sqlite).parent.glob(Path(args.sqlite).name + "*"):
                    path.unlink()
            return
        if args.database:
            sep = "&" if "?" in args.database else "?"
            run(args, f"{args.database}{sep}schema=depth_deep",
                f"{args.database}{sep}schema=depth_empty", args.postmaster, work)
            return
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from postgres_server import INSTALL_HINT, find_binaries, running_cluster

        bindir = find_binaries()
        if bindir is None:
            raise SystemExit(INSTALL_HINT)
        with running_cluster(bindir) as cluster:
            postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
            run(args, cluster.new_database() + "?schema=depth",
                cluster.new_database() + "?schema=depth", postmaster, work)


if __name__ == "__main__":
    main()
