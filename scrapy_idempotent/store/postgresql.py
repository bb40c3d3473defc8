"""The PostgreSQL store: many workers on many machines sharing one frontier (psycopg 3).

``IDEMPOTENT_DATABASE = "postgresql://user:password@host:port/dbname"`` (or ``postgres://``)
selects it. The same :class:`~.FrontierStore` contract as the SQLite store, with what many
machines need on top:

* **One schema per crawl.** Each crawl identity (project, spider, record source) gets its own
  schema, named ``idempotent_<spider>_<hash>`` (the hash is of the whole identity), so any
  number of crawls share one database without seeing each other's frontier or records.
  ``?schema=NAME`` in the URL names the schema instead; a schema that holds another crawl's
  frontier, or tables that are not this package's, is refused before anything in it changes.
  The schema is created and migrated by the package (versioned, one transaction per step,
  :data:`SCHEMA_VERSION`); the database user needs ``CREATE`` on the database (or the schema
  made beforehand and owned by it).
* **Claims** take the head of the pending index with ``FOR UPDATE SKIP LOCKED``: workers never
  wait for each other's claims and never get the same request.
* **A page commit is one transaction** (records, child requests, completion, next claim), as
  on SQLite. The rows of the completions are locked first (``FOR UPDATE``): a completion whose
  lease is not this worker's now writes nothing of its unit of work (fencing), however the
  transactions of other workers interleave. Its statements go out in psycopg's pipeline
  mode: the client waits for the server only where it needs an answer (three times for a
  page without records). New requests and records are written in key order, so page
  commits adding the same ones wait for each other instead of deadlocking.
* **Worker liveness across hosts.** Every session beats a heartbeat from a thread of its own
  (one ``UPDATE`` per :attr:`PostgreSQLStore.heartbeat_seconds` for all its leases); a
  session whose heartbeat is older than :attr:`PostgreSQLStore.dead_after_seconds` is dead,
  and any live worker puts its leases back at once, without waiting for them to expire. A
  lease also expires by itself, as on SQLite (a worker whose reactor is stuck keeps beating).
* **Records** are upserted: an insert that meets a record ID another worker inserted
  meanwhile (the unique index is the backstop) is counted as a conflict
  (``CommitResult.records_conflicts``) and becomes an update or nothing, never a second row.
* **Times** are the database server's clock (measured once per connection), so workers on
  hosts whose clocks disagree still agree on lease expiry.
* **Connections**: one per thread, autocommit outside explicit transactions (no transaction
  is ever left open between calls). A connection lost outside a commit is reopened and the
  operation raises :class:`~.StoreBusy` (retried by the caller: the transaction did not
  happen); a connection lost during COMMIT may or may not have committed, so it raises
  :class:`~.StoreError` and the crawl closes (the next crawl resumes from what is there).
  A thread that must never wait (:meth:`PostgreSQLStore.never_wait_here`: the reactor's,
  while the writer thread runs) gets :class:`~.StoreBusy` at once instead, while a thread of
  the store's reopens its connection.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import unquote, urlsplit, urlunsplit

from ..exceptions import StoreBusy, StoreError
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
from .registry import redacted
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

if TYPE_CHECKING:
    import psycopg

__all__ = ["MIN_SERVER_VERSION", "SCHEMA_VERSION", "PostgreSQLStore", "check_server_version",
           "schema_for"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 5
#: The oldest PostgreSQL server the store works with (``server_version_num``).
MIN_SERVER_VERSION = 140000
APPLICATION = "scrapy_idempotent"

#: ``_MIGRATIONS[n]`` brings schema version n to n + 1, one transaction each (in the crawl's
#: schema: the search path is set to it).
_MIGRATIONS: list[list[str]] = [
    [
        "CREATE TABLE meta (key text PRIMARY KEY, value text NOT NULL)",
        """CREATE TABLE runs (
            run_id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            started_at double precision NOT NULL,
            finished_at double precision,
            reason text
        )""",
        # A session is one worker process in a run. Its counters are this worker's share of
        # the run's (runs() adds them up): each worker writes only its own row, so page
        # commits of different workers never wait on one counter row.
        """CREATE TABLE sessions (
            session_id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            run_id bigint NOT NULL,
            worker text NOT NULL,
            started_at double precision NOT NULL,
            ended_at double precision,
            reason text,
            heartbeat_at double precision NOT NULL,
            leased bigint NOT NULL DEFAULT 0,
            done bigint NOT NULL DEFAULT 0,
            failed bigint NOT NULL DEFAULT 0,
            redirected bigint NOT NULL DEFAULT 0,
            records_inserted bigint NOT NULL DEFAULT 0,
            records_updated bigint NOT NULL DEFAULT 0,
            records_unchanged bigint NOT NULL DEFAULT 0
        ) WITH (fillfactor = 50)""",
        "CREATE INDEX sessions_live ON sessions (worker) WHERE ended_at IS NULL",
        # The high-churn table: every request is updated 3 to 4 times (claim, start,
        # completion). Free room in each page (fillfactor) lets updates stay on the page,
        # and autovacuum visits it after 2% of its rows changed instead of 20%.
        """CREATE TABLE requests (
            id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            key text COLLATE "C" NOT NULL UNIQUE,
            fingerprint text NOT NULL,
            url text NOT NULL,
            priority integer NOT NULL,
            is_start boolean NOT NULL DEFAULT false,
            fifo boolean NOT NULL DEFAULT false,
            state text NOT NULL,
            data text NOT NULL,
            parent_key text,
            worker text,
            leased_until double precision,
            attempts integer NOT NULL DEFAULT 0,
            unfinished integer NOT NULL DEFAULT 0,
            replays integer NOT NULL DEFAULT 0,
            enqueued_at double precision NOT NULL,
            finished_at double precision,
            error_kind text,
            error_message text,
            run_id bigint NOT NULL
        ) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.02,
                autovacuum_analyze_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0)""",
        # Claims read the head of this index (Scrapy's queue order, as on SQLite).
        """CREATE INDEX requests_pending ON requests
           (priority DESC, is_start, (CASE WHEN fifo THEN id ELSE -id END))
           WHERE state = 'pending'""",
        "CREATE INDEX requests_leased ON requests (worker, leased_until) WHERE state = 'leased'",
        "CREATE INDEX requests_fingerprint ON requests (fingerprint) WHERE key <> fingerprint",
        """CREATE TABLE records (
            record_id text COLLATE "C" PRIMARY KEY,
            source text NOT NULL,
            natural_key text NOT NULL,
            item_type text NOT NULL,
            data text NOT NULL,
            content_hash text NOT NULL,
            first_seen double precision NOT NULL,
            last_changed double precision NOT NULL,
            first_run_id bigint NOT NULL,
            changed_run_id bigint NOT NULL,
            request_key text,
            seen_run_id bigint NOT NULL,
            seen_at double precision,
            seen_seq bigint NOT NULL
        ) WITH (fillfactor = 90)""",
        "CREATE INDEX records_last_changed ON records (last_changed)",
        "CREATE INDEX records_seen ON records (seen_run_id, seen_seq, seen_at, record_id)",
        # The order in which runs first store or see records (their feeds' order): a
        # sequence, not a counter row, so concurrent page commits do not wait on each other.
        "CREATE SEQUENCE records_seen_seq",
        """CREATE TABLE responses (
            key text PRIMARY KEY,
            data text NOT NULL,
            body bytea NOT NULL,
            stored_at double precision NOT NULL
        ) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_cost_delay = 0)""",
        """CREATE TABLE rejects (
            id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            item_type text NOT NULL,
            reason text NOT NULL,
            data text NOT NULL,
            request_key text,
            page_url text,
            created_at double precision NOT NULL,
            run_id bigint NOT NULL,
            retried_at double precision
        )""",
        """CREATE TABLE feeds (
            run_id bigint NOT NULL,
            uri text NOT NULL,
            base_size bigint NOT NULL,
            PRIMARY KEY (run_id, uri)
        )""",
    ],
    [
        # The number of this session's last page commit, written in that commit: after a
        # connection lost during COMMIT, reading it back tells whether the commit happened.
        "ALTER TABLE sessions ADD COLUMN last_commit bigint NOT NULL DEFAULT 0",
    ],
    [
        # The outbox: one entry per record change and delivery target, written in the page
        # transaction that stored the change (only while targets are configured).
        """CREATE TABLE outbox (
            id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            target text NOT NULL,
            idempotency_key text NOT NULL,
            kind text NOT NULL,
            record_id text NOT NULL,
            content_hash text NOT NULL,
            item_type text NOT NULL,
            source text NOT NULL,
            natural_key text NOT NULL,
            data text,
            run_id bigint NOT NULL,
            created_at double precision NOT NULL,
            state text NOT NULL DEFAULT 'pending',
            attempts integer NOT NULL DEFAULT 0,
            due_at double precision NOT NULL,
            settled_at double precision,
            detail text
        ) WITH (fillfactor = 80)""",
        "CREATE INDEX outbox_due ON outbox (target, due_at, id) WHERE state = 'pending'",
    ],
    [
        # Lease renewals change leased_until only: without it in an index they are HOT
        # updates (the row version stays on its page, no new index entries, no index bloat
        # from renewals); the leased rows of a worker are few, found by worker alone.
        "DROP INDEX requests_leased",
        "CREATE INDEX requests_leased ON requests (worker) WHERE state = 'leased'",
    ],
    [
        # When the stored data was observed (its response received): a record is never
        # replaced by data observed before it. Existing rows: their latest commit (a change
        # or a run's first sight), the latest time known to have held their data.
        # DEFAULT 0 stays: a worker of the previous release still running during a rolling
        # upgrade inserts without it, and its record is then older than any observation
        "ALTER TABLE records ADD COLUMN observed_at double precision NOT NULL DEFAULT 0",
        "UPDATE records SET observed_at = greatest(last_changed, coalesce(seen_at, 0))",
        # The record's change counter (1 when inserted, +1 per stored change), part of the
        # outbox key: every change has its own key, a change back to earlier content too.
        "ALTER TABLE records ADD COLUMN version bigint NOT NULL DEFAULT 1",
    ],
]
assert len(_MIGRATIONS) == SCHEMA_VERSION

#: The tables of each schema version: a schema with any other table is not ours.
_TABLES: dict[int, frozenset[str]] = {
    1: frozenset({"meta", "runs", "sessions", "requests", "records", "responses", "rejects",
                  "feeds"}),
}
_TABLES[2] = _TABLES[1]
_TABLES[3] = _TABLES[2] | {"outbox"}
_TABLES[4] = _TABLES[3]
_TABLES[5] = _TABLES[4]
assert set(_TABLES) == set(range(1, SCHEMA_VERSION + 1))

_COUNTERS = ("leased", "done", "failed", "redirected", "records_inserted", "records_updated",
             "records_unchanged")
#: The columns :meth:`PostgreSQLStore.load` copies, per table (as the SQLite store names them).
_LOADED: dict[str, tuple[str, ...]] = {
    "requests": ("id", "key", "fingerprint", "url", "priority", "is_start", "fifo", "state",
                 "data", "parent_key", "worker", "leased_until", "attempts", "unfinished",
                 "replays", "enqueued_at", "finished_at", "error_kind", "error_message",
                 "run_id"),
    "records": ("record_id", "source", "natural_key", "item_type", "data", "content_hash",
                "first_seen", "last_changed", "first_run_id", "changed_run_id", "request_key",
                "seen_run_id", "seen_at", "seen_seq", "observed_at", "version"),
    "rejects": ("id", "item_type", "reason", "data", "request_key", "page_url", "created_at",
                "run_id", "retried_at"),
    "feeds": ("run_id", "uri", "base_size"),
    "responses": ("key", "data", "body", "stored_at"),
    "outbox": ("id", "target", "idempotency_key", "kind", "record_id", "content_hash",
               "item_type", "source", "natural_key", "data", "run_id", "created_at", "state",
               "attempts", "due_at", "settled_at", "detail"),
}
#: Page commits that add requests send at most one notification per this many seconds.
NOTIFY_INTERVAL_SECONDS = 0.25
#: a read asked on a thread that never waits (the reactor's) is made by the store's reader
#: thread and answered within this many seconds, or StoreBusy: a server that stops answering
#: without closing the connection (a paused machine, packets dropped) holds that thread, not
#: the reactor; while it is held, such reads are StoreBusy at once
READ_DEADLINE_SECONDS = 2.0
#: id(connection) -> (pid, start time) of its server process
conn_backends: dict[int, tuple[int, Any]] = {}
#: Workers whose latest heartbeat (over their sessions not ended) is older than a bound.
_DEAD_WORKERS = ("SELECT worker FROM sessions WHERE ended_at IS NULL GROUP BY worker"
                 " HAVING max(heartbeat_at) < %s")
#: The URL query parameter naming the schema (removed before the URL reaches libpq).
SCHEMA_PARAMETER = "schema"
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
#: A frontier entry already there: (id, state, finished_at); id None for one added by the
#: same page commit.
_Known = tuple[Any, str, Any]
#: The cursors of the lookups of known entries (by key, by fingerprint), answers not read yet.
_Lookups = tuple["psycopg.Cursor[Any] | None", "psycopg.Cursor[Any] | None"]
#: An insert of new requests sent, answer not read yet: its cursor, the number of rows sent.
_Inserting = tuple["psycopg.Cursor[Any]", int]


class _StoredState(NamedTuple):
    """What a page commit reads (and locks) of a stored record before writing it."""

    content_hash: str
    seen_run_id: int
    observed_at: float
    version: int


def schema_for(identity: CrawlIdentity | None) -> str:
    """The schema of a crawl: ``idempotent_<spider>_<hash>``, where the hash (10 hex digits of
    SHA-256) is of the project, spider and source, so the same spider with another
    ``IDEMPOTENT_SOURCE`` (or of another project) gets a schema of its own; ``idempotent``
    without an identity."""
    if identity is None:
        return "idempotent"
    digest = hashlib.sha256("\0".join(
        (identity.project, identity.spider, identity.source)).encode()).hexdigest()[:10]
    spider = re.sub(r"[^a-z0-9_]+", "_", identity.spider.lower()).strip("_")[:40]
    return f"idempotent_{spider}_{digest}" if spider else f"idempotent_{digest}"


def check_server_version(version_num: int, shown_url: str) -> None:
    """Refuse a server older than :data:`MIN_SERVER_VERSION` (``version_num`` as in the
    server's ``server_version_num``, e.g. 150004 for 15.4): the store ends a lost
    connection's server process with ``pg_terminate_backend(pid, timeout)``, which waits for
    it to exit, and that form exists from PostgreSQL 14 on."""
    if version_num >= MIN_SERVER_VERSION:
        return
    major, minor = divmod(version_num, 10000)
    found = f"{major}.{minor}" if major >= 10 else (
        f"{version_num // 10000}.{version_num // 100 % 100}.{version_num % 100}")
    raise StoreError(
        f"the PostgreSQL server of {shown_url} is version {found}; the PostgreSQL store needs "
        f"PostgreSQL {MIN_SERVER_VERSION // 10000} or later (it waits for the server process "
        "of a lost connection to end with pg_terminate_backend(pid, timeout)): upgrade the "
        "server, or point IDEMPOTENT_DATABASE at a newer one")


def _split_url(url: str) -> tuple[str, str | None]:
    """``url`` without the package's own query parameter, and that parameter's value."""
    parts = urlsplit(url)
    # the other parameters are handed to libpq as written (libpq decodes %XX, not "+")
    pieces = [piece for piece in parts.query.split("&") if piece]
    ours = [piece for piece in pieces if unquote(piece.partition("=")[0]) == SCHEMA_PARAMETER]
    schema = unquote(ours[0].partition("=")[2]) if ours else None
    rest = "&".join(piece for piece in pieces if piece not in ours)
    return urlunsplit(parts._replace(query=rest)), schema


class _CommitOutcomeUnknown(StoreError):
    """The connection was lost during COMMIT: the transaction may or may not have happened."""


class _Reconnecting:
    """A lost connection being reopened on a thread of its own, for a thread that must not
    wait for it (:meth:`PostgreSQLStore.never_wait_here`): tried again, backing off up to
    1 s, while the server refuses or is not ready (:class:`~.StoreBusy`), until it answers,
    an error that a retry cannot cure comes (kept in :attr:`error`), or :meth:`stop`."""

    def __init__(self, store: PostgreSQLStore) -> None:
        self.store = store
        self.conn: psycopg.Connection[Any] | None = None  #: set under the store's lock
        self.error: StoreError | None = None  #: set under the store's lock
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="scrapy_idempotent reconnect",
                         daemon=True).start()

    def _run(self) -> None:
        store = self.store
        delay = 0.05
        while not self._stopped.is_set():
            try:
                conn = store._connect()
            except StoreBusy:
                self._stopped.wait(delay)
                delay = min(delay * 2, 1.0)
                continue
            except StoreError as exc:
                with store._lock:
                    self.error = exc
                return
            with store._lock:
                if not self._stopped.is_set():
                    self.conn = conn
                    logger.info("scrapy_idempotent: reconnected to %s", store.shown_url)
                    return
            store._drop(conn)  # the store was closed meanwhile
            return

    def stop(self) -> None:
        self._stopped.set()


class PostgreSQLStore(FrontierStore):
    """The :class:`~.FrontierStore` on a PostgreSQL database (see the module docstring).

    :param url: ``postgresql://`` or ``postgres://`` URL (libpq's URI syntax), optionally with
        ``?schema=NAME``.
    :param lease_seconds: how long a claim lasts unless renewed.
    :param max_attempts: as on SQLite: a request started this many times without finishing
        is failed as ``quarantined``.
    :param clock: unix seconds; injected by tests. Default: this host's clock corrected by
        its offset from the database server's, measured at each connection.
    :param synchronous: ``NORMAL`` leaves the server's ``synchronous_commit`` as configured
        (by default ``on``: a committed page survives a crash of the server); ``FULL`` turns
        a configured ``off`` (a commit returning before it is on disk) into ``on`` for the
        store's connections, and leaves any other value.
    :param busy_timeout_seconds: how long a statement waits for a lock another transaction
        holds (``lock_timeout``), and how long a connection attempt may take.
    :param recrawl_seconds: the recrawl window, as on SQLite.
    :param heartbeat_seconds: how often a session's heartbeat is written (a thread of its
        own); None: no heartbeat thread (the session's heartbeat is then written by
        :meth:`renew_leases` and :meth:`heartbeat` only). Default: a third of
        ``dead_after_seconds``.
    :param dead_after_seconds: a session whose heartbeat is older than this is dead: its
        leases go back to pending at the next :meth:`reclaim_expired` of any worker. None:
        sessions are never dead by heartbeat (leases end by expiry only). Default:
        ``min(15, lease_seconds / 2)``.
    """

    def __init__(
        self,
        url: str,
        *,
        lease_seconds: float = 60.0,
        max_attempts: int = 10,
        clock: Callable[[], float] | None = None,
        synchronous: str = "NORMAL",
        busy_timeout_seconds: float = 10.0,
        recrawl_seconds: float | None = None,
        schema: str | None = None,
        heartbeat_seconds: float | bool | None = True,
        dead_after_seconds: float | bool | None = True,
    ) -> None:
        self.url, url_schema = _split_url(url)
        self.shown_url = redacted(url)
        self.requested_schema = schema or url_schema
        if self.requested_schema is not None and not _IDENTIFIER.match(self.requested_schema):
            raise StoreError(
                f"schema {self.requested_schema!r} of {self.shown_url} is not a plain "
                "PostgreSQL name: lower-case letters, digits and _, at most 63 characters, "
                "not starting with a digit")
        self.schema = self.requested_schema or schema_for(None)
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self.isolate_after = isolate_after(max_attempts)
        self._fixed_clock = clock
        self._offset = 0.0  #: the database server's clock minus this host's, in seconds
        self.synchronous = synchronous
        self.busy_timeout_seconds = busy_timeout_seconds
        self.recrawl_seconds = recrawl_seconds
        if dead_after_seconds is True:
            dead_after_seconds = min(15.0, lease_seconds / 2)
        self.dead_after_seconds: float | None = (
            None if dead_after_seconds is False else dead_after_seconds)
        if heartbeat_seconds is True:
            heartbeat_seconds = (self.dead_after_seconds / 3 if self.dead_after_seconds
                                 else lease_seconds / 3)
        self.heartbeat_seconds: float | None = (
            None if heartbeat_seconds is False else heartbeat_seconds)
        self.run_id: int | None = None
        self.session_id: int | None = None
        self.transactions = 0
        #: numbers the page commits of this store (see _committed); next() is atomic
        self._commit_numbers = itertools.count(1)
        self._local = threading.local()
        #: the thread making the reads of threads that never wait, and its read in progress
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._reading: concurrent.futures.Future[list[Any]] | None = None
        self._connections: list[psycopg.Connection[Any]] = []
        #: (pid, start) of the server processes of connections lost (see _end_orphans)
        self._orphans: list[tuple[int, Any]] = []
        self._lock = threading.Lock()
        self._opened = False
        self._beat_stop: threading.Event | None = None
        self._listen_stop: threading.Event | None = None
        self._listen_thread: threading.Thread | None = None
        self._notified_at = -NOTIFY_INTERVAL_SECONDS
        self._worker: str | None = None  #: the worker of this store's session
        #: when this store last (re)connected, store clock: heartbeats are judged only after
        #: a bound from then (see reclaim_expired)
        self._connected_since = float("inf")
        self._beat_thread: threading.Thread | None = None
        #: the thread reopening the connection of a thread that never waits, if any
        self._reconnecting: _Reconnecting | None = None

    # -- connections ------------------------------------------------------------------------

    def clock(self) -> float:
        """Unix seconds: the injected clock, or the database server's (see the class)."""
        if self._fixed_clock is not None:
            return self._fixed_clock()
        return time.time() + self._offset

    def _connect(self, *, set_path: bool = True) -> psycopg.Connection[Any]:
        try:
            import psycopg
        except ImportError as exc:  # pragma: no cover - the extra is not installed
            raise StoreError(
                "the PostgreSQL store needs psycopg 3 (the package's postgresql extra): pip "
                "install 'psycopg[binary]>=3.2'") from exc
        try:
            # keepalives: a connection whose network went away is noticed in about a minute
            # (the URL may set other values: its parameters win)
            defaults: dict[str, Any] = {
                "connect_timeout": max(2, int(self.busy_timeout_seconds)),
                "application_name": "scrapy_idempotent", "keepalives": 1,
                "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}
            given = psycopg.conninfo.conninfo_to_dict(self.url)
            conninfo = psycopg.conninfo.make_conninfo(
                self.url, **{k: v for k, v in defaults.items() if k not in given})
            conn = psycopg.connect(conninfo, autocommit=True)
        except psycopg.Error as exc:
            raise self._connect_error(exc) from exc
        try:  # before any statement: the version came with the connection
            check_server_version(conn.info.server_version, self.shown_url)
        except StoreError:
            conn.close()
            raise
        try:
            # a lock wait longer than the busy timeout fails (retried); a transaction of ours
            # left open by a lost client (its locks held) is ended by the server
            conn.execute(
                "SELECT set_config('lock_timeout', %s, false),"
                " set_config('idle_in_transaction_session_timeout', %s, false)",
                (f"{int(self.busy_timeout_seconds * 1000)}ms",
                 f"{int(max(self.busy_timeout_seconds, 5.0) * 1000)}ms"))
            if self.synchronous == "FULL":  # a commit is on the server's disk once it returns
                conn.execute("SELECT set_config('synchronous_commit', 'on', false)"
                             " WHERE current_setting('synchronous_commit') = 'off'")
            (started,) = conn.execute(
                "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone() or (None,)
            conn_backends[id(conn)] = (conn.info.backend_pid, started)
            self._end_orphans(conn)
            if set_path:
                conn.execute("SELECT set_config('search_path', %s, false)",
                             (f'"{self.schema}"',))
            self._connected_since = self.clock()  # (again) after a break: see reclaim_expired
            if self._fixed_clock is None:
                before = time.time()
                (server,) = conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp())::float8").fetchone() or (0,)
                self._offset = float(server) - (before + time.time()) / 2
        except psycopg.Error as exc:
            conn.close()
            raise self._error(exc, "opening") from exc
        with self._lock:
            self._connections.append(conn)
        return conn

    def _end_orphans(self, conn: psycopg.Connection[Any]) -> None:
        """End the server processes of connections this store lost: a transaction of theirs
        the server still runs (it has not noticed the client is gone) would hold its row
        locks until then; ended, it is rolled back at once."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        for pid, started in orphans:
            # and wait until it is gone (PostgreSQL 14+: the timeout form), so that what it
            # was committing is settled, committed or not, before anything reads it back
            conn.execute("SELECT pg_terminate_backend(pid, %s) FROM pg_stat_activity"
                         " WHERE pid = %s AND backend_start = %s",
                         (int(max(self.busy_timeout_seconds, 1.0) * 1000), pid, started))
            row = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s"
                               " AND backend_start = %s", (pid, started)).fetchone()
            if row is not None:
                with self._lock:
                    self._orphans.append((pid, started))

    def _connect_error(self, exc: Exception) -> StoreError:
        text = str(exc).strip()
        where = f"cannot connect to {self.shown_url}"
        if "password authentication failed" in text or "no password supplied" in text:
            return StoreError(f"{where}: {text}; check the user name and password in "
                              "IDEMPOTENT_DATABASE")
        if "does not exist" in text:
            return StoreError(f"{where}: {text}; create it, or name an existing database "
                              "in IDEMPOTENT_DATABASE")
        if "no pg_hba.conf entry" in text:
            return StoreError(f"{where}: {text}; the server does not let this host or "
                              "user in (pg_hba.conf)")
        # refused, timed out, the server starting up or shutting down: worth retrying
        return StoreBusy(f"{where}: {text}")

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """This thread's connection, opened (again) when missing or broken; on a thread
        that never waits (:meth:`never_wait_here`), taken from the thread that reopens it,
        or :class:`~.StoreBusy` at once while it is not back."""
        if not self._opened:
            raise StoreError(f"store {self.shown_url} is not open")
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                self._drop(conn)
            connected = getattr(self._local, "connected", False)
            if connected and getattr(self._local, "never_wait", False):
                conn = self._reconnected()
            else:  # a first connection is made here, also by a thread that never waits
                conn = self._reconnect() if connected else self._connect()
            self._local.conn = conn
            self._local.connected = True
        return conn

    def never_wait_here(self, never: bool = True) -> None:
        self._local.never_wait = never
        self._local.reads_elsewhere = never

    def _reconnected(self) -> psycopg.Connection[Any]:
        """For a thread that never waits: the connection the reconnecting thread has opened
        for it, or :class:`~.StoreBusy` now, starting that thread when it is not running
        (one per store: it tries, backing off up to 1 s, until the server answers or the
        store is closed)."""
        with self._lock:
            reconnecting = self._reconnecting
            if reconnecting is not None and reconnecting.conn is not None:
                self._reconnecting = None
                return reconnecting.conn
            if reconnecting is None or reconnecting.error is not None:
                error = reconnecting.error if reconnecting is not None else None
                self._reconnecting = _Reconnecting(self)
                if error is not None:  # the last attempt's answer; the next one is started
                    raise error
        raise StoreBusy(f"the connection to {self.shown_url} was lost; it is being "
                        "re-established on another thread")

    def _reconnect(self) -> psycopg.Connection[Any]:
        """A new connection after one was lost: the server may be restarting, so a refused
        or not-ready connection is tried again for up to ``busy_timeout_seconds`` (this
        blocks, as a locked SQLite database does) before :class:`~.StoreBusy` is raised."""
        deadline = time.monotonic() + self.busy_timeout_seconds
        delay = 0.05
        while True:
            try:
                conn = self._connect()
            except StoreBusy:
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            logger.info("scrapy_idempotent: reconnected to %s", self.shown_url)
            return conn

    def _drop(self, conn: psycopg.Connection[Any]) -> None:
        conn_backends.pop(id(conn), None)
        with contextlib.suppress(Exception):
            conn.close()
        with self._lock, contextlib.suppress(ValueError):
            self._connections.remove(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def close(self) -> None:
        self._stop_heartbeat()
        self._stop_listening()
        with self._lock:
            reconnecting, self._reconnecting = self._reconnecting, None
        if reconnecting is not None:
            reconnecting.stop()
        with self._lock:
            reader, self._reader, self._reading = self._reader, None, None
        if reader is not None:  # a read held by a server not answering is not waited for
            reader.shutdown(wait=False)
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn_backends.pop(id(conn), None)
            with contextlib.suppress(Exception):
                conn.close()
        self._local = threading.local()
        self._opened = False

    def _error(self, exc: Exception, doing: str, *, committing: bool = False) -> StoreError:
        """The :class:`~.StoreError` naming the cause of a psycopg error; only what a retry
        can cure (a lock wait over the timeout, a deadlock, a serialization failure, a
        statement timeout, a connection lost outside COMMIT) is :class:`~.StoreBusy`."""
        import psycopg
        from psycopg import errors

        where = f"the database {self.shown_url} (schema {self.schema})"
        if isinstance(exc, errors.DeadlockDetected):
            return StoreBusy(f"{where}: this transaction and another one waited for each "
                             f"other's locks while {doing}; the server ended this one, which "
                             f"is retried ({exc})")
        if isinstance(exc, errors.SerializationFailure):
            return StoreBusy(f"{where}: this transaction conflicted with a concurrent one "
                             f"while {doing}; it is retried ({exc})")
        if isinstance(exc, errors.LockNotAvailable):
            return StoreBusy(f"{where} is locked by another transaction longer than "
                             f"IDEMPOTENT_BUSY_TIMEOUT_SECONDS "
                             f"({self.busy_timeout_seconds:g} s) allows while {doing} ({exc})")
        if isinstance(exc, errors.QueryCanceled):
            return StoreBusy(f"a statement on {where} was cancelled (statement_timeout, or "
                             f"by an administrator) while {doing} ({exc})")
        if isinstance(exc, errors.DiskFull):
            return StoreError(f"the disk of the database server holding {where} is full "
                              f"while {doing} ({exc}): free some space on the server")
        if isinstance(exc, errors.InsufficientPrivilege):
            return StoreError(
                f"the user of {self.shown_url} may not do what the store needs while "
                f"{doing} ({exc}): it needs CREATE on the database (or owning schema "
                f"{self.schema}), and to read and write the tables in it")
        if isinstance(exc, errors.ReadOnlySqlTransaction):
            return StoreError(f"{where} is read-only (a standby server?) while {doing} "
                              f"({exc}): point IDEMPOTENT_DATABASE at the primary")
        if isinstance(exc, (errors.UndefinedTable, errors.UndefinedColumn)):
            return StoreError(f"{where} does not have the schema this scrapy_idempotent "
                              f"expects ({exc}); was it changed by hand or by another program?")
        conn = getattr(self._local, "conn", None)
        lost = isinstance(exc, psycopg.OperationalError) and (
            conn is None or conn.closed or conn.broken)
        if lost or isinstance(exc, (errors.AdminShutdown, errors.CannotConnectNow)):
            if conn is not None:
                backend = conn_backends.pop(id(conn), None)
                if backend is not None:
                    with self._lock:
                        self._orphans.append(backend)
                self._drop(conn)
            if committing:
                return _CommitOutcomeUnknown(
                    f"the connection to {where} was lost while committing ({exc}): the "
                    "transaction may or may not have been committed")
            return StoreBusy(f"the connection to {where} was lost while {doing} ({exc}); "
                             "reconnecting")
        return StoreError(f"cannot use {where} while {doing}: {exc}")

    @contextlib.contextmanager
    def _write(self, doing: str = "writing", *,
               repeatable: bool = True) -> Iterator[psycopg.Cursor[Any]]:
        """The one write-transaction primitive: BEGIN ... COMMIT on this thread's connection,
        rolled back on any exception (all or nothing). A connection lost during COMMIT of a
        ``repeatable`` transaction (doing it twice is the same as once: renewals, releases,
        the heartbeat) is :class:`~.StoreBusy`, retried; of another, the caller finds out
        whether it happened (:meth:`commit`)."""
        import psycopg

        committing = False
        try:
            conn = self.conn
            with conn.transaction():
                cur = conn.cursor()
                yield cur
                committing = True
        except psycopg.Error as exc:
            error = self._error(exc, doing, committing=committing)
            if isinstance(error, _CommitOutcomeUnknown) and repeatable:
                raise StoreBusy(f"{error}; it is repeated (doing it twice is the same as "
                                "once)") from exc
            raise error from exc
        self.transactions += 1

    @contextlib.contextmanager
    def _pipelined(self, doing: str) -> Iterator[psycopg.Cursor[Any]]:
        """:meth:`_write` in psycopg's pipeline mode, for the page commit (not repeatable:
        a connection lost during COMMIT raises :class:`_CommitOutcomeUnknown`).

        Statements are sent without waiting for their answers; the client waits only where
        it reads one (a fetch) and once at the end for COMMIT's. They still run one after
        the other, in the order sent, in the one transaction; an error in any of them fails
        the transaction, raised at the next wait at the latest, and the transaction is
        rolled back."""
        import psycopg
        from psycopg.pq import TransactionStatus

        committing = False
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = self.conn
            # BEGIN and COMMIT as statements: psycopg's transaction() would wait for the
            # server after BEGIN and twice at its end
            with conn.pipeline():
                cur = conn.cursor()
                cur.execute("BEGIN")
                yield cur
                committing = True  # from here on the server may have committed
                cur.execute("COMMIT")
        except BaseException as exc:
            if conn is not None and not conn.closed and not conn.broken:
                with contextlib.suppress(psycopg.Error):
                    if conn.info.transaction_status != TransactionStatus.IDLE:
                        conn.execute("ROLLBACK")
            if isinstance(exc, psycopg.Error):
                raise self._error(exc, doing, committing=committing) from exc
            raise
        self.transactions += 1

    def _read(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        """One statement outside any transaction (autocommit): every row. On a thread that
        never waits, made by the reader thread within :data:`READ_DEADLINE_SECONDS`."""
        if getattr(self._local, "reads_elsewhere", False):
            return self._read_elsewhere(sql, params)
        return self._read_here(sql, params)

    def _read_elsewhere(self, sql: str,
                        params: Sequence[Any] | dict[str, Any]) -> list[Any]:
        with self._lock:
            if self._reading is not None and not self._reading.done():
                raise StoreBusy(f"the database {self.shown_url} has not answered a read for "
                                f"more than {READ_DEADLINE_SECONDS:g} s; reads are tried "
                                "again once it answers")
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="scrapy_idempotent-reads",
                    initializer=self._reader_thread_init)
            self._reading = reading = self._reader.submit(self._read_here, sql, params)
        try:
            return reading.result(timeout=READ_DEADLINE_SECONDS)
        except concurrent.futures.TimeoutError:
            raise StoreBusy(f"the database {self.shown_url} did not answer a read within "
                            f"{READ_DEADLINE_SECONDS:g} s") from None

    def _reader_thread_init(self) -> None:
        """This thread never waits for a lost connection, and makes its reads itself."""
        self._local.never_wait = True

    def _read_here(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[Any]:
        import psycopg

        try:
            return self.conn.execute(sql, params).fetchall()
        except psycopg.Error as exc:
            raise self._error(exc, "reading") from exc

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        """One statement that returns no rows, outside any transaction."""
        import psycopg

        try:
            self.conn.execute(sql, params)
        except psycopg.Error as exc:
            raise self._error(exc, "writing") from exc

    def _one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        rows = self._read(sql, params)
        return rows[0] if rows else None

    # -- schema and ownership ---------------------------------------------------------------

    def open(self, *, fingerprinter: str = "",
             identity: CrawlIdentity | None = None) -> str | None:
        if self.requested_schema is None:
            self.schema = schema_for(identity)
        self._opened = True
        try:
            stored = self._open(fingerprinter, identity)
        except BaseException:
            self.close()
            raise
        return stored if stored != fingerprinter else None

    def _open(self, fingerprinter: str, identity: CrawlIdentity | None) -> str:
        version, new = self._check_ownership()
        if identity is not None and not new:
            self._check_identity(self._stored_identity(), identity)
        for step in range(version, SCHEMA_VERSION):
            with self._write("migrating") as cur:
                self._lock_schema(cur)
                if new and step == 0:
                    cur.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
                if self._version(cur) != step:  # another worker migrated meanwhile
                    continue
                for statement in _MIGRATIONS[step]:
                    cur.execute(statement)
                cur.execute(
                    "INSERT INTO meta VALUES ('application', %s), ('schema_version', %s)"
                    " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                    (APPLICATION, str(step + 1)))
                cur.execute(f"COMMENT ON SCHEMA \"{self.schema}\" IS "
                            "'scrapy_idempotent frontier and records'")
        with self._write("opening") as cur:
            cur.execute("INSERT INTO meta VALUES ('fingerprinter', %s), ('created_at', %s)"
                        " ON CONFLICT (key) DO NOTHING", (fingerprinter, repr(self.clock())))
            (stored,) = cur.execute(
                "SELECT value FROM meta WHERE key = 'fingerprinter'").fetchone() or ("",)
            if identity is not None:
                self._claim_identity(cur, identity)
        return str(stored)

    def _lock_schema(self, cur: psycopg.Cursor[Any]) -> None:
        """Serialise schema changes and run starts of this crawl (a transaction lock)."""
        cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                    (f"{APPLICATION}:{self.schema}",))

    def _version(self, cur: psycopg.Cursor[Any]) -> int:
        row = cur.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f'"{self.schema}".meta',)).fetchone()
        if not row or not row[0]:
            return 0
        row = cur.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return int(row[0]) if row else 0

    def _tables(self, schema: str) -> set[str]:
        return {name for (name,) in self._read(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))}

    def _check_ownership(self) -> tuple[int, bool]:
        """Refuse, before anything changes, a schema that is not this package's: any table it
        does not create, or a ``meta`` table it did not write. Returns the schema version
        found and whether the schema is new (absent or empty)."""
        exists = self._one("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.schema,))
        tables = self._tables(self.schema) if exists else set()
        if not tables:
            return 0, True
        meta: dict[str, str] = {}
        if "meta" in tables:
            with contextlib.suppress(StoreError):
                meta = dict(self._read(
                    f'SELECT key, value FROM "{self.schema}".meta'
                    " WHERE key IN ('application', 'schema_version')"))
        version = int(meta["schema_version"]) if meta.get("schema_version", "").isdigit() else 0
        ours = meta.get("application") == APPLICATION and version >= 1
        if ours and version > SCHEMA_VERSION:
            raise StoreError(
                f"schema {self.schema} of {self.shown_url} has schema version {version}, "
                f"newer than this scrapy_idempotent supports ({SCHEMA_VERSION}); upgrade the "
                "package")
        if ours and tables <= _TABLES[version]:
            return version, False
        shown = ", ".join(sorted(tables)[:8])
        raise StoreError(
            f"schema {self.schema} of {self.shown_url} is not a scrapy_idempotent frontier "
            f"(tables: {shown}); it was left untouched: name another schema with "
            "?schema=NAME in IDEMPOTENT_DATABASE")

    def _stored_identity(self, cur: psycopg.Cursor[Any] | None = None) -> dict[str, str]:
        sql = "SELECT key, value FROM meta WHERE key IN ('project', 'spider', 'source')"
        if cur is not None:
            return dict(cur.execute(sql).fetchall())
        if "meta" not in self._tables(self.schema):
            return {}
        return dict(self._read(sql))

    def _claim_identity(self, cur: psycopg.Cursor[Any], identity: CrawlIdentity) -> None:
        stored = self._stored_identity(cur)
        if not stored:
            cur.execute("INSERT INTO meta VALUES ('project', %s), ('spider', %s), ('source', %s)"
                        " ON CONFLICT (key) DO NOTHING",
                        (identity.project, identity.spider, identity.source))
            stored = self._stored_identity(cur)
        self._check_identity(stored, identity)

    def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None:
        if not stored:
            return
        owner = CrawlIdentity(project=stored.get("project", ""),
                              spider=stored.get("spider", ""), source=stored.get("source", ""))
        if owner == identity:
            return
        raise StoreError(
            f"schema {self.schema} of {self.shown_url} belongs to spider {owner.spider!r} of "
            f"project {owner.project!r} (record source {owner.source!r}); this crawl is "
            f"spider {identity.spider!r} of project {identity.project!r} (record source "
            f"{identity.source!r}); it was left untouched: leave ?schema= out of "
            "IDEMPOTENT_DATABASE (each crawl then gets a schema of its own), or name "
            "another schema")

    # -- runs and sessions ------------------------------------------------------------------

    def begin_session(self, worker: str, run_mode: RunMode) -> RunInfo:
        now = self.clock()
        with self._write("starting a session") as cur:
            self._lock_schema(cur)  # two workers starting at once start one run
            last = cur.execute(
                "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
            new = starts_new_run(run_mode, None if last is None else last[1] is not None)
            if new or last is None:
                cur.execute("UPDATE runs SET finished_at = %s, reason = 'superseded'"
                            " WHERE finished_at IS NULL", (now,))
                if self.recrawl_seconds is None:
                    # an empty frontier without dead rows (TRUNCATE is transactional)
                    cur.execute("TRUNCATE requests, responses")
                else:
                    cur.execute(
                        "DELETE FROM requests WHERE state NOT IN ('done', 'failed',"
                        " 'redirected') OR finished_at < %s",
                        (window_start(self.recrawl_seconds, now),))
                    cur.execute("TRUNCATE responses")
                (run_id,) = cur.execute("INSERT INTO runs (started_at) VALUES (%s)"
                                        " RETURNING run_id", (now,)).fetchone() or (0,)
            else:
                run_id = last[0]
            (self.session_id,) = cur.execute(
                "INSERT INTO sessions (run_id, worker, started_at, heartbeat_at)"
                " VALUES (%s, %s, %s, %s) RETURNING session_id",
                (run_id, worker, now, now)).fetchone() or (None,)
        self.run_id = int(run_id)
        self._worker = worker
        self._start_heartbeat()
        return RunInfo(run_id=self.run_id, new=new, counts=self.counts())

    def end_session(self, worker: str, reason: str, inflight: Sequence[str] = (), *,
                    finish_run: bool = True) -> int:
        self._stop_heartbeat()
        now = self.clock()
        with self._write("closing") as cur:
            if inflight:
                cur.execute(
                    "UPDATE requests SET unfinished = unfinished - 1 WHERE key = ANY(%s)"
                    " AND state = 'leased' AND worker = %s AND unfinished > 0",
                    (list(inflight), worker))
            finishing = reason == "finished" and finish_run and self.run_id is not None
            if finishing:
                # first, before any row lock: waits for the page commits in progress (they
                # hold ROW EXCLUSIVE), so a child request another worker is inserting right
                # now is seen; and closes of other workers wait for this one
                cur.execute("LOCK TABLE requests IN SHARE ROW EXCLUSIVE MODE")
            released = self._release(cur, [worker])
            cur.execute("UPDATE sessions SET ended_at = %s, reason = %s"
                        " WHERE worker = %s AND ended_at IS NULL", (now, reason, worker))
            if finishing:
                (busy,) = cur.execute(
                    "SELECT EXISTS (SELECT 1 FROM requests WHERE state IN"
                    " ('pending', 'leased'))").fetchone() or (True,)
                if not busy:
                    cur.execute("UPDATE runs SET finished_at = %s, reason = %s"
                                " WHERE run_id = %s AND finished_at IS NULL",
                                (now, reason, self.run_id))
        return released

    # -- heartbeat --------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Write this session's heartbeat now (one statement)."""
        if self.session_id is None:
            return
        with self._write("writing the heartbeat") as cur:
            cur.execute("UPDATE sessions SET heartbeat_at = %s WHERE session_id = %s",
                        (self.clock(), self.session_id))

    def _start_heartbeat(self) -> None:
        if self.heartbeat_seconds is None or self._beat_thread is not None:
            return
        stop = threading.Event()
        interval = self.heartbeat_seconds

        def beat() -> None:
            failing = False
            while not stop.wait(interval):
                try:
                    self.heartbeat()
                except Exception as exc:  # the next beat tries again, on a new connection
                    if not failing:
                        logger.warning("scrapy_idempotent: cannot write the heartbeat: %s", exc)
                    failing = True
                else:
                    failing = False
            conn = getattr(self._local, "conn", None)
            if conn is not None:
                self._drop(conn)

        self._beat_stop = stop
        self._beat_thread = threading.Thread(target=beat, name="scrapy_idempotent heartbeat",
                                             daemon=True)
        self._beat_thread.start()

    def _stop_heartbeat(self) -> None:
        if self._beat_stop is not None:
            self._beat_stop.set()
        if self._beat_thread is not None and self._beat_thread is not threading.current_thread():
            self._beat_thread.join(timeout=30)
        self._beat_stop = self._beat_thread = None

    # -- the unit of work -------------------------------------------------------------------

    def commit(self, work: UnitOfWork, worker: str) -> CommitResult:
        result = CommitResult()
        if not work:
            return result
        run_id = self.run_id if self.run_id is not None else 0
        now = self.clock()
        number = next(self._commit_numbers)
        try:
            self._commit(work, worker, run_id, now, result, number)
        except _CommitOutcomeUnknown as exc:
            if not self._committed(number):
                raise StoreBusy(f"{exc}; it was not: it is retried") from exc
            logger.info("scrapy_idempotent: %s; it was, and is not repeated", exc)
        return result

    def _committed(self, number: int) -> bool:
        """Whether this session's page commit ``number`` was committed (read back after a
        connection lost during its COMMIT, waiting for the server as a reconnect does).
        Raises :class:`~.StoreError` when that cannot be known: repeating the commit could
        then write its unit of work twice."""
        if self.session_id is not None:
            with contextlib.suppress(StoreError):
                _ = self.conn  # reconnects, ending the lost connection's server process
                if not self._orphans:  # it is gone: what it committed is visible now
                    row = self._one("SELECT last_commit FROM sessions WHERE session_id = %s",
                                    (self.session_id,))
                    if row is not None:  # the last commit written (commits are serial)
                        return int(row[0]) == number
        raise StoreError(
            f"the connection to {self.shown_url} was lost while committing, and whether the "
            "commit happened cannot be read back: nothing more is written by this crawl; run "
            "it again to resume from what the database holds")

    def _commit(self, work: UnitOfWork, worker: str, run_id: int, now: float,
                result: CommitResult, number: int) -> None:
        """The page commit: one transaction, pipelined (see :meth:`_pipelined`). The client
        waits for the server only where a decision needs an answer: the fence and the
        known entries (one wait), the records (see :meth:`_upsert_records`), the results of
        every write and the claim (one wait), COMMIT."""
        with self._pipelined("committing") as cur:
            fence = self._send_fence(cur, work, worker)  # first: the completions' rows
            lookups = self._send_lookups(cur, work.requests)
            lost = self._fence(fence)
            requests = [r for r in work.requests if r.parent_key not in lost] if lost \
                else work.requests
            inserted = self._insert_requests(cur, requests, now, run_id, result, lookups)
            records = [r for r in work.records if r[1] not in lost] if lost else work.records
            changes = self._upsert_records(cur, records, now, run_id, result)
            if work.outbox_targets and changes:
                self._write_outbox(cur, changes, work.outbox_targets, now, run_id, result)
            rejects = [r for r in work.rejects if r.request_key not in lost]
            if rejects:
                cur.executemany(
                    "INSERT INTO rejects (item_type, reason, data, request_key, page_url,"
                    " created_at, run_id) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    [(r.item_type, r.reason, r.data, r.request_key, r.page_url, now, run_id)
                     for r in rejects])
                result.rejects += len(rejects)
            responses = [r for r in work.responses if r[0] not in lost]
            if responses:
                self._journal(cur, responses, now)
            started = [key for key in work.started if key not in lost]
            if started:
                cur.execute(
                    "UPDATE requests SET attempts = attempts + 1, unfinished = unfinished + 1"
                    " WHERE key = ANY(%s) AND state = 'leased' AND worker = %s",
                    (started, worker))
            replayed = [key for key in work.replayed if key not in lost]
            if replayed:
                cur.execute("UPDATE requests SET replays = replays + 1"
                            " WHERE key = ANY(%s) AND state = 'leased' AND worker = %s",
                            (replayed, worker))
            completing = self._complete(cur, work.completions, lost, worker, now)
            if work.give_back:
                cur.execute(
                    "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"
                    " WHERE key = ANY(%s) AND state = 'leased' AND worker = %s",
                    (list(work.give_back), worker))
            if work.claim:
                self._claim(cur, worker, work.claim, now, result)  # waits for every answer
            self._inserted(inserted, result)
            self._completed(completing, result)
            self._count(cur, result, len(started), number)
            if (result.requests_added or result.requests_due_again
                    or result.completed.get(RequestState.PENDING.value)):
                self._notify(cur)

    @staticmethod
    def _send_fence(cur: psycopg.Cursor[Any], work: UnitOfWork,
                    worker: str) -> tuple[set[str], psycopg.Cursor[Any] | None]:
        """Lock the rows of ``work``'s requests that ``worker`` leases now (until the
        commit: no other worker can take or release them meanwhile); the answer is read
        by :meth:`_fence`."""
        keys = {c.key for c in work.completions}
        keys.update(key for key, _, _ in work.responses)
        keys.update(work.started)
        if not keys:
            return keys, None
        held = cur.connection.cursor()
        held.execute("SELECT key FROM requests WHERE key = ANY(%s) AND state = 'leased'"
                     " AND worker = %s ORDER BY key FOR UPDATE", (sorted(keys), worker))
        return keys, held

    @staticmethod
    def _fence(sent: tuple[set[str], psycopg.Cursor[Any] | None]) -> set[str]:
        """The keys of the unit whose request is not leased by the worker now."""
        keys, held = sent
        if held is None:
            return set()
        return keys - {key for (key,) in held.fetchall()}

    def _insert_requests(self, cur: psycopg.Cursor[Any], requests: list[NewRequest],
                         now: float, run_id: int, result: CommitResult,
                         lookups: _Lookups) -> _Inserting | None:
        """Add ``requests`` to the frontier: a new key is inserted, a known one is a
        duplicate, already done, or (recrawl window) due again. ``lookups``: the known
        entries (:meth:`_send_lookups` of these requests or more). Returns the insert sent,
        whose answer :meth:`_inserted` counts."""
        if not requests:
            return None
        by_key, by_fingerprint = self._known_entries(lookups)
        new, due = self._sort_out(requests, by_key, by_fingerprint, now, result)
        if due:
            self._due_again(cur, due, now, run_id)
        if not new:
            return None
        return self._insert_new(cur, new, now, run_id)

    @staticmethod
    def _send_lookups(cur: psycopg.Cursor[Any], requests: list[NewRequest]) -> _Lookups:
        """Ask for the entries already there: by key (the keys of ``requests``, and the
        fingerprints of those filtered by fingerprint), and by fingerprint (entries whose
        key is not their fingerprint: ``dont_filter`` requests); read by
        :meth:`_known_entries`."""
        if not requests:
            return None, None
        lookup = {r.key for r in requests} | {r.fingerprint for r in requests
                                              if r.filter_fingerprint}
        by_key = cur.connection.cursor()
        by_key.execute("SELECT id, key, state, finished_at FROM requests WHERE key = ANY(%b)",
                       (sorted(lookup),))
        fingerprints = sorted({r.fingerprint for r in requests if r.filter_fingerprint})
        if not fingerprints:
            return by_key, None
        by_fingerprint = cur.connection.cursor()
        by_fingerprint.execute(
            "SELECT id, fingerprint, state, finished_at FROM requests"
            " WHERE fingerprint = ANY(%b) AND key <> fingerprint", (fingerprints,))
        return by_key, by_fingerprint

    @staticmethod
    def _known_entries(lookups: _Lookups) -> tuple[dict[str, _Known], dict[str, _Known]]:
        """The answers of :meth:`_send_lookups`: entries by key, and by fingerprint."""
        sent_by_key, sent_by_fingerprint = lookups
        by_key: dict[str, _Known] = {} if sent_by_key is None else {
            key: (id_, state, finished)
            for id_, key, state, finished in sent_by_key.fetchall()}
        by_fingerprint: dict[str, _Known] = {}
        if sent_by_fingerprint is not None:
            for id_, fingerprint, state, finished in sent_by_fingerprint.fetchall():
                by_fingerprint.setdefault(fingerprint, (id_, state, finished))
        return by_key, by_fingerprint

    def _sort_out(self, requests: list[NewRequest], by_key: dict[str, _Known],
                  by_fingerprint: dict[str, _Known], now: float, result: CommitResult
                  ) -> tuple[list[NewRequest], dict[int, NewRequest]]:
        """The requests to insert (in the order given) and the finished entries due again
        (entry id -> the request that brings it back); counts duplicates and the already
        done. A request seen earlier in ``requests`` counts as known."""
        window = window_start(self.recrawl_seconds, now)
        new: list[NewRequest] = []
        due: dict[int, NewRequest] = {}
        for req in requests:
            known = by_key.get(req.key)
            if known is None and req.filter_fingerprint:
                known = by_key.get(req.fingerprint) or by_fingerprint.get(req.fingerprint)
            if known is None:
                new.append(req)
                placeholder: _Known = (None, "pending", None)
                by_key[req.key] = placeholder
                if req.key != req.fingerprint:
                    by_fingerprint.setdefault(req.fingerprint, placeholder)
                continue
            decision = enqueue_decision(known[1], known[2], window)
            if decision is Enqueue.DUPLICATE:
                result.requests_duplicate += 1
            elif decision is Enqueue.DUE_AGAIN:
                due[known[0]] = req
                by_key[req.key] = (known[0], "pending", None)
                result.requests_due_again += 1
            else:
                result.requests_already_done += 1
        return new, due

    @staticmethod
    def _due_again(cur: psycopg.Cursor[Any], due: dict[int, NewRequest], now: float,
                   run_id: int) -> None:
        """Put finished entries back to pending (the recrawl window), in id order: page
        commits locking the same rows lock them in one order, so they never deadlock."""
        cur.executemany(
            "UPDATE requests SET state = 'pending', data = %s, priority = %s,"
            " is_start = %s, fifo = %s, attempts = 0, finished_at = NULL,"
            " error_kind = NULL, error_message = NULL, enqueued_at = %s, run_id = %s"
            " WHERE id = %s",
            [(req.data, req.priority, req.is_start, req.fifo, now, run_id, id_)
             for id_, req in sorted(due.items())])

    @staticmethod
    def _insert_new(cur: psycopg.Cursor[Any], new: list[NewRequest], now: float,
                    run_id: int) -> _Inserting:
        """Insert ``new`` in one statement; a key another worker inserted meanwhile is a
        duplicate (the unique index decides: see :meth:`_inserted`).

        The ids (the claim order depends on them) are taken in the order given, but the rows
        go into the table in key order: two page commits inserting the same keys take the
        unique index's locks in one order, so one waits for the other instead of both
        deadlocking."""
        inserting = cur.connection.cursor()
        inserting.execute(
            "WITH given AS (SELECT nextval('requests_id_seq') AS id, k, f, u, p, s, ff, d, pk"
            # binary parameters: text arrays are not quoted element by element
            "  FROM unnest(%b::text[], %b::text[], %b::text[], %b::int[], %b::bool[],"
            "   %b::bool[], %b::text[], %b::text[])"
            "  WITH ORDINALITY AS t(k, f, u, p, s, ff, d, pk, n)"
            # nextval is evaluated after the sort: ids in the order given
            "  ORDER BY n)"
            " INSERT INTO requests (id, key, fingerprint, url, priority, is_start, fifo, state,"
            " data, parent_key, enqueued_at, run_id)"
            " SELECT id, k, f, u, p, s, ff, 'pending', d, pk, %s, %s FROM given"
            " ORDER BY k COLLATE \"C\" ON CONFLICT (key) DO NOTHING RETURNING key",
            ([r.key for r in new], [r.fingerprint for r in new], [r.url for r in new],
             [r.priority for r in new], [r.is_start for r in new], [r.fifo for r in new],
             [r.data for r in new], [r.parent_key for r in new], now, run_id))
        return inserting, len(new)

    @staticmethod
    def _inserted(inserting: _Inserting | None, result: CommitResult) -> None:
        """Count the answer of :meth:`_insert_new`: the keys inserted are added, the others
        duplicates."""
        if inserting is None:
            return
        sent, count = inserting
        added = len(sent.fetchall())
        result.requests_added += added
        result.requests_duplicate += count - added

    def _upsert_records(self, cur: psycopg.Cursor[Any],
                        records: list[tuple[Record, str | None]], now: float, run_id: int,
                        result: CommitResult) -> list[tuple[str, Record, int]]:
        """Upsert ``records``; returns the changes written: ``(kind, record, version)`` with
        kind ``inserted`` or ``updated`` (an unchanged or stale record is no change)."""
        changes: list[tuple[str, Record, int]] = []
        if not records:
            return changes
        # times users read never go backwards (see the SQLite store); and the numbers of
        # the records' first sight in this run, taken in item order (the feeds' order)
        newest, seqs = cur.execute(
            "SELECT (SELECT max(last_changed) FROM records), ARRAY(SELECT"
            " nextval('records_seen_seq') FROM generate_series(1, %s) ORDER BY 1)",
            (len(records),)).fetchone() or (None, [])
        if newest is not None and newest > now:
            now = newest
        ids = sorted({record.record_id for record, _ in records})
        known: dict[str, _StoredState] = {
            row[0]: _StoredState(*row[1:]) for row in cur.execute(
                "SELECT record_id, content_hash, seen_run_id, observed_at, version"
                " FROM records WHERE record_id = ANY(%s) ORDER BY record_id FOR UPDATE",
                (ids,))}
        # written in record ID order (a record ID twice keeps its item order: the last
        # wins): page commits inserting the same new records take the unique index's locks
        # in one order, so one waits for the other instead of both deadlocking
        written: list[tuple[int, str, Record, int]] = []
        for n in sorted(range(len(records)), key=lambda n: records[n][0].record_id):
            record, request_key = records[n]
            # a record without its observation time was observed at its commit; a worker's
            # observation is put on the server's clock, as every other time of this store,
            # so hosts whose clocks disagree still order their observations rightly
            observed = (record.observed_at + self._offset if record.observed_at is not None
                        else now)
            change = self._upsert_record(cur, record, request_key, run_id, now, observed,
                                         seqs[n], known, result)
            if change is not None:
                written.append((n, change[0], record, change[1]))
        return [(kind, record, version)
                for _, kind, record, version in sorted(written, key=lambda w: w[0])]

    @staticmethod
    def _write_outbox(cur: psycopg.Cursor[Any], changes: list[tuple[str, Record, int]],
                      targets: tuple[str, ...], now: float, run_id: int,
                      result: CommitResult) -> None:
        """One outbox entry per change and target, in the transaction of the change."""
        cur.executemany(
            "INSERT INTO outbox (target, idempotency_key, kind, record_id, content_hash,"
            " item_type, source, natural_key, data, run_id, created_at, due_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [(target, change_key(record, version), kind, record.record_id,
              record.content_hash, record.item_type, record.source, record.natural_key,
              record.data, run_id, now, now)
             for kind, record, version in changes for target in targets])
        result.outbox_entries += len(changes) * len(targets)

    @staticmethod
    def _upsert_record(cur: psycopg.Cursor[Any], record: Record, request_key: str | None,
                       run_id: int, now: float, observed: float, seq: int,
                       known: dict[str, _StoredState],
                       result: CommitResult) -> tuple[str, int] | None:
        """Insert, update (content changed) or leave alone (same content) one record, and
        mark it seen in ``run_id`` as its ``seq``-th record (unless seen there before);
        ``known`` holds the rows read (and locked) so far. Data ``observed`` before the
        stored data's observation is refused: nothing is written. Returns the change
        stored (kind, version), if any."""
        current = known.get(record.record_id)
        if current is None:
            row = cur.execute(
                "INSERT INTO records (record_id, source, natural_key, item_type, data,"
                " content_hash, first_seen, last_changed, first_run_id, changed_run_id,"
                " request_key, seen_run_id, seen_at, seen_seq, observed_at, version)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 1)"
                " ON CONFLICT (record_id) DO NOTHING RETURNING record_id",
                (record.record_id, record.source, record.natural_key, record.item_type,
                 record.data, record.content_hash, now, now, run_id, run_id, request_key,
                 run_id, now, seq, observed)).fetchone()
            if row is not None:
                known[record.record_id] = _StoredState(record.content_hash, run_id, observed, 1)
                result.records_inserted += 1
                return "inserted", 1
            # another worker inserted this record ID since the read: the unique index was
            # the backstop; this write becomes an update (or nothing) of that row
            result.records_conflicts += 1
            fetched = cur.execute(
                "SELECT content_hash, seen_run_id, observed_at, version FROM records"
                " WHERE record_id = %s FOR UPDATE", (record.record_id,)).fetchone()
            assert fetched is not None
            current = _StoredState(*fetched)
        first_sight = current.seen_run_id != run_id
        if observed < current.observed_at:
            # older than what is stored (a page downloaded earlier, committed later): the
            # data stays; the record is still one this run saw (its feeds list it)
            result.records_stale += 1
            if first_sight:
                cur.execute("UPDATE records SET seen_run_id = %s, seen_at = %s,"
                            " seen_seq = %s WHERE record_id = %s",
                            (run_id, now, seq, record.record_id))
                known[record.record_id] = current._replace(seen_run_id=run_id)
            return None
        change: tuple[str, int] | None = None
        if current.content_hash != record.content_hash:
            cur.execute(
                "UPDATE records SET data = %s, content_hash = %s, item_type = %s,"
                " last_changed = %s, changed_run_id = %s, request_key = %s,"
                " observed_at = %s, version = version + 1,"
                " seen_at = CASE WHEN seen_run_id = %s THEN seen_at ELSE %s END,"
                " seen_seq = CASE WHEN seen_run_id = %s THEN seen_seq"
                "  ELSE %s END,"
                " seen_run_id = %s WHERE record_id = %s",
                (record.data, record.content_hash, record.item_type, now, run_id, request_key,
                 observed, run_id, now, run_id, seq, run_id, record.record_id))
            result.records_updated += 1
            change = ("updated", current.version + 1)
        else:
            if first_sight:
                cur.execute("UPDATE records SET seen_run_id = %s, seen_at = %s,"
                            " seen_seq = %s, observed_at = %s WHERE record_id = %s",
                            (run_id, now, seq, observed, record.record_id))
            elif observed > current.observed_at:
                # the same data observed later: an older observation must not replace it
                cur.execute("UPDATE records SET observed_at = %s WHERE record_id = %s",
                            (observed, record.record_id))
            result.records_unchanged += 1
        known[record.record_id] = _StoredState(
            record.content_hash, run_id, observed,
            current.version + (1 if change is not None else 0))
        return change

    @staticmethod
    def _journal(cur: psycopg.Cursor[Any], responses: list[tuple[str, str, bytes]],
                 now: float) -> None:
        cur.executemany(
            "INSERT INTO responses (key, data, body, stored_at) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (key) DO UPDATE SET data = EXCLUDED.data, body = EXCLUDED.body,"
            " stored_at = EXCLUDED.stored_at",
            [(key, data, body, now) for key, data, body in responses])

    @staticmethod
    def _complete(cur: psycopg.Cursor[Any], completions: list[Completion], lost: set[str],
                  worker: str, now: float) -> list[tuple[Completion, psycopg.Cursor[Any] | None]]:
        """Send the completions (each its own statement, whose answer :meth:`_completed`
        reads: None for a completion of a lease not the worker's) and end the journal entry
        of each completion that ended its lease."""
        sent: list[tuple[Completion, psycopg.Cursor[Any] | None]] = []
        for done in completions:
            if done.key in lost:
                sent.append((done, None))
                continue
            update = cur.connection.cursor()
            if done.state is RequestState.PENDING:
                update.execute(
                    "UPDATE requests SET state = 'pending', worker = NULL,"
                    " leased_until = NULL, unfinished = 0, data = COALESCE(%s, data),"
                    " priority = COALESCE(%s, priority), error_kind = %s, error_message = %s"
                    " WHERE key = %s AND state = 'leased' AND worker = %s RETURNING key",
                    (done.data, done.priority, done.error_kind, done.error_message, done.key,
                     worker))
            else:
                update.execute(
                    "UPDATE requests SET state = %s, worker = NULL, leased_until = NULL,"
                    " unfinished = 0, finished_at = %s, error_kind = %s, error_message = %s"
                    " WHERE key = %s AND state = 'leased' AND worker = %s RETURNING key",
                    (done.state.value, now, done.error_kind, done.error_message, done.key,
                     worker))
            sent.append((done, update))
        ending = sorted({done.key for done, update in sent if update is not None})
        if ending:
            # only the lease holder's completion ends the journal entry: the rows were
            # fenced (this worker's leases, locked), so each key the updates above reached
            # is no longer leased to it now
            cur.execute("DELETE FROM responses WHERE key = ANY(%s) AND NOT EXISTS"
                        " (SELECT 1 FROM requests q WHERE q.key = responses.key"
                        "  AND q.state = 'leased' AND q.worker = %s)", (ending, worker))
        return sent

    @staticmethod
    def _completed(sent: list[tuple[Completion, psycopg.Cursor[Any] | None]],
                   result: CommitResult) -> None:
        """Count the answers of :meth:`_complete`, in the order of the completions."""
        for done, update in sent:
            if update is not None and update.fetchone() is not None:
                result.completed[done.state.value] = (
                    result.completed.get(done.state.value, 0) + 1)
            else:  # not this worker's lease, or the same key completed twice in one unit
                result.leases_lost += 1
                result.lost.append(done.key)

    def _count(self, cur: psycopg.Cursor[Any], result: CommitResult, started: int,
               number: int) -> None:
        """Add this transaction's work to this session's counters, and record its number
        (same transaction, one statement: one row per worker, so workers never wait on
        each other here)."""
        if self.session_id is None:
            return
        done = result.completed
        deltas = (started, done.get("done", 0),
                  done.get("failed", 0) + len(result.quarantined), done.get("redirected", 0),
                  result.records_inserted, result.records_updated, result.records_unchanged)
        cur.execute(
            "UPDATE sessions SET " + ", ".join(f"{c} = {c} + %s" for c in _COUNTERS)
            + ", last_commit = %s WHERE session_id = %s",
            (*deltas, number, self.session_id))

    def _claim(self, cur: psycopg.Cursor[Any], worker: str, count: int, now: float,
               result: CommitResult) -> None:
        until = now + self.lease_seconds
        rows = cur.execute(
            "WITH head AS (SELECT id FROM requests WHERE state = 'pending'"
            f" ORDER BY {QUEUE_ORDER} LIMIT %s FOR UPDATE SKIP LOCKED)"
            " UPDATE requests r SET state = 'leased', worker = %s, leased_until = %s"
            " FROM head WHERE r.id = head.id RETURNING "
            + ", ".join(f"r.{column}" for column in CLAIMED_COLUMNS),
            (count, worker, until)).fetchall()
        leased, over = split_claim(rows, self.max_attempts, until)
        if over:
            cur.executemany(
                "UPDATE requests SET state = 'failed', worker = NULL, leased_until = NULL,"
                " unfinished = 0, finished_at = %s, error_kind = 'quarantined',"
                " error_message = %s WHERE key = %s",
                [(now, quarantine_message(r.unfinished), r.key) for r in over])
            result.quarantined.extend(r.url for r in over)
        result.leased.extend(leased)

    # -- the response journal ---------------------------------------------------------------

    def journaled_response(self, key: str) -> tuple[str, bytes] | None:
        row = self._one("SELECT data, body FROM responses WHERE key = %s", (key,))
        return (row[0], bytes(row[1])) if row is not None else None

    def known_request(self, fingerprint: str, *, key: str | None = None) -> str | None:
        if key is not None:
            row = self._one("SELECT state, finished_at FROM requests WHERE key = %s", (key,))
        else:
            row = self._one(
                "SELECT state, finished_at FROM requests WHERE key = %s UNION ALL"
                " (SELECT state, finished_at FROM requests WHERE fingerprint = %s"
                "  AND key <> fingerprint LIMIT 1) LIMIT 1", (fingerprint, fingerprint))
        if row is None:
            return None
        return known_request_answer(row[0], row[1],
                                    window_start(self.recrawl_seconds, self.clock()))

    # -- leases -----------------------------------------------------------------------------

    def status(self, worker: str) -> FrontierStatus:
        row = self._one(
            "SELECT EXISTS (SELECT 1 FROM requests WHERE state = 'pending'),"
            " EXISTS (SELECT 1 FROM requests WHERE state = 'leased'"
            "  AND (worker <> %s OR leased_until < %s))", (worker, self.clock()))
        return FrontierStatus(claimable=bool(row[0]), leased_elsewhere=bool(row[1]))

    def renew_leases(self, worker: str) -> list[str]:
        now = self.clock()
        with self._write("renewing leases") as cur:
            # one statement: this session's heartbeat and every unexpired lease of the worker
            # (an expired lease is not revived: from its expiry on, anyone may take it)
            rows = cur.execute(
                "WITH beat AS (UPDATE sessions SET heartbeat_at = %s WHERE worker = %s"
                "  AND ended_at IS NULL)"
                " UPDATE requests SET leased_until = %s WHERE state = 'leased'"
                " AND worker = %s AND leased_until >= %s RETURNING key",
                (now, worker, now + self.lease_seconds, worker, now)).fetchall()
        return [key for (key,) in rows]

    def release_leases(self, workers: list[str]) -> int:
        if not workers:
            return 0
        with self._write("releasing leases") as cur:
            return self._release(cur, workers)

    def _release(self, cur: psycopg.Cursor[Any], workers: list[str]) -> int:
        cur.execute("UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"
                    " WHERE state = 'leased' AND worker = ANY(%s)", (list(workers),))
        released = cur.rowcount
        if released:
            self._notify(cur, force=True)
        return released

    # -- waking idle workers (LISTEN/NOTIFY) ------------------------------------------------

    @property
    def channel(self) -> str:
        """The notification channel of this crawl: its schema's name."""
        return self.schema

    def _notify(self, cur: psycopg.Cursor[Any], *, force: bool = False) -> None:
        """Tell listening workers that requests became claimable, when this transaction
        commits (NOTIFY is transactional). At most one per :data:`NOTIFY_INTERVAL_SECONDS`
        from page commits (a busy crawl adds requests in most of them; an idle worker needs
        one signal, and polls besides), always for released leases."""
        now = time.monotonic()
        if not force and now - self._notified_at < NOTIFY_INTERVAL_SECONDS:
            return
        self._notified_at = now
        # the payload names the sender: its own listener ignores it
        cur.execute("SELECT pg_notify(%s, %s)", (self.channel, self._worker or ""))

    def watch_for_work(self, callback: Callable[[], object]) -> bool:
        """Listen on this crawl's channel from a thread of its own (its own connection) and
        call ``callback`` for each notification (several at once make one call). A lost
        connection is reopened, and ``callback`` called once (notifications sent meanwhile
        are lost)."""
        if self._listen_thread is not None:
            return True
        stop = threading.Event()

        def listen() -> None:
            listened = False
            while not stop.is_set():
                try:
                    conn = self._connect(set_path=False)
                except StoreError as exc:
                    logger.debug("scrapy_idempotent: cannot listen for work: %s", exc)
                    stop.wait(1.0)
                    continue
                try:
                    conn.execute(f'LISTEN "{self.channel}"')
                    if listened:  # what was sent while the connection was down is lost
                        callback()
                    listened = True
                    while not stop.is_set():
                        # drained in one go: one call for all; not for this worker's own
                        received = list(conn.notifies(timeout=0.5, stop_after=1))
                        if received:
                            with contextlib.suppress(Exception):
                                received += conn.notifies(timeout=0.0)
                        if any(n.payload != self._worker for n in received):
                            callback()
                except Exception as exc:
                    if not stop.is_set():
                        logger.debug("scrapy_idempotent: listening for work: %s", exc)
                        stop.wait(0.5)
                finally:
                    self._drop(conn)

        self._listen_stop = stop
        self._listen_thread = threading.Thread(
            target=listen, name="scrapy_idempotent listener", daemon=True)
        self._listen_thread.start()
        return True

    def _stop_listening(self) -> None:
        if self._listen_stop is not None:
            self._listen_stop.set()
        if (self._listen_thread is not None
                and self._listen_thread is not threading.current_thread()):
            self._listen_thread.join(timeout=30)
        self._listen_stop = self._listen_thread = None

    def dead_workers(self) -> list[str]:
        """Workers whose session has not ended and whose heartbeat is older than
        :attr:`dead_after_seconds` (empty when sessions are never dead by heartbeat)."""
        if self.dead_after_seconds is None:
            return []
        return [worker for (worker,) in self._read(
            f"{_DEAD_WORKERS} ORDER BY worker", (self.clock() - self.dead_after_seconds,))]

    def reclaim_expired(self) -> int:
        """Put back leases whose time is up, and every lease of another worker whose
        heartbeat is older than :attr:`dead_after_seconds` (dead, on whatever host), in one
        statement.

        Heartbeats are judged only once this store has been connected without a break for
        longer than the liveness bound plus a heartbeat period: after an outage of the
        server (or of this worker's network) no worker could beat, so stale heartbeats say
        nothing until the live workers have had the time to beat again."""
        with self._write("reclaiming leases") as cur:
            # judged once the connection of this transaction is there (it may have been
            # reopened just now)
            now = self.clock()
            judged = self.dead_after_seconds is not None and (
                now - self._connected_since
                >= self.dead_after_seconds + (self.heartbeat_seconds or 0.0))
            dead_before = now - self.dead_after_seconds if judged and self.dead_after_seconds \
                else float("-inf")
            cur.execute(
                "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL"
                " WHERE state = 'leased' AND (leased_until < %s OR"
                f" (worker IN ({_DEAD_WORKERS}) AND worker IS DISTINCT FROM %s))",
                (now, dead_before, self._worker))
            reclaimed = cur.rowcount
            if reclaimed:
                self._notify(cur, force=True)
            return reclaimed

    # -- the outbox --------------------------------------------------------------------------

    def claim_outbox(self, targets: Sequence[str], limit: int, hold_seconds: float, *,
                     exclude: Collection[int] = ()) -> list[OutboxEntry]:
        if not targets or limit <= 0:
            return []
        now = self.clock()
        with self._write("claiming outbox entries") as cur:
            rows = cur.execute(
                "UPDATE outbox SET due_at = %s WHERE id IN (SELECT id FROM outbox"
                "  WHERE state = 'pending' AND target = ANY(%s) AND due_at <= %s"
                "  AND NOT (id = ANY(%s::bigint[]))"
                "  ORDER BY due_at, id LIMIT %s FOR UPDATE SKIP LOCKED)"
                " RETURNING id, target, idempotency_key, kind, record_id, content_hash,"
                " item_type, source, natural_key, data, run_id, created_at, attempts, due_at",
                (now + hold_seconds, list(targets), now, list(exclude), limit)).fetchall()
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
        with self._write("recording deliveries") as cur:
            for outcome in outcomes:
                # only a pending entry, and only while the claim that sent it holds it
                held = (" WHERE id = %s AND state = 'pending'"
                        " AND (%s::float8 IS NULL OR due_at = %s::float8)")
                token = (outcome.entry_id, outcome.held_until, outcome.held_until)
                if outcome.state is OutboxState.PENDING:
                    cur.execute(
                        "UPDATE outbox SET attempts = attempts + 1, due_at = %s, detail = %s"
                        + held,
                        (outcome.retry_at if outcome.retry_at is not None else now,
                         outcome.detail, *token))
                else:
                    cur.execute(
                        "UPDATE outbox SET state = %s, attempts = attempts + 1,"
                        " settled_at = %s, detail = %s,"
                        " data = CASE WHEN %s THEN NULL ELSE data END" + held,
                        (outcome.state.value, now, outcome.detail,
                         outcome.state is OutboxState.DELIVERED, *token))
                if cur.rowcount:
                    settled.append(outcome)
        return settled

    def outbox_next_due(self, targets: Sequence[str]) -> float | None:
        if not targets:
            return None
        (due,) = self._one("SELECT min(due_at) FROM outbox WHERE state = 'pending'"
                           " AND target = ANY(%s)", (list(targets),))
        return float(due) if due is not None else None

    def outbox_entries(self, *, after: int | None = None, limit: int = 1000) -> list[OutboxRow]:
        return [OutboxRow(*row) for row in self._read(
            "SELECT id, target, idempotency_key, kind, record_id, state, attempts, detail, data"
            " FROM outbox WHERE id > %s ORDER BY id LIMIT %s", (after or 0, limit))]

    def outbox_counts(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for target, state, n in self._read(
                "SELECT target, state, count(*) FROM outbox GROUP BY target, state"
                " ORDER BY target"):
            by_state = counts.setdefault(target, {s.value: 0 for s in OutboxState})
            by_state[state] = n
        return counts

    def reclaim_space(self, *, everything: bool = False) -> int:
        """PostgreSQL's autovacuum gives the space of dead rows back for reuse (tuned on the
        high-churn tables at creation); nothing to do here: 0."""
        return 0

    def live_workers(self) -> list[str]:
        """Sessions not ended whose heartbeat is within the liveness bound (any host)."""
        if self.dead_after_seconds is None:
            return [w for (w,) in self._read("SELECT DISTINCT worker FROM sessions"
                                              " WHERE ended_at IS NULL ORDER BY worker")]
        return [w for (w,) in self._read(
            "SELECT DISTINCT worker FROM sessions WHERE ended_at IS NULL"
            " AND heartbeat_at >= %s ORDER BY worker",
            (self.clock() - self.dead_after_seconds,))]

    def lease_holders(self) -> list[LeaseHolder]:
        rows = self._read(
            "SELECT worker, count(*), max(leased_until) FROM requests WHERE state = 'leased'"
            " GROUP BY worker ORDER BY worker")
        return [LeaseHolder(worker=w, leases=n, leased_until=u) for w, n, u in rows]

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in RequestState}
        for state, n in self._read("SELECT state, count(*) FROM requests GROUP BY state"):
            counts[state] = n
        counts["records"] = self._one("SELECT count(*) FROM records")[0]
        return counts

    # -- operator queries -------------------------------------------------------------------

    def open_existing(self, *, readonly: bool = True,
                      identity: CrawlIdentity | None = None) -> SchemaInfo:
        if self._opened:
            raise StoreError(f"store {self.shown_url} is already open")
        self._opened = True
        try:
            if self.requested_schema is None:
                self._use_schema(schema_for(identity) if identity is not None
                                 else self._only_schema())
            if not self._tables(self.schema):
                raise StoreError(f"no frontier in schema {self.schema} of {self.shown_url}")
            version, _ = self._check_ownership()
            if identity is not None:
                self._check_identity(self._stored_identity(), identity)
            if readonly:
                self._execute("SET default_transaction_read_only = on")
        except BaseException:
            self.close()
            raise
        return SchemaInfo(version=version, supported=SCHEMA_VERSION)

    def engine_settings(self) -> list[EngineSetting]:
        """None to check: what a crawl relies on (transactions, row locks) PostgreSQL always
        has."""
        return []

    def entry(self, key: str) -> FrontierEntry | None:
        found = self._entries_where("key = %s", (key,), 1)
        return found[0] if found else None

    def entries(self, *, after: str | None = None, limit: int = 1000) -> list[FrontierEntry]:
        return self._entries_where("key > %s", (after or "",), limit)

    def _entries_where(self, where: str, params: tuple[Any, ...],
                       limit: int) -> list[FrontierEntry]:
        return [FrontierEntry(*row) for row in self._read(
            "SELECT key, fingerprint, url, state, priority, is_start, data, parent_key, worker,"
            " leased_until, attempts, unfinished, replays, enqueued_at, finished_at, error_kind,"
            f" error_message, run_id FROM requests WHERE {where} ORDER BY key COLLATE \"C\""
            " LIMIT %s", (*params, limit))]

    def _use_schema(self, schema: str) -> None:
        """Work in ``schema`` from now on (the connections open now included)."""
        self.schema = schema
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.execute("SELECT set_config('search_path', %s, false)", (f'"{schema}"',))

    def _only_schema(self) -> str:
        """The schema of the one crawl in the database (its frontiers: schemas with this
        package's ``meta`` table); an error listing them when there are several."""
        rows = self._read(
            "SELECT n.nspname FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid"
            " WHERE c.relname = 'meta' AND c.relkind = 'r' ORDER BY 1")
        found = [name for (name,) in rows
                 if self._one(f'SELECT value FROM "{name}".meta WHERE key = %s',
                              ("application",)) == (APPLICATION,)]
        if len(found) == 1:
            return str(found[0])
        if not found:
            raise StoreError(f"no scrapy_idempotent frontier in {self.shown_url}")
        raise StoreError(f"{self.shown_url} holds the frontiers of several crawls (schemas "
                         f"{', '.join(found)}): name one with ?schema=NAME")

    def meta(self) -> dict[str, str]:
        return dict(self._read("SELECT key, value FROM meta ORDER BY key"))

    def runs(self) -> list[RunSummary]:
        sums = ", ".join(f"coalesce(sum(s.{c}), 0)::bigint AS {c}" for c in _COUNTERS)
        return [RunSummary(*row) for row in self._read(
            f"SELECT r.run_id, r.started_at, r.finished_at, r.reason, {sums},"
            " (SELECT count(*) FROM rejects j WHERE j.run_id = r.run_id) AS rejects"
            " FROM runs r LEFT JOIN sessions s ON s.run_id = r.run_id"
            " GROUP BY r.run_id ORDER BY r.run_id")]

    def sessions(self) -> list[SessionInfo]:
        return [SessionInfo(*row) for row in self._read(
            "SELECT session_id, run_id, worker, started_at, ended_at, reason FROM sessions"
            " ORDER BY session_id")]

    def request_summary(self) -> RequestSummary:
        row = self._one(
            "SELECT count(*), coalesce(sum(attempts), 0), count(*) FILTER (WHERE attempts > 1),"
            " coalesce(max(attempts), 0),"
            " count(*) FILTER (WHERE state = 'leased' AND leased_until < %s),"
            " coalesce(sum(replays), 0), count(*) FILTER (WHERE attempts - replays > 1)"
            " FROM requests", (self.clock(),))
        requests, leases, repeated, most, expired, replays, again = (int(v) for v in row)
        (journaled,) = self._one("SELECT count(*) FROM responses")
        return RequestSummary(requests=requests, leases=leases, repeated=repeated,
                              most_attempts=most, expired_leases=expired,
                              journaled_responses=int(journaled), replays=replays,
                              downloads=leases - replays, downloaded_again=again)

    def failure_counts(self) -> dict[str, int]:
        return dict(self._read(
            "SELECT coalesce(error_kind, ''), count(*) FROM requests WHERE state = 'failed'"
            " GROUP BY 1 ORDER BY 2 DESC, 1"))

    def repeated_requests(self, limit: int) -> list[RepeatedRequest]:
        return [RepeatedRequest(*row) for row in self._read(
            "SELECT key, url, state, attempts, worker, error_kind FROM requests"
            " WHERE attempts > 1 ORDER BY attempts DESC, id LIMIT %s", (limit,))]

    def _failed_filter(self, kinds: list[str] | None, url_glob: str | None,
                       url_regex: str | None) -> tuple[str, list[Any]]:
        where, params = ["state = 'failed'"], []
        if kinds:
            where.append("(" + " OR ".join(
                "error_kind = %s OR left(error_kind, %s) = %s" for _ in kinds) + ")")
            for kind in kinds:
                params += [kind, len(kind) + 1, f"{kind}/"]
        if url_glob is not None or url_regex is not None:
            # matched here, in Python: the interface's glob, Python regular expressions
            glob = url_glob
            pattern = re.compile(url_regex) if url_regex is not None else None
            keys = [key for key, url in self._read(
                        "SELECT key, url FROM requests WHERE " + " AND ".join(where), params)
                    if (glob is None or url_glob_matches(glob, url))
                    and (pattern is None or pattern.search(url) is not None)]
            where.append("key = ANY(%s)")
            params.append(keys)
        return " AND ".join(where), params

    def failed_requests(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                        url_regex: str | None = None,
                        limit: int | None = None) -> list[FailedRequest]:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        return [FailedRequest(*row) for row in self._read(
            "SELECT key, url, error_kind, error_message, attempts, finished_at, parent_key,"
            f" run_id FROM requests WHERE {where} ORDER BY finished_at DESC, id DESC LIMIT %s",
            (*params, limit))]

    def count_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> int:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        return int(self._one(f"SELECT count(*) FROM requests WHERE {where}", params)[0])

    def retry_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> RetriedFailed:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        with self._write("putting failed requests back") as cur:
            cur.execute(
                "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL,"
                " attempts = 0, finished_at = NULL, error_kind = NULL, error_message = NULL"
                f" WHERE {where}", params)
            retried = cur.rowcount
            if retried:
                self._notify(cur, force=True)
            last = self._reopen(cur, bool(retried))
        return RetriedFailed(retried=retried, run_id=last[0] if last else None,
                             reopened=bool(retried and last and last[1] is not None))

    @staticmethod
    def _reopen(cur: psycopg.Cursor[Any], changed: bool) -> tuple[Any, ...] | None:
        """The last run ``(run_id, finished_at)``, reopened when ``changed`` and finished."""
        last = cur.execute(
            "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
        if changed and last is not None and last[1] is not None:
            cur.execute("UPDATE runs SET finished_at = NULL, reason = NULL WHERE run_id = %s",
                        (last[0],))
        return tuple(last) if last is not None else None

    def records_page(self, *, after: str | None = None, limit: int = 1000,
                     changed_since: float | None = None,
                     changed_since_run: int | None = None) -> list[StoredRecord]:
        where: list[str] = ["record_id > %s"]
        params: list[Any] = [after or ""]
        if changed_since is not None:
            where.append("last_changed >= %s")
            params.append(changed_since)
        if changed_since_run is not None:
            where.append("changed_run_id >= %s")
            params.append(changed_since_run)
        return [StoredRecord(*row) for row in self._read(
            "SELECT record_id, source, natural_key, item_type, data, first_seen, last_changed,"
            " first_run_id, changed_run_id, content_hash, request_key, version, observed_at"
            f" FROM records WHERE {' AND '.join(where)} ORDER BY record_id LIMIT %s",
            (*params, limit))]

    def run_records(self, run_id: int) -> Iterator[RunRecord]:
        columns = ("SELECT record_id, item_type, data, first_seen, last_changed, seen_seq,"
                   " seen_at FROM records WHERE seen_run_id = %s")
        order = " ORDER BY seen_seq, seen_at, record_id LIMIT 500"
        after: tuple[Any, ...] | None = None
        while True:
            if after is None:
                rows = self._read(columns + order, (run_id,))
            else:
                rows = self._read(columns + " AND (seen_seq, seen_at, record_id) >"
                                  " (%s, %s, %s)" + order, (run_id, *after))
            if not rows:
                return
            last = rows[-1]
            after = (last[5], last[6], last[0])
            for row in rows:
                yield RunRecord(*row[:5])

    def feed_base(self, run_id: int, uri: str, size: int) -> int:
        with self._write("recording a feed") as cur:
            cur.execute("INSERT INTO feeds (run_id, uri, base_size) VALUES (%s, %s, %s)"
                        " ON CONFLICT DO NOTHING", (run_id, uri, size))
            (base,) = cur.execute("SELECT base_size FROM feeds WHERE run_id = %s AND uri = %s",
                                  (run_id, uri)).fetchone() or (size,)
        return int(base)

    def store_feed(self, run_id: int, uri: str, level: int,
                   replace: Callable[[], object]) -> bool:
        key = f"stored {uri}"
        with self._write("storing a feed") as cur:
            cur.execute("INSERT INTO feeds (run_id, uri, base_size) VALUES (%s, %s, -1)"
                        " ON CONFLICT DO NOTHING", (run_id, key))
            (stored,) = cur.execute("SELECT base_size FROM feeds WHERE run_id = %s AND uri = %s"
                                    " FOR UPDATE", (run_id, key)).fetchone() or (-1,)
            if stored > level:
                return False
            cur.execute("UPDATE feeds SET base_size = %s WHERE run_id = %s AND uri = %s",
                        (level, run_id, key))
            replace()
        return True

    @staticmethod
    def _rejects_filter(run_id: int | None, pending_only: bool) -> tuple[str, list[Any]]:
        where, params = ["true"], []
        if run_id is not None:
            where.append("j.run_id = %s")
            params.append(run_id)
        if pending_only:
            where.append("j.retried_at IS NULL")
        return " AND ".join(where), params

    def rejects(self, *, run_id: int | None = None, pending_only: bool = False,
                limit: int | None = None) -> list[RejectedItem]:
        where, params = self._rejects_filter(run_id, pending_only)
        return [RejectedItem(*row) for row in self._read(
            "SELECT j.id, j.item_type, j.reason, j.data, j.request_key,"
            " coalesce(j.page_url, r.url) AS page_url, j.created_at, j.run_id, j.retried_at,"
            " r.state AS page_state FROM rejects j LEFT JOIN requests r ON r.key = j.request_key"
            f" WHERE {where} ORDER BY j.created_at DESC, j.id DESC LIMIT %s", (*params, limit))]

    def count_rejects(self, *, run_id: int | None = None, pending_only: bool = False) -> int:
        where, params = self._rejects_filter(run_id, pending_only)
        return int(self._one(f"SELECT count(*) FROM rejects j WHERE {where}", params)[0])

    def retry_rejects(self) -> RejectsRetried:
        now = self.clock()
        with self._write("putting rejected pages back") as cur:
            last = cur.execute(
                "SELECT run_id, finished_at FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
            if last is None:
                return RejectsRetried(pages=0, rejects=0, without_page=0, run_id=None,
                                      reopened=False)
            cur.execute(
                "UPDATE requests SET state = 'pending', worker = NULL, leased_until = NULL,"
                " attempts = 0, replays = 0, unfinished = 0, finished_at = NULL,"
                " error_kind = NULL, error_message = NULL WHERE key IN"
                " (SELECT request_key FROM rejects WHERE run_id = %s AND retried_at IS NULL)"
                " AND state IN ('done', 'failed', 'redirected')", (last[0],))
            pages = cur.rowcount
            cur.execute("UPDATE rejects SET retried_at = %s WHERE run_id = %s"
                        " AND retried_at IS NULL AND request_key IN"
                        " (SELECT key FROM requests WHERE state IN ('pending', 'leased'))",
                        (now, last[0]))
            marked = cur.rowcount
            (without,) = cur.execute(
                "SELECT count(*) FROM rejects WHERE run_id = %s AND retried_at IS NULL",
                (last[0],)).fetchone() or (0,)
            self._reopen(cur, bool(pages))
        return RejectsRetried(pages=pages, rejects=marked, without_page=int(without),
                              run_id=last[0], reopened=bool(pages and last[1] is not None))

    # -- migration --------------------------------------------------------------------------

    def load(self, batches: Iterator[tuple[str, list[dict[str, object]]]]) -> dict[str, int]:
        """See :meth:`.FrontierStore.load`: rows are copied with ``COPY`` in one transaction;
        ids are kept (the claim order depends on them) and the identity sequences moved past
        them; each run's counters become one session row of worker ``migrated``."""
        written: dict[str, int] = {}
        runs: list[dict[str, object]] = []
        with self._write("loading", repeatable=False) as cur:
            (busy,) = cur.execute(
                "SELECT EXISTS (SELECT 1 FROM runs) OR EXISTS (SELECT 1 FROM requests)"
                " OR EXISTS (SELECT 1 FROM records)").fetchone() or (True,)
            if busy:
                raise StoreError(
                    f"schema {self.schema} of {self.shown_url} already holds a crawl (runs, "
                    "requests or records): a crawl is migrated into an empty one only")
            for table, rows in batches:
                if table == "meta":
                    cur.executemany(
                        "INSERT INTO meta VALUES (%s, %s) ON CONFLICT (key) DO UPDATE"
                        " SET value = EXCLUDED.value",
                        [(r["key"], r["value"]) for r in rows
                         if r["key"] not in ("application", "schema_version")])
                elif table == "runs":
                    runs.extend(rows)
                    self._copy(cur, "runs", ("run_id", "started_at", "finished_at", "reason"),
                               rows)
                elif table == "sessions":
                    for row in rows:
                        row["heartbeat_at"] = row["started_at"]
                    self._copy(cur, "sessions", ("session_id", "run_id", "worker", "started_at",
                                                 "ended_at", "reason", "heartbeat_at"), rows)
                elif table == "requests":
                    for row in rows:
                        row["is_start"], row["fifo"] = bool(row["is_start"]), bool(row["fifo"])
                        if row["state"] == "leased":  # leases do not move
                            row.update(state="pending", worker=None, leased_until=None)
                    self._copy(cur, "requests", _LOADED["requests"], rows)
                elif table in _LOADED:
                    self._copy(cur, table, _LOADED[table], rows)
                else:
                    raise StoreError(f"cannot load rows of an unknown table {table!r}")
                written[table] = written.get(table, 0) + len(rows)
            for table, column in (("runs", "run_id"), ("sessions", "session_id"),
                                  ("requests", "id"), ("rejects", "id"), ("outbox", "id")):
                cur.execute(f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'),"
                            f" greatest((SELECT max({column}) FROM {table}), 1))")
            cur.execute("SELECT setval('records_seen_seq',"
                        " greatest((SELECT max(seen_seq) FROM records), 1))")
            cur.executemany(
                "INSERT INTO sessions (run_id, worker, started_at, ended_at, reason,"
                " heartbeat_at, " + ", ".join(_COUNTERS) + ") VALUES (%s, 'migrated', %s, %s,"
                " 'migrated', %s, " + ", ".join("%s" for _ in _COUNTERS) + ")",
                [(r["run_id"], r["started_at"], r["finished_at"] or r["started_at"],
                  r["started_at"], *(r.get(c) or 0 for c in _COUNTERS)) for r in runs])
        return written

    @staticmethod
    def _copy(cur: psycopg.Cursor[Any], table: str, columns: Sequence[str],
              rows: list[dict[str, object]]) -> None:
        if not rows:
            return
        with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(tuple(row.get(column) for column in columns))

    def integrity_check(self) -> IntegrityReport:
        """PostgreSQL has no whole-database check without extensions: the tables of the
        schema are all there and every index of theirs is valid, else what is wrong."""
        problems = [f"missing table {name}" for name in
                    sorted(_TABLES[SCHEMA_VERSION] - self._tables(self.schema))]
        problems += [f"index {name} is not valid (rebuild it: REINDEX INDEX {name})"
                     for (name,) in self._read(
                         "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                         " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s"
                         " AND NOT (i.indisvalid AND i.indisready)", (self.schema,))]
        return IntegrityReport(method="tables and index validity", problems=tuple(problems))

    def anomalies(self) -> dict[str, int]:
        return {name: int(self._one(sql)[0]) for name, sql in anomaly_checks().items()}
