"""The embedded store: one SQLite file in WAL mode, one write transaction per unit of work.

Durability: with ``synchronous=NORMAL`` (default) a committed transaction survives the death
of the process (SIGKILL, OOM) but the last transactions may be lost on power failure;
``synchronous=FULL`` survives power failure too, at one fsync per commit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, cast

from ..exceptions import StoreBusy, StoreError
from ..workers import worker_state
from .base import (
    CommitResult,
    Completion,
    CrawlIdentity,
    EngineSetting,
    FailedRequest,
    FrontierEntry,
    FrontierStatus,
    FrontierStore,
    IntegrityReport,
    LeaseHolder,
    NewRequest,
    OutboxEntry,
    OutboxOutcome,
    OutboxRow,
    OutboxState,
    Record,
    RejectedItem,
    RejectsRetried,
    RepeatedRequest,
    RequestState,
    RequestSummary,
    RetriedFailed,
    RunInfo,
    RunMode,
    RunRecord,
    RunSummary,
    SchemaInfo,
    SessionInfo,
    StoredRecord,
    UnitOfWork,
    change_key,
    url_glob_matches,
)
from .rules import (
    CLAIMED_COLUMNS,
    QUEUE_ORDER,
    Enqueue,
    anomaly_checks,
    enqueue_decision,
    isolate_after,
    known_request_answer,
    quarantine_message,
    split_claim,
    starts_new_run,
    window_start,
)

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "SQLiteStore"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 7

#: Schema migrations: ``_MIGRATIONS[n]`` brings version n to n + 1, one transaction each.
_MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
        # A run is one pass over the site; its counters are cumulative over every session
        # (process) that worked on it, updated in the same transactions as the work.
        """CREATE TABLE runs (
            run_id INTEGER PRIMARY KEY,
            started_at REAL NOT NULL,
            finished_at REAL,
            reason TEXT,
            leased INTEGER NOT NULL DEFAULT 0,
            done INTEGER NOT NULL DEFAULT 0,
            failed INTEGER NOT NULL DEFAULT 0,
            redirected INTEGER NOT NULL DEFAULT 0,
            records_inserted INTEGER NOT NULL DEFAULT 0,
            records_updated INTEGER NOT NULL DEFAULT 0,
            records_unchanged INTEGER NOT NULL DEFAULT 0
        )""",
        """CREATE TABLE sessions (
            session_id INTEGER PRIMARY KEY,
            run_id INTEGER NOT NULL,
            worker TEXT NOT NULL,
            started_at REAL NOT NULL,
            ended_at REAL,
            reason TEXT
        )""",
        """CREATE TABLE requests (
            id INTEGER PRIMARY KEY,
            key TEXT NOT NULL UNIQUE,
            fingerprint TEXT NOT NULL,
            url TEXT NOT NULL,
            priority INTEGER NOT NULL,
            is_start INTEGER NOT NULL DEFAULT 0,
            state TEXT NOT NULL,
            data TEXT NOT NULL,
            parent_key TEXT,
            worker TEXT,
            leased_until REAL,
            attempts INTEGER NOT NULL DEFAULT 0,
            unfinished INTEGER NOT NULL DEFAULT 0,
            enqueued_at REAL NOT NULL,
            finished_at REAL,
            error_kind TEXT,
            error_message TEXT,
            run_id INTEGER NOT NULL
        )""",
        # Leasing reads the head of this index: O(log n) whatever the frontier size.
        """CREATE INDEX requests_pending ON requests (priority DESC, is_start, id DESC)
           WHERE state = 'pending'""",
        """CREATE INDEX requests_leased ON requests (worker, leased_until)
           WHERE state = 'leased'""",
        # An ordinary request's key is its fingerprint (the unique key index finds it); only
        # the others (dont_filter requests) need a fingerprint index.
        """CREATE INDEX requests_fingerprint ON requests (fingerprint)
           WHERE key != fingerprint""",
        """CREATE TABLE records (
            record_id TEXT PRIMARY KEY,
            source TEXT NOT NULL,
            natural_key TEXT NOT NULL,
            item_type TEXT NOT NULL,
            data TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            first_seen REAL NOT NULL,
            last_changed REAL NOT NULL,
            first_run_id INTEGER NOT NULL,
            changed_run_id INTEGER NOT NULL,
            request_key TEXT
        ) WITHOUT ROWID""",
        """CREATE INDEX records_last_changed ON records (last_changed)""",
        # Responses received for leased requests and not yet completed (the response journal).
        """CREATE TABLE responses (
            key TEXT PRIMARY KEY,
            data TEXT NOT NULL,
            body BLOB NOT NULL,
            stored_at REAL NOT NULL
        )""",
        """CREATE TABLE rejects (
            id INTEGER PRIMARY KEY,
            item_type TEXT NOT NULL,
            reason TEXT NOT NULL,
            data TEXT NOT NULL,
            request_key TEXT,
            created_at REAL NOT NULL,
            run_id INTEGER NOT NULL
        )""",
    ],
    [
        # The run that last stored or saw a record, and when it first did in that run: a
        # run's feeds hold the records of that run. Set in the page transaction; an unchanged
        # record costs one write the first time a run sees it, none after.
        """ALTER TABLE records ADD COLUMN seen_run_id INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE records ADD COLUMN seen_at REAL""",
        """UPDATE records SET seen_run_id = changed_run_id, seen_at = last_changed""",
        # Attempts answered from the response journal (not downloads).
        """ALTER TABLE requests ADD COLUMN replays INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE rejects ADD COLUMN page_url TEXT""",
        """ALTER TABLE rejects ADD COLUMN retried_at REAL""",
        # Size an appended feed had before a run first wrote to it.
        """CREATE TABLE feeds (
            run_id INTEGER NOT NULL,
            uri TEXT NOT NULL,
            base_size INTEGER NOT NULL,
            PRIMARY KEY (run_id, uri)
        )""",
    ],
    [
        # Scrapy's queue order: a request is taken first-in-first-out (start requests by
        # default) or last-in-first-out (other requests by default) within its priority and
        # queue; the pending index follows that order (rules.QUEUE_ORDER).
        """ALTER TABLE requests ADD COLUMN fifo INTEGER NOT NULL DEFAULT 0""",
        """DROP INDEX requests_pending""",
        """CREATE INDEX requests_pending ON requests
           (priority DESC, is_start, (CASE WHEN fifo THEN id ELSE -id END))
           WHERE state = 'pending'""",
    ],
    [
        # The order in which a run first stored or saw its records (its feeds' order): a
        # counter per run, taken in the page transaction.
        """ALTER TABLE records ADD COLUMN seen_seq INTEGER NOT NULL DEFAULT 0""",
        """ALTER TABLE runs ADD COLUMN seen_seq INTEGER NOT NULL DEFAULT 0""",
    ],
    [
        # A run's records in its feeds' order, read page by page (no read transaction held
        # while the feed exporter writes).
        """CREATE INDEX records_seen ON records (seen_run_id, seen_seq, seen_at, record_id)""",
    ],
    [
        # The outbox: one entry per record change and delivery target, written in the page
        # transaction that stored the change (only while targets are configured).
        """CREATE TABLE outbox (
            id INTEGER PRIMARY KEY,
            target TEXT NOT NULL,
            idempotency_key TEXT NOT NULL,
            kind TEXT NOT NULL,
            record_id TEXT NOT NULL,
            content_hash TEXT NOT NULL,
            item_type TEXT NOT NULL,
            source TEXT NOT NULL,
            natural_key TEXT NOT NULL,
            data TEXT,
            run_id INTEGER NOT NULL,
            created_at REAL NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            attempts INTEGER NOT NULL DEFAULT 0,
            due_at REAL NOT NULL,
            settled_at REAL,
            detail TEXT
        )""",
        """CREATE INDEX outbox_due ON outbox (target, due_at, id) WHERE state = 'pending'""",
    ],
    [
        # When the stored data was observed (its response received): a record is never
        # replaced by data observed before it. Existing rows: their latest commit (a change
        # or a run's first sight), the latest time known to have held their data.
        """ALTER TABLE records ADD COLUMN observed_at REAL NOT NULL DEFAULT 0""",
        """UPDATE records SET observed_at = max(last_changed, coalesce(seen_at, 0))""",
        # The record's change counter (1 when inserted, +1 per stored change), part of the
        # outbox key: every change has its own key, a change back to earlier content too.
        """ALTER TABLE records ADD COLUMN version INTEGER NOT NULL DEFAULT 1""",
    ],
]
assert len(_MIGRATIONS) == SCHEMA_VERSION

#: ``PRAGMA application_id`` of the package's databases ("SIDP"): a file with another one is
#: not ours, whatever its tables.
APPLICATION_ID = 0x53494450
#: The tables of each schema version: a file with any other table is not ours.
_TABLES_1 = frozenset({"meta", "runs", "sessions", "requests", "records", "responses",
                       "rejects"})
_TABLES: dict[int, frozenset[str]] = {1: _TABLES_1, 2: _TABLES_1 | {"feeds"},
                                      3: _TABLES_1 | {"feeds"}, 4: _TABLES_1 | {"feeds"},
                                      5: _TABLES_1 | {"feeds"},
                                      6: _TABLES_1 | {"feeds", "outbox"},
                                      7: _TABLES_1 | {"feeds", "outbox"}}
assert set(_TABLES) == set(range(1, SCHEMA_VERSION + 1))
#: Schema versions written before the application id was (files of those have none).
_BEFORE_APPLICATION_ID = frozenset({1, 2, 3})
#: Free pages (4 KiB each) left in the file before a periodic reclaim gives them back: 16 MiB.
RECLAIM_MIN_PAGES = 4096
#: Most free pages one step of a reclaim gives back (one write transaction each: 4 MiB).
RECLAIM_STEP_PAGES = 1024
#: While a crawl of the database runs, a reclaim stops stepping after this share of the busy
#: timeout (the rest of the free space stays in the file, reused, and is given back by a
#: later reclaim), so that workers waiting for the write lock never wait near their busy
#: timeout.
RECLAIM_BUSY_SHARE = 0.25
#: Databases whose one-time conversion to incremental auto-vacuum waits for other crawls to
#: end (warned once per process).
_CONVERSION_DEFERRED: set[str] = set()
#: The -wal file is truncated back to this size after a checkpoint (it grows with the largest
#: transactions, such as journaled responses of big pages, and would otherwise keep its peak).
WAL_SIZE_LIMIT_BYTES = 16 * 1024 * 1024

_BY_KEY = "SELECT id, state, finished_at FROM requests WHERE key = ?"
_BY_OTHER_KEY = ("SELECT id, state, finished_at FROM requests"
                 " WHERE fingerprint = ? AND key != fingerprint LIMIT 1")


def _os_cause(exc: OSError) -> str:
    """An operating system error in words a user acts on."""
    import errno

    if exc.errno == errno.ENOSPC:
        return f"the disk is full ({exc})"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the file system or directory is read-only or not writable by this user ({exc})"
    return str(exc)


class SQLiteStore(FrontierStore):
    """The :class:`~.FrontierStore` on one SQLite file.

    :param path: database file; its directory is created if missing; a new file is created
        readable and writable by its owner only (0600).
    :param lease_seconds: how long a claim lasts unless renewed.
    :param max_attempts: a request that was started (handed to the engine) this many times
        in a row without completing (its worker died, or its lease expired) is failed as
        ``quarantined`` instead of being handed out again: a page that kills the worker every
        time. Retries complete their lease and do not count; nor do leases of requests that
        were claimed but never started.
    :param clock: unix seconds; injected so tests drive lease expiry without sleeping.
    :param synchronous: ``NORMAL`` or ``FULL`` (see the module docstring).
    :param busy_timeout_seconds: how long a statement waits for another process's write lock.
    :param recrawl_seconds: the recrawl window. None: a new run starts from an empty frontier
        and a request done in a run is never fetched again in that run. A number W: a new run
        keeps the frontier, and a request done in an earlier window (``floor(t / W)``, unix
        seconds) than the current one is due again when it is enqueued again.
    """

    def __init__(
        self,
        path: str,
        *,
        lease_seconds: float = 60.0,
        max_attempts: int = 10,
        clock: Callable[[], float] = time.time,
        synchronous: str = "NORMAL",
        busy_timeout_seconds: float = 10.0,
        recrawl_seconds: float | None = None,
    ) -> None:
        self.path = path
        self.recrawl_seconds = recrawl_seconds
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self.isolate_after = isolate_after(max_attempts)
        self.clock = clock
        self.synchronous = synchronous
        self.busy_timeout_seconds = busy_timeout_seconds
        self.run_id: int | None = None
        self.transactions = 0  #: write transactions committed by this object
        self._conn: sqlite3.Connection | None = None
        #: the read connection of an open crawl (see :attr:`reader`)
        self._read: sqlite3.Connection | None = None
        self._read_thread: int | None = None  #: the thread that opened the reader
        self._wal: int | None = None  #: inode of the -wal file this connection writes

    # -- connection and schema --------------------------------------------------------------

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"store {self.path} is not open")
        return self._conn

    @property
    def reader(self) -> sqlite3.Connection:
        """The connection of the reads a crawl makes while its writes run on another thread
        (:mod:`scrapy_idempotent.writer`): a second connection, opened by :meth:`open` in the
        thread that opens the store and used only by it. In WAL mode its reads never wait
        for a writer (this process's or another's) and see every committed transaction.
        Without one (the commands' :meth:`open_existing`), or on another thread (the
        writer's: a read it runs in order with its writes), the write connection."""
        if self._read is not None and threading.get_ident() == self._read_thread:
            return self._read
        return self.conn

    def open(self, *, fingerprinter: str = "",
             identity: CrawlIdentity | None = None) -> str | None:
        fix = "; set IDEMPOTENT_DATABASE to a writable file path"
        if os.path.isdir(self.path):
            raise StoreError(f"{self.path} is a directory, not a database file{fix}")
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the directory of {self.path}: "
                             f"{_os_cause(exc)}{fix}") from exc
        try:
            # a dangling symbolic link (O_EXCL refuses to follow it) is created at its target,
            # readable by its owner only like any new database (SQLite would follow the link
            # and create the file with the umask's mode)
            created = (os.path.realpath(self.path) if os.path.islink(self.path)
                       and not os.path.exists(self.path) else self.path)
            os.close(os.open(created, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600))
        except FileExistsError:
            pass  # an existing database
        except OSError as exc:
            raise StoreError(f"cannot create the database {self.path}: "
                             f"{_os_cause(exc)}{fix}") from exc
        try:
            # the write connection: a crawl hands it to its writer thread (one thread at a
            # time uses it: the opener's, then the writer's, then the opener's again)
            conn = sqlite3.connect(self.path, isolation_level=None,
                                   timeout=self.busy_timeout_seconds, check_same_thread=False)
        except sqlite3.Error as exc:
            raise self._error(exc, "opening") from exc
        self._conn = conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_seconds * 1000)}")
            version, new = self._check_ownership(conn)
            if identity is not None and not new:
                # another crawl's database is refused here, read-only: before any pragma
                # write, migration or vacuum changes a byte of it
                self._check_identity(self._stored_identity(conn), identity)
            if new:
                # Freed pages (journaled responses are deleted as their requests complete)
                # go back to the file system: set before the first table exists.
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            # WAL is switched on outside any transaction, and only when it is not on already.
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            conn.execute("PRAGMA cache_size = -32768")  # KiB: 32 MiB of page cache, not 2
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT_BYTES}")
            for step in range(version, SCHEMA_VERSION):
                with self._write() as cur:
                    current = cur.execute("PRAGMA user_version").fetchone()[0]
                    if current != step:  # another process migrated meanwhile
                        continue
                    for statement in _MIGRATIONS[step]:
                        cur.execute(statement)
                    cur.execute(f"PRAGMA user_version = {step + 1}")
                    cur.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            if not new and conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0:
                others = self._live_sessions(conn)
                if not others:
                    self._convert_to_incremental_vacuum(conn)
                elif self.path not in _CONVERSION_DEFERRED:
                    _CONVERSION_DEFERRED.add(self.path)
                    logger.warning(
                        "scrapy_idempotent: %s keeps the space of deleted rows: the one-time "
                        "VACUUM that gives it back waits until no other crawl uses the "
                        "database (%d running: %s)", self.path, len(others),
                        ", ".join(others[:3]))
            with self._write() as cur:
                if cur.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
                    cur.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                cur.execute("INSERT OR IGNORE INTO meta VALUES ('fingerprinter', ?)",
                            (fingerprinter,))
                cur.execute("INSERT OR IGNORE INTO meta VALUES ('created_at', ?)",
                            (repr(self.clock()),))
                stored = cur.execute(
                    "SELECT value FROM meta WHERE key = 'fingerprinter'").fetchone()[0]
                if identity is not None:
                    self._claim_identity(cur, identity)
            self._read = self._open_reader()
            self._read_thread = threading.get_ident()
        except StoreError:
            self.close()
            raise
        except sqlite3.Error as exc:
            self.close()
            raise self._error(exc, "opening") from exc
        return stored if stored != fingerprinter else None

    def _live_sessions(self, conn: sqlite3.Connection) -> list[str]:
        """The workers of the sessions of other crawls that still run: not ended, and of a
        process known to run (of this host and PID namespace); a worker whose process cannot
        be looked up from here (another host, another PID namespace, an id of an older
        release) counts while it holds an unexpired lease."""
        leasing = {worker for (worker,) in conn.execute(
            "SELECT DISTINCT worker FROM requests WHERE state = 'leased' AND leased_until >= ?",
            (self.clock(),))}
        live = []
        for (worker,) in conn.execute(
                "SELECT DISTINCT worker FROM sessions WHERE ended_at IS NULL ORDER BY worker"):
            state = worker_state(worker)
            if state == "alive" or (state != "dead" and worker in leasing):
                live.append(worker)
        return live

    def _convert_to_incremental_vacuum(self, conn: sqlite3.Connection) -> None:
        """A database made by an earlier version never gave freed pages back to the file
        system: switch it to incremental auto-vacuum, which takes one VACUUM (a rewrite of
        the file, holding the write lock meanwhile; it needs free disk space the size of the
        file). Only called when no other crawl of the database runs (it would wait for the
        lock longer than their busy timeout). Skipped, with a warning, when it cannot be done
        now."""
        _CONVERSION_DEFERRED.discard(self.path)
        began = time.monotonic()
        try:
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            conn.execute("VACUUM")
        except sqlite3.Error as exc:
            logger.warning("scrapy_idempotent: %s keeps the space of deleted rows: the "
                           "one-time VACUUM that would give it back failed (%s)", self.path,
                           exc)
            return
        logger.info("scrapy_idempotent: %s switched to incremental auto-vacuum (one-time "
                    "VACUUM, %.1f s)", self.path, time.monotonic() - began)

    def reclaim_space(self, *, everything: bool = False) -> int:
        conn = self.conn
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        if not free or (not everything and free < RECLAIM_MIN_PAGES):
            return 0
        if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # not INCREMENTAL
            return 0
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        began = time.monotonic()
        left = free
        try:
            # bounded steps, one write transaction each, so the write lock is never held for
            # long; while any crawl of the database runs (this one too, until its session
            # ends), no more steps once a share of the busy timeout has gone by
            budget = (self.busy_timeout_seconds * RECLAIM_BUSY_SHARE
                      if self._live_sessions(conn) else None)
            while left:
                self._check_wal()
                # each step of the pragma frees one page, and execute() steps a statement
                # that returns no row once: executescript() steps it to the end
                conn.executescript(f"PRAGMA incremental_vacuum({RECLAIM_STEP_PAGES});")
                self.transactions += 1
                before, left = left, conn.execute("PRAGMA freelist_count").fetchone()[0]
                if left >= before or (budget is not None
                                      and time.monotonic() - began > budget):
                    break
            if everything:  # copy the WAL into the file and cut it to nothing
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            raise self._error(exc, "giving free space back") from exc
        return int((free - left) * page_size)

    def _check_ownership(self, conn: sqlite3.Connection) -> tuple[int, bool]:
        """Refuse, before anything in the file changes, a database that is not this
        package's: any table it does not create, an application id or a ``user_version`` it
        did not write. Returns the schema version found and whether the file is new (empty).
        """
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {name for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"
            " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'")}
        if not tables and version == 0 and app_id in (0, APPLICATION_ID):
            return 0, True
        ours = app_id == APPLICATION_ID or (
            # written before the application id existed: exactly the tables of its version
            app_id == 0 and version in _BEFORE_APPLICATION_ID and tables == _TABLES[version])
        if ours and version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has schema version {version}, newer than this "
                f"scrapy_idempotent supports ({SCHEMA_VERSION}); upgrade the package"
            )
        if ours and version >= 1 and tables <= _TABLES[version]:
            return version, False
        shown = ", ".join(sorted(tables)[:8]) or "none"
        raise StoreError(
            f"{self.path} is not a scrapy_idempotent database (tables: {shown}; "
            f"user_version {version}, application_id {app_id}); it was left untouched: "
            "set IDEMPOTENT_DATABASE to another file"
        )

    @staticmethod
    def _stored_identity(conn: sqlite3.Connection | sqlite3.Cursor) -> dict[str, str]:
        """The crawl identity recorded in the file (empty if none yet); only reads."""
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
                        ).fetchone() is None:
            return {}
        return dict(conn.execute(
            "SELECT key, value FROM meta WHERE key IN ('project', 'spider', 'source')"))

    def _claim_identity(self, cur: sqlite3.Cursor, identity: CrawlIdentity) -> None:
        """Record whose database this is at its first open (a database of an earlier
        version gets it now); refuse another crawl's (checked again here, in the write
        transaction, for a crawl that claimed the file since the read-only check)."""
        stored = self._stored_identity(cur)
        if not stored:
            cur.executemany("INSERT INTO meta VALUES (?, ?)", [
                ("project", identity.project), ("spider", identity.spider),
                ("source", identity.source)])
            return
        self._check_identity(stored, identity)

    def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None:
        """Refuse the database whose recorded identity ``stored`` is another crawl's (an
        empty one is nobody's yet: the first open records it)."""
        if not stored:
            return
        owner = CrawlIdentity(project=stored.get("project", ""),
                              spider=stored.get("spider", ""), source=stored.get("source", ""))
        if owner == identity:
            return
        whose = (f"{self.path} belongs to spider {owner.spider!r} of project "
                 f"{owner.project!r} (record source {owner.source!r})")
        this = (f"this crawl is spider {identity.spider!r} of project {identity.project!r} "
                f"(record source {identity.source!r})")
        if (owner.project, owner.spider) == (identity.project, identity.spider):
            hint = (f"its records were stored under source {owner.source!r}: set "
                    f"IDEMPOTENT_SOURCE = {owner.source!r} to continue them, or "
                    "IDEMPOTENT_DATABASE to another file for the new source")
        else:
            hint = ("each crawl needs its own database: set IDEMPOTENT_DATABASE to another "
                    "file (a path containing {spider} gives each spider its own; the default "
                    "is one file per spider in each project's .scrapy directory)")
        raise StoreError(f"{whose}; {this}; it was left untouched: {hint}")

    def _error(self, exc: sqlite3.Error, doing: str) -> StoreError:
        """The :class:`~.StoreError` that names the real cause of a SQLite error; only a
        busy or locked database is a :class:`~.StoreBusy` (worth retrying)."""
        name = _error_name(exc)
        where = f"the database {self.path}"
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            return StoreBusy(
                f"{where} is locked by another process longer than "
                f"IDEMPOTENT_BUSY_TIMEOUT_SECONDS ({self.busy_timeout_seconds:g} s) allows "
                f"while {doing} ({exc})")
        if name == "SQLITE_FULL":
            return StoreError(f"the disk holding {where} is full while {doing} ({exc}): "
                              "free some space")
        if name == "SQLITE_READONLY_DBMOVED":
            return StoreError(f"{where} was moved or deleted while in use ({exc})")
        if name.startswith("SQLITE_READONLY") or name == "SQLITE_CANTOPEN":
            return StoreError(
                f"{where} is read-only ({exc}): the file, or its directory (SQLite writes "
                "-wal and -shm files beside it), cannot be written by this process; make it "
                "writable, or set IDEMPOTENT_DATABASE to a writable path")
        if name.startswith("SQLITE_IOERR"):
            return StoreError(
                f"I/O error on {where} while {doing} ({exc}, {name}): the disk failed, or "
                "a file of the database (-wal, -shm) was deleted or truncated while in use")
        if name in ("SQLITE_NOTADB", "SQLITE_CORRUPT") or "not a database" in str(exc):
            return StoreError(
                f"{self.path} is not a scrapy_idempotent database, or is damaged ({exc}); "
                "it was left untouched: restore it from a backup, or set "
                "IDEMPOTENT_DATABASE to another path")
        if "no such table" in str(exc) or "no such column" in str(exc):
            return StoreError(
                f"{where} does not have the schema this scrapy_idempotent expects ({exc}); "
                "was it changed by hand or by another program?")
        return StoreError(f"cannot use {where} while {doing}: {exc} ({name or 'error'})")

    def _open_reader(self) -> sqlite3.Connection:
        reader = sqlite3.connect(self.path, isolation_level=None,
                                 timeout=self.busy_timeout_seconds)
        try:
            reader.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_seconds * 1000)}")
            reader.execute("PRAGMA cache_size = -32768")
            reader.execute("PRAGMA query_only = 1")
        except sqlite3.Error:
            reader.close()
            raise
        return reader

    def close(self) -> None:
        if self._read is not None:
            self._read.close()
            self._read = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._wal = None

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        """The one write-transaction primitive: ``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled
        back on any exception, so a transaction is all or nothing."""
        conn = self.conn
        self._check_wal()
        cur = conn.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._error(exc, "starting a write") from exc
        try:
            yield cur
            cur.execute("COMMIT")
        except BaseException as exc:
            # SQLite may have rolled back already (SQLITE_FULL, an I/O error): only roll back
            # what is still open, so the original error is the one that surfaces.
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise self._error(exc, "writing") from exc
            raise
        self.transactions += 1
        if self._wal is None:
            with contextlib.suppress(OSError):
                self._wal = os.stat(f"{self.path}-wal").st_ino

    def _check_wal(self) -> None:
        """A -wal file deleted (or replaced) under an open connection swallows every commit
        that follows, silently: they vanish when the process ends. Refuse to write then."""
        if self._wal is None:
            return
        try:
            inode = os.stat(f"{self.path}-wal").st_ino
        except OSError:
            inode = None
        if inode != self._wal:
            raise StoreError(
                f"the write-ahead log {self.path}-wal was deleted or replaced while the "
                "database was open: what was committed since its last checkpoint is lost, "
                "and later commits would be too; nothing more is written. Never delete "
                "-wal or -shm files of a database in use; run the crawl again to resume "
                "from what the database holds")

    # -- runs and sessions ------------------------------------------------------------------

    def begin_session(self, worker: str, run_mode: RunMode) -> RunInfo:
        now = self.clock()
        with self._write() as cur:
            last = cur.execute(
                "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1"
            ).fetchone()
            new = starts_new_run(run_mode, None if last is None else last[1] is not None)
            if new:
                # an earlier run left unfinished (IDEMPOTENT_RUN_MODE = fresh) ends here
                cur.execute(
                    "UPDATE runs SET finished_at = ?, reason = 'superseded'"
                    " WHERE finished_at IS NULL",
                    (now,),
                )
                if self.recrawl_seconds is None:
                    cur.execute("DELETE FROM requests")
                else:  # keep what was done in the current window
                    cur.execute(
                        "DELETE FROM requests WHERE state NOT IN"
                        " ('done', 'failed', 'redirected') OR finished_at < ?",
                        (window_start(self.recrawl_seconds, now),),
                    )
                cur.execute("DELETE FROM responses")
                run_id = cur.execute(
                    "INSERT INTO runs (started_at) VALUES (?)", (now,)).lastrowid
            else:
                run_id = last[0]
            assert run_id is not None
            cur.execute(
                "INSERT INTO sessions (run_id, worker, started_at) VALUES (?, ?, ?)",
                (run_id, worker, now),
            )
        self.run_id = run_id
        return RunInfo(run_id=run_id, new=new, counts=self.counts())

    def end_session(self, worker: str, reason: str, inflight: Sequence[str] = (), *,
                    finish_run: bool = True) -> int:
        now = self.clock()
        with self._write() as cur:
            cur.executemany(
                "UPDATE requests SET unfinished = unfinished - 1"
                " WHERE key = ? AND state = 'leased' AND worker = ? AND unfinished > 0",
                [(key, worker) for key in inflight],
            )
            released = self._release(cur, [worker])
            cur.execute(
                "UPDATE sessions SET ended_at = ?, reason = ? "
                "WHERE worker = ? AND ended_at IS NULL",
                (now, reason, worker),
            )
            if reason == "finished" and finish_run and self.run_id is not None:
                busy = cur.execute(
                    "SELECT EXISTS (SELECT 1 FROM requests WHERE state IN ('pending', 'leased'))"
                ).fetchone()[0]
                if not busy:
                    cur.execute(
                        "UPDATE runs SET finished_at = ?, reason = ? "
                        "WHERE run_id = ? AND finished_at IS NULL",
                        (now, reason, self.run_id),
                    )
        return released

    # -- the unit of work -------------------------------------------------------------------

    def commit(self, work: UnitOfWork, worker: str) -> CommitResult:
        result = CommitResult()
        if not work:
            return result
        run_id = self.run_id if self.run_id is not None else 0
        now = self.clock()
        with self._write() as cur:
            lost = self._fence(cur, work, worker)
            requests = [r for r in work.requests if r.parent_key not in lost] if lost \
                else work.requests
            self._insert_requests(cur, requests, now, run_id, result)
            records = [r for r in work.records if r[1] not in lost] if lost else work.records
            changes = self._upsert_records(cur, records, now, run_id, result)
            if work.outbox_targets and changes:
                self._write_outbox(cur, changes, work.outbox_targets, now, run_id, result)
            for reject in work.rejects:
                if reject.request_key in lost:
                    continue
                cur.execute(
                    "INSERT INTO rejects (item_type, reason, data, request_key, page_url,"
                    " created_at, run_id) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (reject.item_type, reject.reason, reject.data, reject.request_key,
                     reject.page_url, now, run_id),
                )
                result.rejects += 1
            responses = [r for r in work.responses if r[0] not in lost]
            if responses:
                cur.executemany(
                    "INSERT OR REPLACE INTO responses (key, data, body, stored_at)"
                    " VALUES (?, ?, ?, ?)",
                    [(key, data, body, now) for key, data, body in responses],
                )
            started = [key for key in work.started if key not in lost]
            if started:
                cur.executemany(
                    "UPDATE requests SET attempts = attempts + 1, unfinished = unfinished + 1"
                    " WHERE key = ? AND state = 'leased' AND worker = ?",
                    [(key, worker) for key in started],
                )
            replayed = [key for key in work.replayed if key not in lost]
            if replayed:
                cur.executemany(
                    "UPDATE requests SET replays = replays + 1"
                    " WHERE key = ? AND state = 'leased' AND worker = ?",
                    [(key, worker) for key in replayed],
                )
            self._complete(cur, work.completions, lost, worker, now, result)
            if work.give_back:
                cur.executemany(
                    "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"
                    " WHERE key = ? AND state = 'leased' AND worker = ?",
                    [(key, worker) for key in work.give_back],
                )
            if work.claim:
                self._claim(cur, worker, work.claim, now, result)
            self._count(cur, result, run_id, len(started))
        return result

    def _fence(self, cur: sqlite3.Cursor, work: UnitOfWork, worker: str) -> set[str]:
        """The keys of ``work`` (completions, journaled responses, starts) whose request is
        not leased by ``worker`` any more: another worker took it after the lease expired,
        or it was finished or released meanwhile. Nothing of their unit of work is written:
        not the completion, nor the records, rejects and child requests it produced, nor a
        journaled response (the lease is the fence of the whole unit of work)."""
        keys = {c.key for c in work.completions}
        keys.update(key for key, _, _ in work.responses)
        keys.update(work.started)
        if not keys:
            return set()
        held: set[str] = set()
        ordered = sorted(keys)
        for i in range(0, len(ordered), 500):
            chunk = ordered[i:i + 500]
            marks = ", ".join("?" * len(chunk))
            held.update(key for (key,) in cur.execute(
                f"SELECT key FROM requests WHERE key IN ({marks})"
                " AND state = 'leased' AND worker = ?", (*chunk, worker)))
        return keys - held

    def _insert_requests(self, cur: sqlite3.Cursor, requests: list[NewRequest], now: float,
                         run_id: int, result: CommitResult) -> None:
        window = window_start(self.recrawl_seconds, now)
        for req in requests:
            known = self._find(cur, req.key, req.fingerprint, req.filter_fingerprint)
            if known is None:
                cur.execute(
                    "INSERT INTO requests (key, fingerprint, url, priority, is_start, fifo,"
                    " state, data, parent_key, enqueued_at, run_id)"
                    " VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?, ?)",
                    (req.key, req.fingerprint, req.url, req.priority, int(req.is_start),
                     int(req.fifo), req.data, req.parent_key, now, run_id),
                )
                result.requests_added += 1
                continue
            decision = enqueue_decision(known[1], known[2], window)
            if decision is Enqueue.DUPLICATE:
                result.requests_duplicate += 1
            elif decision is Enqueue.DUE_AGAIN:
                cur.execute(
                    "UPDATE requests SET state = 'pending', data = ?, priority = ?,"
                    " is_start = ?, fifo = ?, attempts = 0, finished_at = NULL,"
                    " error_kind = NULL, error_message = NULL, enqueued_at = ?, run_id = ?"
                    " WHERE id = ?",
                    (req.data, req.priority, int(req.is_start), int(req.fifo), now, run_id,
                     known[0]),
                )
                result.requests_due_again += 1
            else:
                result.requests_already_done += 1

    def _upsert_records(self, cur: sqlite3.Cursor, records: list[tuple[Record, str | None]],
                        now: float, run_id: int,
                        result: CommitResult) -> list[tuple[str, Record, int]]:
        """Upsert ``records``; returns the changes written: ``(kind, record, version)`` with
        kind ``inserted`` or ``updated`` (an unchanged or stale record is no change)."""
        changes: list[tuple[str, Record, int]] = []
        if not records:
            return changes
        # The times users read never go backwards, whatever the wall clock does (a
        # backward step, a worker whose clock lags): a record written now gets a time no
        # earlier than any record's last change (one read at the end of the index), so
        # first_seen <= last_changed always, and `export --since` with a time the data
        # showed finds every change made after it.
        newest = cur.execute("SELECT max(last_changed) FROM records").fetchone()[0]
        if newest is not None and newest > now:
            now = newest
        row = cur.execute("SELECT seen_seq FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        first = seq = row[0] if row is not None else 0
        for record, request_key in records:
            # a record without its observation time was observed at its commit
            observed = record.observed_at if record.observed_at is not None else now
            taken, change = self._upsert_record(cur, record, request_key, run_id, now,
                                                observed, seq + 1, result)
            if taken:
                seq += 1
            if change is not None:
                changes.append((change[0], record, change[1]))
        if seq != first:
            cur.execute("UPDATE runs SET seen_seq = ? WHERE run_id = ?", (seq, run_id))
        return changes

    @staticmethod
    def _write_outbox(cur: sqlite3.Cursor, changes: list[tuple[str, Record, int]],
                      targets: tuple[str, ...], now: float, run_id: int,
                      result: CommitResult) -> None:
        """One outbox entry per change and target, in the transaction of the change."""
        cur.executemany(
            "INSERT INTO outbox (target, idempotency_key, kind, record_id, content_hash,"
            " item_type, source, natural_key, data, run_id, created_at, due_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(target, change_key(record, version), kind, record.record_id,
              record.content_hash, record.item_type, record.source, record.natural_key,
              record.data, run_id, now, now)
             for kind, record, version in changes for target in targets])
        result.outbox_entries += len(changes) * len(targets)

    @staticmethod
    def _complete(cur: sqlite3.Cursor, completions: list[Completion], lost: set[str],
                  worker: str, now: float, result: CommitResult) -> None:
        for done in completions:
            if done.key in lost:
                result.leases_lost += 1
                result.lost.append(done.key)
                continue
            if done.state is RequestState.PENDING:
                cur.execute(
                    "UPDATE requests SET state = 'pending', worker = NULL,"
                    " leased_until = NULL, unfinished = 0, data = COALESCE(?, data),"
                    " priority = COALESCE(?, priority), error_kind = ?, error_message = ?"
                    " WHERE key = ? AND state = 'leased' AND worker = ?",
                    (done.data, done.priority, done.error_kind, done.error_message,
                     done.key, worker),
                )
            else:
                cur.execute(
                    "UPDATE requests SET state = ?, worker = NULL, leased_until = NULL,"
                    " unfinished = 0, finished_at = ?, error_kind = ?, error_message = ?"
                    " WHERE key = ? AND state = 'leased' AND worker = ?",
                    (done.state.value, now, done.error_kind, done.error_message, done.key,
                     worker),
                )
            if cur.rowcount:  # only the lease holder's completion ends the journal entry
                cur.execute("DELETE FROM responses WHERE key = ?", (done.key,))
                result.completed[done.state.value] = (
                    result.completed.get(done.state.value, 0) + 1)
            else:  # the same key completed twice in one unit
                result.leases_lost += 1
                result.lost.append(done.key)

    @staticmethod
    def _upsert_record(cur: sqlite3.Cursor, record: Record, request_key: str | None,
                       run_id: int, now: float, observed: float, seq: int,
                       result: CommitResult) -> tuple[bool, tuple[str, int] | None]:
        """Insert, update (content changed) or leave the record alone (same content), and
        mark it seen in ``run_id`` as the run's ``seq``-th record: an unchanged record is
        written only the first time a run sees it, or to move its observation time forward.
        Data ``observed`` before the stored data's observation is refused: nothing is
        written. Returns whether ``seq`` was taken, and the change stored (kind, version)."""
        row = cur.execute(
            "SELECT content_hash, seen_run_id, observed_at, version FROM records"
            " WHERE record_id = ?", (record.record_id,),
        ).fetchone()
        if row is None:
            cur.execute(
                "INSERT INTO records (record_id, source, natural_key, item_type, data,"
                " content_hash, first_seen, last_changed, first_run_id, changed_run_id,"
                " request_key, seen_run_id, seen_at, seen_seq, observed_at, version)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)",
                (record.record_id, record.source, record.natural_key, record.item_type,
                 record.data, record.content_hash, now, now, run_id, run_id,
                 request_key, run_id, now, seq, observed),
            )
            result.records_inserted += 1
            return True, ("inserted", 1)
        content_hash, seen_run_id, stored_observed, version = row
        first_sight = bool(seen_run_id != run_id)
        if observed < stored_observed:
            # older than what is stored (a page downloaded earlier, committed later): the
            # data stays; the record is still one this run saw (its feeds list it)
            result.records_stale += 1
            if first_sight:
                cur.execute("UPDATE records SET seen_run_id = ?, seen_at = ?, seen_seq = ?"
                            " WHERE record_id = ?", (run_id, now, seq, record.record_id))
            return first_sight, None
        if content_hash != record.content_hash:
            cur.execute(
                "UPDATE records SET data = ?, content_hash = ?, item_type = ?,"
                " last_changed = ?, changed_run_id = ?, request_key = ?, observed_at = ?,"
                " version = version + 1,"
                " seen_at = CASE WHEN seen_run_id = ? THEN seen_at ELSE ? END,"
                " seen_seq = CASE WHEN seen_run_id = ? THEN seen_seq ELSE ? END,"
                " seen_run_id = ? WHERE record_id = ?",
                (record.data, record.content_hash, record.item_type, now, run_id,
                 request_key, observed, run_id, now, run_id, seq, run_id, record.record_id),
            )
            result.records_updated += 1
            return first_sight, ("updated", version + 1)
        if first_sight:
            cur.execute(
                "UPDATE records SET seen_run_id = ?, seen_at = ?, seen_seq = ?,"
                " observed_at = ? WHERE record_id = ?",
                (run_id, now, seq, observed, record.record_id))
        elif observed > stored_observed:
            # the same data observed later: an older observation must not replace it
            cur.execute("UPDATE records SET observed_at = ? WHERE record_id = ?",
                        (observed, record.record_id))
        result.records_unchanged += 1
        return first_sight, None

    @staticmethod
    def _count(cur: sqlite3.Cursor, result: CommitResult, run_id: int, started: int) -> None:
        """Add this transaction's work to the run's cumulative counters (same transaction)."""
        done = result.completed
        deltas = (
            started, done.get("done", 0),
            done.get("failed", 0) + len(result.quarantined), done.get("redirected", 0),
            result.records_inserted, result.records_updated, result.records_unchanged,
        )
        if any(deltas):
            cur.execute(
                "UPDATE runs SET leased = leased + ?, done = done + ?, failed = failed + ?,"
                " redirected = redirected + ?, records_inserted = records_inserted + ?,"
                " records_updated = records_updated + ?,"
                " records_unchanged = records_unchanged + ? WHERE run_id = ?",
                (*deltas, run_id),
            )

    def _claim(self, cur: sqlite3.Cursor, worker: str, count: int, now: float,
               result: CommitResult) -> None:
        until = now + self.lease_seconds
        rows = cur.execute(
            "UPDATE requests SET state = 'leased', worker = ?, leased_until = ?"
            " WHERE id IN (SELECT id FROM requests INDEXED BY requests_pending"
            "  WHERE state = 'pending'"
            f"  ORDER BY {QUEUE_ORDER} LIMIT ?) RETURNING {', '.join(CLAIMED_COLUMNS)}",
            (worker, until, count),
        ).fetchall()
        leased, over = split_claim(rows, self.max_attempts, until)
        if over:
            cur.executemany(
                "UPDATE requests SET state = 'failed', worker = NULL, leased_until = NULL,"
                " unfinished = 0, finished_at = ?, error_kind = 'quarantined',"
                " error_message = ? WHERE key = ?",
                [(now, quarantine_message(r.unfinished), r.key) for r in over],
            )
            result.quarantined.extend(r.url for r in over)
        result.leased.extend(leased)

    # -- the outbox --------------------------------------------------------------------------

    def claim_outbox(self, targets: Sequence[str], limit: int, hold_seconds: float, *,
                     exclude: Collection[int] = ()) -> list[OutboxEntry]:
        if not targets or limit <= 0:
            return []
        now = self.clock()
        marks = ", ".join("?" * len(targets))
        skip = ", ".join("?" * len(exclude))
        with self._write() as cur:
            rows = cur.execute(
                "UPDATE outbox SET due_at = ? WHERE id IN (SELECT id FROM outbox"
                f"  WHERE state = 'pending' AND target IN ({marks}) AND due_at <= ?"
                + (f" AND id NOT IN ({skip})" if exclude else "")
                + "  ORDER BY due_at, id LIMIT ?)"
                " RETURNING id, target, idempotency_key, kind, record_id, content_hash,"
                " item_type, source, natural_key, data, run_id, created_at, attempts, due_at",
                (now + hold_seconds, *targets, now, *exclude, limit),
            ).fetchall()
        rows.sort(key=lambda r: r[0])  # RETURNING gives no order
        return [OutboxEntry(entry_id=r[0], target=r[1], key=r[2], kind=r[3], record_id=r[4],
                            content_hash=r[5], item_type=r[6], source=r[7],
                            natural_key=r[8], data=r[9] or "{}", run_id=r[10],
                            created_at=r[11], attempts=r[12], held_until=r[13])
                for r in rows]

    def settle_outbox(self, outcomes: Sequence[OutboxOutcome]) -> list[OutboxOutcome]:
        if not outcomes:
            return []
        now = self.clock()
        settled: list[OutboxOutcome] = []
        with self._write() as cur:
            for outcome in outcomes:
                # only a pending entry, and only while the claim that sent it holds it
                held = " WHERE id = ? AND state = 'pending' AND (? IS NULL OR due_at = ?)"
                token = (outcome.entry_id, outcome.held_until, outcome.held_until)
                if outcome.state is OutboxState.PENDING:
                    cur.execute(
                        "UPDATE outbox SET attempts = attempts + 1, due_at = ?, detail = ?"
                        + held,
                        (outcome.retry_at if outcome.retry_at is not None else now,
                         outcome.detail, *token))
                else:
                    cur.execute(
                        "UPDATE outbox SET state = ?, attempts = attempts + 1,"
                        " settled_at = ?, detail = ?,"
                        " data = CASE WHEN ? THEN NULL ELSE data END" + held,
                        (outcome.state.value, now, outcome.detail,
                         outcome.state is OutboxState.DELIVERED, *token))
                if cur.rowcount:
                    settled.append(outcome)
        return settled

    def outbox_next_due(self, targets: Sequence[str]) -> float | None:
        if not targets:
            return None
        marks = ", ".join("?" * len(targets))
        due = self.conn.execute(
            f"SELECT min(due_at) FROM outbox WHERE state = 'pending' AND target IN ({marks})",
            tuple(targets)).fetchone()[0]
        return float(due) if due is not None else None

    def outbox_entries(self, *, after: int | None = None, limit: int = 1000) -> list[OutboxRow]:
        return [OutboxRow(*row) for row in self.conn.execute(
            "SELECT id, target, idempotency_key, kind, record_id, state, attempts, detail, data"
            " FROM outbox WHERE id > ? ORDER BY id LIMIT ?", (after or 0, limit)).fetchall()]

    def outbox_counts(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for target, state, n in self.conn.execute(
                "SELECT target, state, count(*) FROM outbox GROUP BY target, state"
                " ORDER BY target"):
            by_state = counts.setdefault(target, {s.value: 0 for s in OutboxState})
            by_state[state] = n
        return counts

    # -- the response journal --------------------------------------------------------------

    def journaled_response(self, key: str) -> tuple[str, bytes] | None:
        row = self.reader.execute(
            "SELECT data, body FROM responses WHERE key = ?", (key,)).fetchone()
        return (row[0], bytes(row[1])) if row is not None else None

    @staticmethod
    def _find(cur: sqlite3.Cursor | sqlite3.Connection, key: str, fingerprint: str,
              by_fingerprint: bool) -> tuple[Any, ...] | None:
        """``(id, state, finished_at)`` of the entry with ``key``, or with ``by_fingerprint``
        of any entry with that fingerprint (by key when its key is its fingerprint, else by
        the partial fingerprint index)."""
        row = cur.execute(_BY_KEY, (key,)).fetchone()
        if row is None and by_fingerprint:
            if key != fingerprint:
                row = cur.execute(_BY_KEY, (fingerprint,)).fetchone()
            if row is None:
                row = cur.execute(_BY_OTHER_KEY, (fingerprint,)).fetchone()
        return cast("tuple[Any, ...] | None", row)

    def known_request(self, fingerprint: str, *, key: str | None = None) -> str | None:
        if key is not None:
            row = self._find(self.reader, key, fingerprint, False)
        else:
            row = self._find(self.reader, fingerprint, fingerprint, True)
        if row is None:
            return None
        return known_request_answer(row[1], row[2],
                                    window_start(self.recrawl_seconds, self.clock()))

    # -- leases -----------------------------------------------------------------------------

    def status(self, worker: str) -> FrontierStatus:
        claimable, elsewhere = self.reader.execute(
            "SELECT EXISTS (SELECT 1 FROM requests WHERE state = 'pending'),"
            " EXISTS (SELECT 1 FROM requests WHERE state = 'leased'"
            "  AND (worker != ? OR leased_until < ?))",
            (worker, self.clock()),
        ).fetchone()
        return FrontierStatus(claimable=bool(claimable), leased_elsewhere=bool(elsewhere))

    def renew_leases(self, worker: str) -> list[str]:
        now = self.clock()
        with self._write() as cur:
            # An expired lease is not renewed: from its expiry on, any worker may take it,
            # so its holder treats it as lost (it stops handing it out) instead of reviving it.
            rows = cur.execute(
                "UPDATE requests SET leased_until = ? WHERE state = 'leased' AND worker = ?"
                " AND leased_until >= ? RETURNING key",
                (now + self.lease_seconds, worker, now),
            ).fetchall()
        return [key for (key,) in rows]

    def release_leases(self, workers: list[str]) -> int:
        if not workers:
            return 0
        with self._write() as cur:
            return self._release(cur, workers)

    @staticmethod
    def _release(cur: sqlite3.Cursor, workers: list[str]) -> int:
        marks = ", ".join("?" * len(workers))
        cur.execute(
            "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"
            f" WHERE state = 'leased' AND worker IN ({marks})",
            workers,
        )
        return cur.rowcount

    def reclaim_expired(self) -> int:
        with self._write() as cur:
            cur.execute(
                "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"
                " WHERE state = 'leased' AND leased_until < ?",
                (self.clock(),),
            )
            return cur.rowcount

    def lease_holders(self) -> list[LeaseHolder]:
        rows = self.reader.execute(
            "SELECT worker, count(*), max(leased_until) FROM requests"
            " WHERE state = 'leased' GROUP BY worker ORDER BY worker"
        ).fetchall()
        return [LeaseHolder(worker=w, leases=n, leased_until=u) for w, n, u in rows]

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in RequestState}
        reader = self.reader
        for state, n in reader.execute(
            "SELECT state, count(*) FROM requests GROUP BY state"
        ):
            counts[state] = n
        counts["records"] = reader.execute("SELECT count(*) FROM records").fetchone()[0]
        return counts

    # -- operator queries -------------------------------------------------------------------
    # For the ``scrapy idempotent`` commands; see the section of the same name in base.py.
    # Everything here only reads, except retry_failed (one write transaction).

    def open_existing(self, *, readonly: bool = True,
                      identity: CrawlIdentity | None = None) -> SchemaInfo:
        from pathlib import Path

        if self._conn is not None:
            raise StoreError(f"store {self.path} is already open")
        if not os.path.isfile(self.path):
            raise StoreError(f"no frontier database at {self.path}")
        uri = Path(os.path.abspath(self.path)).as_uri()
        conn = self._connect_existing(f"{uri}?mode={'ro' if readonly else 'rw'}")
        try:
            if not readonly:
                # before any write, and only reading (as a crawl's open does): a file that is
                # not ours, or another crawl's, is refused untouched
                self._check_ownership(conn)
                if identity is not None:
                    self._check_identity(self._stored_identity(conn), identity)
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except StoreError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            raise self._error(exc, "reading") from exc
        self._conn = conn
        return SchemaInfo(version=int(version), supported=SCHEMA_VERSION)

    def entry(self, key: str) -> FrontierEntry | None:
        found = self._entries_where("key = ?", (key,), 1)
        return found[0] if found else None

    def entries(self, *, after: str | None = None, limit: int = 1000) -> list[FrontierEntry]:
        return self._entries_where("key > ?", (after or "",), limit)

    def _entries_where(self, where: str, params: tuple[Any, ...],
                      limit: int) -> list[FrontierEntry]:
        return [FrontierEntry(*(*row[:5], bool(row[5]), *row[6:])) for row in self.conn.execute(
            "SELECT key, fingerprint, url, state, priority, is_start, data, parent_key, worker,"
            " leased_until, attempts, unfinished, replays, enqueued_at, finished_at, error_kind,"
            f" error_message, run_id FROM requests WHERE {where} ORDER BY key LIMIT ?",
            (*params, limit))]

    def engine_settings(self) -> list[EngineSetting]:
        mode = self.conn.execute("PRAGMA journal_mode").fetchone()[0]
        return [EngineSetting(name="journal_mode", label="journal mode",
                              value=str(mode).lower(), expected="wal")]

    def _connect_existing(self, uri: str) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None,
                                   timeout=self.busy_timeout_seconds)
        except sqlite3.Error as exc:
            raise self._error(exc, "opening") from exc
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_seconds * 1000)}")
        except sqlite3.Error as exc:
            conn.close()
            raise self._error(exc, "opening") from exc
        return conn

    def meta(self) -> dict[str, str]:
        return dict(self.conn.execute("SELECT key, value FROM meta ORDER BY key").fetchall())

    def runs(self) -> list[RunSummary]:
        return [RunSummary(*row) for row in self.conn.execute(
            "SELECT run_id, started_at, finished_at, reason, leased, done, failed, redirected,"
            " records_inserted, records_updated, records_unchanged, coalesce(j.rejects, 0)"
            " FROM runs LEFT JOIN (SELECT run_id, count(*) AS rejects FROM rejects"
            " GROUP BY run_id) AS j USING (run_id) ORDER BY run_id")]

    def sessions(self) -> list[SessionInfo]:
        return [SessionInfo(*row) for row in self.conn.execute(
            "SELECT session_id, run_id, worker, started_at, ended_at, reason FROM sessions"
            " ORDER BY session_id")]

    def request_summary(self) -> RequestSummary:
        requests, leases, repeated, most, expired, replays, again = self.conn.execute(
            "SELECT count(*), coalesce(sum(attempts), 0), coalesce(sum(attempts > 1), 0),"
            " coalesce(max(attempts), 0),"
            " coalesce(sum(state = 'leased' AND leased_until < ?), 0),"
            " coalesce(sum(replays), 0), coalesce(sum(attempts - replays > 1), 0)"
            " FROM requests",
            (self.clock(),),
        ).fetchone()
        journaled = self.conn.execute("SELECT count(*) FROM responses").fetchone()[0]
        return RequestSummary(requests=requests, leases=leases, repeated=repeated,
                              most_attempts=most, expired_leases=expired,
                              journaled_responses=journaled, replays=replays,
                              downloads=leases - replays, downloaded_again=again)

    def failure_counts(self) -> dict[str, int]:
        return dict(self.conn.execute(
            "SELECT coalesce(error_kind, ''), count(*) FROM requests WHERE state = 'failed'"
            " GROUP BY 1 ORDER BY 2 DESC, 1").fetchall())

    def repeated_requests(self, limit: int) -> list[RepeatedRequest]:
        return [RepeatedRequest(*row) for row in self.conn.execute(
            "SELECT key, url, state, attempts, worker, error_kind FROM requests"
            " WHERE attempts > 1 ORDER BY attempts DESC, id LIMIT ?", (limit,))]

    def failed_requests(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                        url_regex: str | None = None,
                        limit: int | None = None) -> list[FailedRequest]:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        return [FailedRequest(*row) for row in self.conn.execute(
            "SELECT key, url, error_kind, error_message, attempts, finished_at, parent_key,"
            f" run_id FROM requests WHERE {where} ORDER BY finished_at DESC, id DESC LIMIT ?",
            (*params, -1 if limit is None else limit),
        )]

    def count_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> int:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        count: int = self.conn.execute(
            f"SELECT count(*) FROM requests WHERE {where}", params).fetchone()[0]
        return count

    def retry_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> RetriedFailed:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        with self._write() as cur:
            cur.execute(
                "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL,"
                " attempts = 0, finished_at = NULL, error_kind = NULL, error_message = NULL"
                f" WHERE {where}",
                params,
            )
            retried = cur.rowcount
            last = cur.execute(
                "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
            reopened = bool(retried and last is not None and last[1] is not None)
            if reopened:
                cur.execute("UPDATE runs SET finished_at = NULL, reason = NULL WHERE run_id = ?",
                            (last[0],))
        return RetriedFailed(retried=retried, run_id=last[0] if last is not None else None,
                             reopened=reopened)

    def records_page(self, *, after: str | None = None, limit: int = 1000,
                     changed_since: float | None = None,
                     changed_since_run: int | None = None) -> list[StoredRecord]:
        where: list[str] = ["record_id > ?"]
        params: list[Any] = [after or ""]
        if changed_since is not None:
            where.append("last_changed >= ?")
            params.append(changed_since)
        if changed_since_run is not None:
            where.append("changed_run_id >= ?")
            params.append(changed_since_run)
        return [StoredRecord(*row) for row in self.conn.execute(
            "SELECT record_id, source, natural_key, item_type, data, first_seen, last_changed,"
            " first_run_id, changed_run_id, content_hash, request_key, version, observed_at"
            " FROM records"
            f" WHERE {' AND '.join(where)} ORDER BY record_id LIMIT ?",
            (*params, limit),
        )]

    def run_records(self, run_id: int) -> Iterator[RunRecord]:
        # Keyset paging on the records_seen index: each page is one statement, read to the
        # end before it is yielded, so no read transaction stays open while the caller
        # writes (a write after another worker's commit would fail on a stale snapshot).
        columns = ("SELECT record_id, item_type, data, first_seen, last_changed, seen_seq,"
                   " seen_at FROM records WHERE seen_run_id = ?")
        order = " ORDER BY seen_seq, seen_at, record_id LIMIT 500"
        after: tuple[Any, ...] | None = None
        while True:
            if after is None:
                rows = self.conn.execute(columns + order, (run_id,)).fetchall()
            else:
                rows = self.conn.execute(
                    columns + " AND (seen_seq, seen_at, record_id) > (?, ?, ?)" + order,
                    (run_id, *after)).fetchall()
            if not rows:
                return
            last = rows[-1]
            after = (last[5], last[6], last[0])
            for row in rows:
                yield RunRecord(*row[:5])

    def feed_base(self, run_id: int, uri: str, size: int) -> int:
        with self._write() as cur:
            cur.execute("INSERT OR IGNORE INTO feeds (run_id, uri, base_size) VALUES (?, ?, ?)",
                        (run_id, uri, size))
            base: int = cur.execute("SELECT base_size FROM feeds WHERE run_id = ? AND uri = ?",
                                    (run_id, uri)).fetchone()[0]
        return base

    def store_feed(self, run_id: int, uri: str, level: int,
                   replace: Callable[[], object]) -> bool:
        key = f"stored {uri}"
        with self._write() as cur:
            row = cur.execute("SELECT base_size FROM feeds WHERE run_id = ? AND uri = ?",
                              (run_id, key)).fetchone()
            if row is not None and row[0] > level:
                return False
            cur.execute("INSERT INTO feeds (run_id, uri, base_size) VALUES (?, ?, ?)"
                        " ON CONFLICT (run_id, uri) DO UPDATE SET base_size = excluded.base_size",
                        (run_id, key, level))
            replace()
        return True

    @staticmethod
    def _rejects_filter(run_id: int | None, pending_only: bool) -> tuple[str, list[Any]]:
        where, params = ["1"], []
        if run_id is not None:
            where.append("j.run_id = ?")
            params.append(run_id)
        if pending_only:
            where.append("j.retried_at IS NULL")
        return " AND ".join(where), params

    def rejects(self, *, run_id: int | None = None, pending_only: bool = False,
                limit: int | None = None) -> list[RejectedItem]:
        where, params = self._rejects_filter(run_id, pending_only)
        return [RejectedItem(*row) for row in self.conn.execute(
            "SELECT j.id, j.item_type, j.reason, j.data, j.request_key,"
            " coalesce(j.page_url, r.url) AS page_url, j.created_at, j.run_id, j.retried_at,"
            " r.state AS page_state FROM rejects j LEFT JOIN requests r ON r.key = j.request_key"
            f" WHERE {where} ORDER BY j.created_at DESC, j.id DESC LIMIT ?",
            (*params, -1 if limit is None else limit),
        )]

    def count_rejects(self, *, run_id: int | None = None, pending_only: bool = False) -> int:
        where, params = self._rejects_filter(run_id, pending_only)
        count: int = self.conn.execute(
            f"SELECT count(*) FROM rejects j WHERE {where}", params).fetchone()[0]
        return count

    def retry_rejects(self) -> RejectsRetried:
        now = self.clock()
        with self._write() as cur:
            last = cur.execute(
                "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
            if last is None:
                return RejectsRetried(pages=0, rejects=0, without_page=0, run_id=None,
                                      reopened=False)
            keys = {key for (key,) in cur.execute(
                "SELECT DISTINCT request_key FROM rejects WHERE run_id = ?"
                " AND retried_at IS NULL AND request_key IN"
                " (SELECT key FROM requests WHERE state IN ('done', 'failed', 'redirected'))",
                (last[0],))}
            cur.executemany(
                "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL,"
                " attempts = 0, replays = 0, unfinished = 0, finished_at = NULL,"
                " error_kind = NULL, error_message = NULL WHERE key = ?",
                [(key,) for key in keys])
            pages = len(keys)
            cur.execute("UPDATE rejects SET retried_at = ? WHERE run_id = ?"
                        " AND retried_at IS NULL AND request_key IN"
                        " (SELECT key FROM requests WHERE state IN ('pending', 'leased'))",
                        (now, last[0]))
            marked = cur.rowcount
            without = cur.execute(
                "SELECT count(*) FROM rejects WHERE run_id = ? AND retried_at IS NULL",
                (last[0],)).fetchone()[0]
            reopened = bool(pages and last[1] is not None)
            if reopened:
                cur.execute("UPDATE runs SET finished_at = NULL, reason = NULL WHERE run_id = ?",
                            (last[0],))
        return RejectsRetried(pages=pages, rejects=marked, without_page=without,
                              run_id=last[0], reopened=reopened)

    def dump(self, batch: int = 1000) -> Iterator[tuple[str, list[dict[str, object]]]]:
        # keyset paging on each table's key: one statement per batch
        keys = {"meta": "key", "runs": "run_id", "sessions": "session_id", "requests": "id",
                "records": "record_id", "rejects": "id", "feeds": "rowid",
                "responses": "key", "outbox": "id"}
        for table in self.DUMP_TABLES:
            key = keys[table]
            after: object = None
            while True:
                where = f"WHERE {key} > ?" if after is not None else ""
                rows = self._dicts(
                    f"SELECT {key} AS _key, * FROM {table} {where} ORDER BY {key} LIMIT ?",
                    (*(() if after is None else (after,)), batch))
                if not rows:
                    break
                after = rows[-1]["_key"]
                for row in rows:
                    del row["_key"]
                yield table, rows

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        # BEGIN IMMEDIATE: the write lock (no other connection commits until the block ends;
        # readers go on, in WAL mode) and one snapshot for every read of the block
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._error(exc, "locking the database for a consistent copy") from exc
        try:
            yield
        finally:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")  # nothing was written: the lock is let go

    def live_workers(self) -> list[str]:
        return self._live_sessions(self.conn)

    def _dicts(self, sql: str, params: Any = ()) -> list[dict[str, object]]:
        """Rows as dicts keyed by column name (a table dump is column by column)."""
        cur = self.conn.execute(sql, params)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def integrity_check(self) -> IntegrityReport:
        found = [str(row[0]) for row in self.conn.execute("PRAGMA integrity_check")]
        return IntegrityReport(method="PRAGMA integrity_check",
                               problems=() if found == ["ok"] else tuple(found))

    def anomalies(self) -> dict[str, int]:
        return {name: self.conn.execute(sql).fetchone()[0]
                for name, sql in anomaly_checks().items()}

    def _failed_filter(self, kinds: list[str] | None, url_glob: str | None,
                       url_regex: str | None) -> tuple[str, list[Any]]:
        where, params = ["state = 'failed'"], []
        if kinds:
            where.append("(" + " OR ".join(
                "error_kind = ? OR substr(error_kind, 1, ?) = ?" for _ in kinds) + ")")
            for kind in kinds:
                params += [kind, len(kind) + 1, f"{kind}/"]
        if url_glob is not None:
            # the interface's glob (url_glob_matches), not SQLite's GLOB, whose character
            # sets are negated with [^...] where the interface's use [!...]
            glob = url_glob
            self.conn.create_function(
                "idempotent_url_glob", 1,
                lambda url: url is not None and url_glob_matches(glob, url),
                deterministic=True)
            where.append("idempotent_url_glob(url)")
        if url_regex is not None:
            import re

            pattern = re.compile(url_regex)
            self.conn.create_function(
                "idempotent_url_matches", 1,
                lambda url: url is not None and pattern.search(url) is not None,
                deterministic=True)
            where.append("idempotent_url_matches(url)")
        return " AND ".join(where), params


#: SQLite's message for each primary result code (sqlite3.c, ``sqlite3ErrStr``), to name an
#: error where Python does not: ``sqlite3.Error.sqlite_errorname`` is new in Python 3.11.
_MESSAGE_NAMES = (
    ("database is locked", "SQLITE_BUSY"),
    ("database table is locked", "SQLITE_LOCKED"),
    ("attempt to write a readonly database", "SQLITE_READONLY"),
    ("database or disk is full", "SQLITE_FULL"),
    ("unable to open database file", "SQLITE_CANTOPEN"),
    ("disk I/O error", "SQLITE_IOERR"),
    ("file is not a database", "SQLITE_NOTADB"),
    ("database disk image is malformed", "SQLITE_CORRUPT"),
)


def _error_name(exc: sqlite3.Error) -> str:
    """``SQLITE_BUSY``, ``SQLITE_READONLY_DBMOVED``...: the result code name of a SQLite
    error (Python 3.11+), or on Python 3.10 the primary code its message stands for ("" when
    unknown)."""
    name = getattr(exc, "sqlite_errorname", None)
    if name:
        return str(name)
    message = str(exc)
    return next((code for text, code in _MESSAGE_NAMES if message.startswith(text)), "")
