"""The embedded store: one SQLite file in WAL mode, one write transaction per unit of work.

Durability: with ``synchronous=NORMAL`` (default) a committed transaction survives the death
of the process (SIGKILL, OOM) but the last transactions may be lost on power failure;
``synchronous=FULL`` survives power failure too, at one fsync per commit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from ..exceptions import StoreBusy, StoreError
from ..workers import worker_state
from .base import (
    CommitResult,
    CrawlIdentity,
    NewRequest,
    RunInfo,
    RunMode,
    UnitOfWork,
    observation_clock,
)
from .reads import (
    FeedMark,
    RunRecord,
    SeqRecord,
)
from .rules import (
    QUEUE_ORDER,
    claimed_columns,
    isolate_after,
    other_owner,
)
from .sql import SqlStore
from .sqlite_operator import SQLiteOperatorQueries
from .sqlite_schema import (
    _BEFORE_APPLICATION_ID,
    _MIGRATIONS,
    _TABLES,
    APPLICATION_ID,
    SCHEMA_VERSION,
)

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "SQLiteStore"]

logger = logging.getLogger(__name__)

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
#: The page size of a new database file (an existing file keeps its own). 8 and 16 KiB
#: pages made page commits and claims slower, on small frontiers as at depth.
NEW_PAGE_SIZE = 4096

_BY_KEY = "SELECT id, state, finished_at FROM requests WHERE key = ?"
_BY_OTHER_KEY = ("SELECT id, state, finished_at FROM requests"
                 " WHERE fingerprint = ? AND key != fingerprint LIMIT 1")


def _file_identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file at ``path``; None when there is none."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _os_cause(exc: OSError) -> str:
    """An operating system error in words a user acts on."""
    import errno

    if exc.errno == errno.ENOSPC:
        return f"the disk is full ({exc})"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"the file system or directory is read-only or not writable by this user ({exc})"
    return str(exc)


def _run_observed(cur: Any, run_id: int) -> float | None:
    """The latest observation time of the records seen in run ``run_id``: kept in its
    ``runs`` row by the page commits (schema 21). A run of an earlier release has none
    kept: its records are read once for it (every record of the run: seconds at
    millions), and it is kept from then on."""
    latest = cur.execute("SELECT observed_at FROM runs WHERE run_id = ?",
                         (run_id,)).fetchone()
    if latest is None or latest[0] is not None:
        return None if latest is None else float(latest[0])
    found = cur.execute("SELECT max(observed_at) FROM records WHERE seen_run_id = ?",
                        (run_id,)).fetchone()[0]
    cur.execute("UPDATE runs SET observed_at = max(coalesce(observed_at, 0), ?)"
                " WHERE run_id = ?", (found or 0.0, run_id))
    return None if found is None else float(found)


class SQLiteStore(SQLiteOperatorQueries, SqlStore):
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
        #: the clock workers' observation times are on (an injected clock stands for both)
        self._observation_clock = observation_clock if clock is time.time else clock
        #: added to workers' observation times: the run's observations stored before this
        #: session began stay before this session's, even if the wall clock was set back
        #: between them (see begin_session)
        self._observed_offset = 0.0
        self.synchronous = synchronous
        self.busy_timeout_seconds = busy_timeout_seconds
        self.run_id: int | None = None
        self.transactions = 0  #: write transactions committed by this object
        self._conn: sqlite3.Connection | None = None
        #: the read connection of an open crawl (see :attr:`reader`)
        self._read: sqlite3.Connection | None = None
        self._read_thread: int | None = None  #: the thread that opened the reader
        self._wal: int | None = None  #: inode of the -wal file this connection writes
        #: (st_dev, st_ino) of the database file as this store opened it (see _check_files)
        self._file: tuple[int, int] | None = None
        self._migrated_mark = False  #: mark_migrated was called in the frozen block

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

    def open(self, *, fingerprinter: str = "", identity: CrawlIdentity | None = None,
             record_id_scheme: str | None = None) -> str | None:
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
        # the file's identity before SQLite opens it: if the path names another file by the
        # time the connection has it, the first write is refused (never a wrong file trusted)
        self._file = _file_identity(self.path)
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
            if not new:
                self._check_not_migrated(conn)
            if new:
                # Freed pages (journaled responses are deleted as their requests complete)
                # go back to the file system: set before the first table exists.
                # (the page size first: once auto_vacuum is set, the page size is fixed)
                conn.execute(f"PRAGMA page_size = {int(NEW_PAGE_SIZE)}")
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
                stored = self._claim_meta(cur, fingerprinter, identity, record_id_scheme,
                                          self.path)
            self._read = self._open_reader()
            self._read_thread = threading.get_ident()
        except StoreError:
            self.close()
            raise
        except sqlite3.Error as exc:
            self.close()
            raise self._error(exc, "opening") from exc
        return stored if stored != fingerprinter else None

    def _live_workers_in(self, cur: Any) -> list[str]:
        return self._live_sessions(cur.connection)

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
                self._check_files()
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
        # one read transaction: the version and the tables of one moment (another worker
        # opening the file at once may be migrating it, a step a transaction)
        conn.execute("BEGIN")
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {name for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'"
                " AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'")}
        finally:
            if conn.in_transaction:  # (an error may have ended it: that error is raised)
                conn.execute("COMMIT")
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

    def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None:
        """Refuse the database whose recorded identity ``stored`` is another crawl's (an
        empty one is nobody's yet: the first open records it)."""
        owner = other_owner(stored, identity)
        if owner is None:
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
        if name == "SQLITE_FULL" or (name.startswith("SQLITE_IOERR")
                                     and _disk_full(self.path)):
            # an I/O error of the -shm or -wal file on a full disk says nothing of the disk
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
            self._file = None

    @contextlib.contextmanager
    def _write(self, doing: str = "writing") -> Iterator[sqlite3.Cursor]:
        """The one write-transaction primitive: ``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled
        back on any exception, so a transaction is all or nothing."""
        conn = self.conn
        self._check_files()
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
                raise self._error(exc, doing) from exc
            raise
        self.transactions += 1
        if self._wal is None:
            with contextlib.suppress(OSError):
                self._wal = os.stat(f"{self.path}-wal").st_ino

    def _check_files(self) -> None:
        """Before each write transaction: the database file and its -wal file are still the
        ones this store opened. A file deleted (or replaced) under an open connection swallows
        every commit that follows, silently: SQLite writes on into the unlinked file (in WAL
        mode it does not notice), and the crawl would report a success no file holds. Refuse
        to write then. Costs two ``stat`` calls per write transaction (about 1 us each, and
        the writer groups the commits of many pages into one transaction)."""
        if self._file is not None and _file_identity(self.path) != self._file:
            raise StoreError(
                f"the database {self.path} was deleted or replaced while the crawl was "
                "using it: what this crawl committed since went into the removed file and is "
                "lost; nothing more is written. Never delete, move or replace the database "
                "of a running crawl; run the crawl again to resume from what the file at "
                "that path holds")
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
            run_id, new = self._start_run(cur, run_mode, now)
            cur.execute(
                "INSERT INTO sessions (run_id, worker, started_at) VALUES (?, ?, ?)",
                (run_id, worker, now),
            )
            # the run's latest observation so far (a resumed run: its records seen in it)
            latest = None if new else _run_observed(cur, run_id)
        self._observed_offset = max(0.0, (latest or 0.0) - self._observation_clock())
        self.run_id = run_id
        self._worker = worker
        return RunInfo(run_id=run_id, new=new, counts=self.counts())

    def _observation_offset(self) -> float:
        return self._observed_offset

    _SESSION_STATE = ("run_id", "_observed_offset")

    def _join_run(self, cur: Any, worker: str, run_id: int, now: float) -> None:
        cur.execute("UPDATE sessions SET ended_at = ?, reason = 'next run'"
                    " WHERE worker = ? AND ended_at IS NULL", (now, worker))
        cur.execute("INSERT INTO sessions (run_id, worker, started_at) VALUES (?, ?, ?)",
                    (run_id, worker, now))
        latest = _run_observed(cur, run_id)
        self._observed_offset = max(0.0, (latest or 0.0) - self._observation_clock())
        self.run_id = run_id

    # -- the unit of work -------------------------------------------------------------------

    def _commit_unit(self, work: UnitOfWork, worker: str, run_id: int, now: float,
                     result: CommitResult) -> None:
        with self._write("committing") as cur:
            self._write_unit(cur, work, worker, run_id, now, result)

    # -- the dialect (see SqlStore) ----------------------------------------------------------

    def _select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return self.conn.execute(sql, params).fetchall()

    def _crawl_select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return self.reader.execute(sql, params).fetchall()

    def _any(self, column: str, values: Collection[Any], *,
             sql_type: str = "text") -> tuple[str, Any]:
        # one parameter whatever the number of values (no limit on host parameters)
        return f"{column} IN (SELECT value FROM json_each(?))", json.dumps(list(values))

    def _claim_rows(self, cur: Any, worker: str, count: int, until: float) -> list[Any]:
        rows: list[Any] = cur.execute(
            "UPDATE requests SET state = 'leased', worker = ?, leased_until = ?,"
            " attempts = attempts + 1"
            " WHERE id IN (SELECT id FROM requests INDEXED BY requests_pending"
            f"  WHERE state = 'pending' ORDER BY {QUEUE_ORDER} LIMIT ?)"
            f" RETURNING {claimed_columns(data=self.DATA_READ)}",
            (worker, until, count)).fetchall()
        return rows

    def _send_insert(self, cur: Any, new: list[NewRequest], now: float,
                     run_id: int) -> Callable[[], int]:
        cur.executemany(
            "INSERT INTO requests (key, fingerprint, url, priority, is_start, fifo, state, data,"
            " parent_key, enqueued_at, run_id, slot)"
            " VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING",
            [(r.key, r.fingerprint, r.url, r.priority, r.is_start, r.fifo,
              *self._stored_data(r.data, r.url), r.parent_key, now, run_id, r.slot)
             for r in new])
        added: int = cur.rowcount
        return lambda: added

    # -- streamed feeds ---------------------------------------------------------------------

    # One connection, one writer at a time: the run's counter of first sights (seen_seq) is
    # taken in the page transaction under SQLite's write lock, so it is in commit order.
    STREAMS_FEEDS = True

    _MARK_COLUMNS = "seq, byte_offset, batch_id, items, first_seq, total, base_size"

    def stream_feed(self, run_id: int, key: str, worker: str, *, lease_seconds: float,
                    base: Callable[[], int], holder_gone: Callable[[str], bool],
                    write: Callable[[FeedMark, Callable[[int, int], list[SeqRecord]]],
                                    FeedMark],
                    release: bool = False) -> FeedMark | None:
        where = "WHERE run_id = ? AND uri = ?"
        with self._write("starting a feed") as cur:
            if cur.execute(f"SELECT 1 FROM feeds {where}", (run_id, key)).fetchone() is None:
                size = base()
                cur.execute("INSERT INTO feeds (run_id, uri, base_size, byte_offset)"
                            " VALUES (?, ?, ?, ?)", (run_id, key, size, size))
        with self._write("writing a feed") as cur:
            now = self.clock()
            row = cur.execute(f"SELECT {self._MARK_COLUMNS}, writer, writer_until FROM feeds"
                              f" {where}", (run_id, key)).fetchone()
            holder, until = row[7], row[8]
            if (holder is not None and holder != worker and until is not None and until >= now
                    and not holder_gone(holder)):
                return None
            mark = FeedMark(*row[:7])

            def fetch(after: int, limit: int) -> list[SeqRecord]:
                return [SeqRecord(RunRecord(*r[:5]), r[5]) for r in cur.execute(
                    "SELECT record_id, item_type, data, first_seen, last_changed, seen_seq"
                    " FROM records WHERE seen_run_id = ? AND seen_seq > ?"
                    " ORDER BY seen_seq LIMIT ?", (run_id, after, limit)).fetchall()]

            new = write(mark, fetch)
            cur.execute(
                "UPDATE feeds SET seq = ?, byte_offset = ?, batch_id = ?, items = ?,"
                f" first_seq = ?, total = ?, writer = ?, writer_until = ? {where}",
                (new.seq, new.offset, new.batch_id, new.items, new.first_seq, new.total,
                 None if release else worker, None if release else now + lease_seconds,
                 run_id, key))
        return new

    def _read_records(self, cur: Any, run_id: int, count: int, record_ids: list[str]
                      ) -> tuple[float | None, list[int], list[Any]]:
        # one read at the end of the index; the run's counter of first sights
        newest = cur.execute("SELECT max(last_changed) FROM records").fetchone()[0]
        row = cur.execute("SELECT seen_seq FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        first = row[0] if row is not None else 0
        cur.execute("UPDATE runs SET seen_seq = ? WHERE run_id = ?", (first + count, run_id))
        return (newest, list(range(first + 1, first + count + 1)),
                self._lock_records(cur, record_ids))

    def _count(self, cur: Any, result: CommitResult, run_id: int, leased: int,
               number: int) -> None:
        """Add this transaction's work to the run's cumulative counters (same transaction)."""
        done = result.completed
        deltas = (
            leased, done.get("done", 0),
            done.get("failed", 0) + len(result.quarantined), done.get("redirected", 0),
            result.records_inserted, result.records_updated, result.records_unchanged,
            result.records_stale, result.leases_lost,
        )
        if any(deltas):
            # and the run's latest observation (begin_session reads it: a session resuming
            # the run keeps its observations after those stored)
            observed = result.observed_max
            cur.execute(
                "UPDATE runs SET leased = leased + ?, done = done + ?, failed = failed + ?,"
                " redirected = redirected + ?, records_inserted = records_inserted + ?,"
                " records_updated = records_updated + ?,"
                " records_unchanged = records_unchanged + ?,"
                " records_stale = records_stale + ?, leases_lost = leases_lost + ?"
                + ("" if observed is None
                   else ", observed_at = max(coalesce(observed_at, 0), ?)")
                + " WHERE run_id = ?",
                (*deltas, *(() if observed is None else (observed,)), run_id),
            )

    def _add_to_counter(self, cur: Any, column: str, count: int) -> None:
        if count and self.run_id is not None:
            cur.execute(f"UPDATE runs SET {column} = {column} + ? WHERE run_id = ?",
                        (count, self.run_id))

    # -- leases -----------------------------------------------------------------------------

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


#: Free bytes under which an I/O error is put down to a full disk: less than SQLite needs to
#: grow its -shm file (32 KiB at a time) and a few pages of its -wal file.
_FULL_BELOW_BYTES = 256 * 1024


def _disk_full(path: str) -> bool:
    """Whether the file system holding ``path`` has (almost) no space left for this user."""
    try:
        found = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    except OSError:
        return False
    return found.f_bavail * found.f_frsize < _FULL_BELOW_BYTES


def _error_name(exc: sqlite3.Error) -> str:
    """``SQLITE_BUSY``, ``SQLITE_READONLY_DBMOVED``...: the result code name of a SQLite
    error (Python 3.11+), or on Python 3.10 the primary code its message stands for ("" when
    unknown)."""
    name = getattr(exc, "sqlite_errorname", None)
    if name:
        return str(name)
    message = str(exc)
    return next((code for text, code in _MESSAGE_NAMES if message.startswith(text)), "")
