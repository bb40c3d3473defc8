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
* **Times** are the database server's clock: this process's monotonic clock plus its offset
  from the server's ``clock_timestamp()``, measured at each connection. Workers on hosts whose
  clocks disagree (by any amount) still agree on lease expiry, heartbeats, slot delays and
  pauses, and a wall clock stepped while a worker runs (an NTP step) moves none of them: the
  error is the measurement's, at most half a round trip to the server, plus the drift of the
  monotonic clock between connections (NTP slews it with the wall clock).
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
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote, urlsplit, urlunsplit

from ..exceptions import StoreBusy, StoreError
from .base import (
    CommitResult,
    Completion,
    CrawlIdentity,
    NewRequest,
    RunInfo,
    RunMode,
    UnitOfWork,
    observation_clock,
)
from .postgresql_connection import (
    MIN_SERVER_VERSION,
    _CommitOutcomeUnknown,
    _Reconnecting,
    check_server_version,
    conn_backends,
)
from .postgresql_heartbeat import PostgreSQLHeartbeat
from .postgresql_listen import WorkListener
from .postgresql_operator import PostgreSQLOperatorQueries
from .postgresql_schema import (
    APPLICATION,
    COUNTERS,
    MIGRATIONS,
    SCHEMA_VERSION,
    TABLES,
    key_bytes,
    schema_for,
)
from .registry import redacted
from .rules import (
    QUEUE_ORDER_BACKWARD,
    claimed_columns,
    isolate_after,
    other_owner,
)
from .sql import SqlStore
from .sql_dialect import RECORD_STATE

if TYPE_CHECKING:
    import psycopg

__all__ = ["MIN_SERVER_VERSION", "SCHEMA_VERSION", "PostgreSQLStore", "check_server_version",
           "schema_for"]

logger = logging.getLogger(__name__)

#: Page commits that add requests send at most one notification per this many seconds.
NOTIFY_INTERVAL_SECONDS = 0.25
#: Workers whose latest heartbeat (over their sessions not ended) is older than a bound.
_DEAD_WORKERS = ("SELECT worker FROM sessions WHERE ended_at IS NULL GROUP BY worker"
                 " HAVING max(heartbeat_at) < %s")
#: The URL query parameter naming the schema (removed before the URL reaches libpq).
SCHEMA_PARAMETER = "schema"
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _stored_fingerprint(request: NewRequest) -> str | None:
    """The ``fingerprint`` column of ``request``'s row: NULL where it is the key (all but
    ``dont_filter`` requests); readers take the key then."""
    return None if request.fingerprint == request.key else request.fingerprint


def _split_url(url: str) -> tuple[str, str | None]:
    """``url`` without the package's own query parameter, and that parameter's value."""
    parts = urlsplit(url)
    # the other parameters are handed to libpq as written (libpq decodes %XX, not "+")
    pieces = [piece for piece in parts.query.split("&") if piece]
    ours = [piece for piece in pieces if unquote(piece.partition("=")[0]) == SCHEMA_PARAMETER]
    schema = unquote(ours[0].partition("=")[2]) if ours else None
    rest = "&".join(piece for piece in pieces if piece not in ours)
    return urlunsplit(parts._replace(query=rest)), schema


class PostgreSQLStore(PostgreSQLHeartbeat, PostgreSQLOperatorQueries, SqlStore):
    """The :class:`~.FrontierStore` on a PostgreSQL database (see the module docstring).

    :param url: ``postgresql://`` or ``postgres://`` URL (libpq's URI syntax), optionally with
        ``?schema=NAME``.
    :param lease_seconds: how long a claim lasts unless renewed.
    :param max_attempts: as on SQLite: a request started this many times without finishing
        is failed as ``quarantined``.
    :param clock: unix seconds; injected by tests. Default: the database server's clock, as
        this process's monotonic clock plus its offset from the server's, measured at each
        connection (a stepped wall clock does not move it).
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
        #: the server's clock minus this process's observation clock (which a stepped wall
        #: clock does not move), in seconds: the store's clock, and workers' observation
        #: times put on the server's clock (until the first connection: this host's clock)
        self._observed_offset = 0.0 if clock is not None else time.time() - observation_clock()
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
        self._listener: WorkListener | None = None
        self._notified_at = -NOTIFY_INTERVAL_SECONDS
        self._worker: str | None = None  #: the worker of this store's session
        #: when this store last (re)connected, store clock: heartbeats are judged only after
        #: a bound from then (see reclaim_expired)
        self._connected_since = float("inf")
        #: (first, latest) end time of this session's series of heartbeats written with no
        #: gap longer than two heartbeat periods (see _judges); None: none since a failure
        self._beats: tuple[float, float] | None = None
        self._beat_thread: threading.Thread | None = None
        #: the thread reopening the connection of a thread that never waits, if any
        self._reconnecting: _Reconnecting | None = None

    # -- connections ------------------------------------------------------------------------

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

    # -- schema and ownership ---------------------------------------------------------------

    def open(self, *, fingerprinter: str = "", identity: CrawlIdentity | None = None,
             record_id_scheme: str | None = None) -> str | None:
        if self.requested_schema is None:
            self.schema = schema_for(identity)
        self._opened = True
        try:
            stored = self._open(fingerprinter, identity, record_id_scheme)
        except BaseException:
            self.close()
            raise
        return stored if stored != fingerprinter else None

    def _open(self, fingerprinter: str, identity: CrawlIdentity | None,
              record_id_scheme: str | None) -> str:
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
                for statement in MIGRATIONS[step]:
                    cur.execute(statement)
                cur.execute(
                    "INSERT INTO meta VALUES ('application', %s), ('schema_version', %s)"
                    " ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
                    (APPLICATION, str(step + 1)))
                cur.execute(f"COMMENT ON SCHEMA \"{self.schema}\" IS "
                            "'scrapy_idempotent frontier and records'")
        with self._write("opening") as cur:
            return self._claim_meta(cur, fingerprinter, identity, record_id_scheme,
                                    f"schema {self.schema} of {self.shown_url}")

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
        found and whether the schema is new (absent or empty); a migration committed between
        the reads (steps only add tables) leaves the tables seen a subset: never refused."""
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
        if ours and tables <= TABLES[version]:
            return version, False
        shown = ", ".join(sorted(tables)[:8])
        raise StoreError(
            f"schema {self.schema} of {self.shown_url} is not a scrapy_idempotent frontier "
            f"(tables: {shown}); it was left untouched: name another schema with "
            "?schema=NAME in IDEMPOTENT_DATABASE")

    def _stored_identity(self) -> dict[str, str]:
        if "meta" not in self._tables(self.schema):
            return {}
        return dict(self._read(
            "SELECT key, value FROM meta WHERE key IN ('project', 'spider', 'source')"))

    def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None:
        owner = other_owner(stored, identity)
        if owner is None:
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
            run_id, new = self._start_run(cur, run_mode, now)
            (self.session_id,) = cur.execute(
                "INSERT INTO sessions (run_id, worker, started_at, heartbeat_at)"
                " VALUES (%s, %s, %s, %s) RETURNING session_id",
                (run_id, worker, now, now)).fetchone() or (None,)
        self.run_id = run_id
        self._worker = worker
        self._beats = None
        self._beaten(now)  # the session's first heartbeat
        self._start_heartbeat()
        return RunInfo(run_id=self.run_id, new=new, counts=self.counts())

    def end_session(self, worker: str, reason: str, inflight: Sequence[str] = (), *,
                    finish_run: bool = True) -> int:
        self._stop_heartbeat()
        return super().end_session(worker, reason, inflight, finish_run=finish_run)

    def _lock_runs(self, cur: Any) -> None:
        self._lock_schema(cur)  # two workers starting at once start one run

    def _lock_frontier(self, cur: Any) -> None:
        # first, before any row lock: waits for the page commits in progress (they hold ROW
        # EXCLUSIVE), so a child request another worker is inserting right now is seen; and
        # closes of other workers wait for this one
        cur.execute("LOCK TABLE requests IN SHARE ROW EXCLUSIVE MODE")

    def _empty(self, cur: Any, *tables: str) -> None:
        # no dead rows left behind (TRUNCATE is transactional)
        cur.execute(f"TRUNCATE {', '.join(tables)}")

    # -- the unit of work -------------------------------------------------------------------

    _SESSION_STATE = ("run_id", "session_id")

    def _join_run(self, cur: Any, worker: str, run_id: int, now: float) -> None:
        cur.execute("UPDATE sessions SET ended_at = %s, reason = 'next run'"
                    " WHERE session_id = %s", (now, self.session_id))
        (self.session_id,) = cur.execute(
            "INSERT INTO sessions (run_id, worker, started_at, heartbeat_at)"
            " VALUES (%s, %s, %s, %s) RETURNING session_id",
            (run_id, worker, now, now)).fetchone() or (None,)
        self.run_id = run_id

    def _commit_unit(self, work: UnitOfWork, worker: str, run_id: int, now: float,
                     result: CommitResult) -> None:
        number = next(self._commit_numbers)
        try:
            self._commit(work, worker, run_id, now, result, number)
        except _CommitOutcomeUnknown as exc:
            if not self._committed(number):
                raise StoreBusy(f"{exc}; it was not: it is retried") from exc
            logger.info("scrapy_idempotent: %s; it was, and is not repeated", exc)

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
        known entries (one wait), the records, the results of every write and the claim (one
        wait), COMMIT."""
        with self._pipelined("committing") as cur:
            self._write_unit(cur, work, worker, run_id, now, result, number)

    # -- the dialect (see SqlStore) ---------------------------------------------------------

    LOCK_ROWS = " FOR UPDATE"
    SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"
    SKIP_LOCKED_SLOTS = " FOR UPDATE OF s SKIP LOCKED"
    TEXT_ORDER = ' COLLATE "C"'
    # the pending indexes hold the queue reversed (postgresql_schema, step 16), the
    # start flag folded into the order (step 19)
    PENDING_ORDER = QUEUE_ORDER_BACKWARD
    # the primary key (postgresql_schema, step 18: `id` has no index)
    REQUEST_ROW = "key"
    # the slot's pending index holds the slot's hash, not its text (postgresql_schema, step
    # 19): the hash finds the entries, the slot itself keeps out those of another slot of the
    # same hash (they lie among them)
    OF_SLOT = "hashtext({r}slot) = hashtext({slot}) AND {r}slot = {slot}"
    # Every slot's pending requests counted in one pass over them: that index holds no slot
    # to count (an index-only scan cannot read an expression's column), so counting a slot
    # there reads its rows, every page of the frontier once per slot.
    SLOT_PENDING = "coalesce(p.pending, 0)"
    SLOT_PENDING_JOIN = (" LEFT JOIN (SELECT slot, count(*) AS pending FROM requests"
                         " WHERE state = 'pending' GROUP BY slot) p ON p.slot = s.slot")
    SLOT_READY_AT = "greatest(s.next_send_at, s.paused_until)"
    # Not as two equalities: the planner would take the leased requests' index (worker,
    # leased_until) for them, scanning every entry the worker's past leases left there (a
    # bitmap scan does not mark dead entries), growing to a millisecond a statement
    # between autovacuum passes; no index serves this form, so the keys' index decides.
    LEASED_BY = "(state, worker) IS NOT DISTINCT FROM ('leased', ?)"
    NO_LIMIT = None
    URL_ONCE = True
    PACKED_COLUMN = "packed"
    # one value for packed rows and the others: bytes (the text as UTF-8: see _request_data)
    DATA_READ = "coalesce({r}packed, convert_to({r}data, 'UTF8'))"
    DATA_SET = "data = ?, packed = ?"
    # the requests' key columns hold the keys' bytes (postgresql_schema, step 22)
    KEY_TYPE = "bytea"
    KEY_TEXT = "encode({c}, 'hex')"
    # (text that is not a key's hex digits is no request's key: NULL, no match)
    KEY_OF_TEXT = "CASE WHEN {c} ~ '^([0-9a-f]{{2}})+$' THEN decode({c}, 'hex') END"

    def _key(self, key: str | None) -> bytes | None:
        return None if key is None else key_bytes(key)

    def _key_read(self, value: Any) -> str | None:
        return None if value is None else bytes(value).hex()

    def _q(self, sql: str) -> str:
        return sql.replace("?", "%s")

    def _select(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return self._read(self._q(sql), params)

    def _lookup(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        return list(cur.execute(self._q(sql), params, prepare=False).fetchall())  # planned now

    def _any(self, column: str, values: Collection[Any], *,
             sql_type: str = "text") -> tuple[str, Any]:
        # binary parameters: text arrays are not quoted element by element
        mark = "%b" if sql_type == "text" and values else "?"
        return f"{column} = ANY({mark}::{sql_type}[])", list(values)

    def _send(self, cur: Any, sql: str, params: Sequence[Any] = ()) -> Callable[[], list[Any]]:
        # (a cursor of its own: see _StatementCursors)
        return cur.execute(self._q(sql), params).fetchall  # type: ignore[no-any-return]

    def _insert_records(self, cur: Any, rows: list[tuple[Any, ...]], now: float,
                        run_id: int) -> set[str]:
        # one statement for the unit's new records, inserted in record ID order
        columns = list(zip(*rows, strict=True))
        return {rid for (rid,) in cur.execute(
            "INSERT INTO records (record_id, source, natural_key, item_type, data,"
            " content_hash, first_seen, last_changed, first_run_id, changed_run_id,"
            " request_key, seen_run_id, seen_at, seen_seq, observed_at, version)"
            " SELECT r, s, k, t, d, h, %s, %s, %s, %s, q, %s, %s, n, o, 1 FROM unnest("
            "%b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::text[],"
            " %s::text[], %s::bigint[], %s::float8[]) AS u(r, s, k, t, d, h, q, n, o)"
            " ORDER BY r COLLATE \"C\" ON CONFLICT (record_id) DO NOTHING RETURNING record_id",
            (now, now, run_id, run_id, run_id, now, *map(list, columns))).fetchall()}

    def _send_finishes(self, cur: Any, finishing: list[Completion], worker: str,
                       now: float) -> Callable[[], list[Any]]:
        # one statement for the unit's terminal completions and their journal entries (the
        # rows are locked already: the fence); a response is deleted only where the update
        # ended its lease. The journal's rows are found by their key's index: the keys are
        # compared in the journal's collation (in the requests' "C" collation that index
        # cannot serve, and each commit read the whole journal table). "Leased by this
        # worker" is LEASED_BY's form (see there), on the alias ``r``: ``u`` has a state too
        return self._send(
            cur, "WITH ended AS (UPDATE requests r SET state = u.state, worker = NULL,"
            " leased_until = NULL, unfinished = 0, finished_at = %s, error_kind = u.kind,"
            " error_message = u.message FROM unnest(%b::bytea[], %b::text[], %s::text[],"
            " %s::text[]) AS u(key, state, kind, message)"
            " WHERE r.key = u.key AND (r.state, r.worker) IS NOT DISTINCT FROM ('leased', %s)"
            " RETURNING r.key),"
            " journal AS (DELETE FROM responses"
            f"  WHERE key = ANY(ARRAY(SELECT {self.KEY_TEXT.format(c='key')} FROM ended)))"
            " SELECT key FROM ended",
            (now, self._keys([d.key for d in finishing]), [d.state.value for d in finishing],
             [d.error_kind for d in finishing], [d.error_message for d in finishing], worker))

    def _observation_offset(self) -> float:
        # a worker's observation is put on the server's clock, as every other time of this
        # store, so hosts whose clocks disagree still order their observations rightly
        return self._observed_offset

    def _claim_rows(self, cur: Any, worker: str, count: int, until: float) -> list[Any]:
        rows: list[Any] = cur.execute(
            # the rows locked are found again by their primary key (REQUEST_ROW), not by
            # ctid: a row that an update committed after this statement's snapshot moved is
            # locked in its new version, which the snapshot does not see at that ctid (the
            # join by key updates it)
            f"WITH head AS (SELECT {self.REQUEST_ROW} FROM requests WHERE state = 'pending'"
            f" ORDER BY {self.PENDING_ORDER} LIMIT %s FOR UPDATE SKIP LOCKED)"
            " UPDATE requests r SET state = 'leased', worker = %s, leased_until = %s,"
            " attempts = r.attempts + 1"
            f" FROM head WHERE r.{self.REQUEST_ROW} = head.{self.REQUEST_ROW}"
            " RETURNING " + claimed_columns("r", self.DATA_READ),
            (count, worker, until)).fetchall()
        return rows

    def _send_insert(self, cur: Any, new: list[NewRequest], now: float,
                     run_id: int) -> Callable[[], int]:
        """Insert ``new`` in one statement; a key another worker inserted meanwhile is a
        duplicate (the unique index decides).

        The ids (the claim order depends on them) are taken in the order given, but the rows
        go into the table in key order: two page commits inserting the same keys take the
        unique index's locks in one order, so one waits for the other instead of both
        deadlocking."""
        data = [self._stored_data(r.data, r.url) for r in new]  # (text, packed) each
        inserting = cur.execute(  # (a cursor of its own: see _StatementCursors)
            "WITH given AS (SELECT nextval('requests_id_seq') AS id, k, f, u, p, s, ff, d, pk,"
            "  sl, pd"
            # binary parameters: text arrays are not quoted element by element
            "  FROM unnest(%b::bytea[], %b::bytea[], %b::text[], %b::int[], %b::bool[],"
            "   %b::bool[], %b::text[], %b::bytea[], %b::text[], %b::bytea[])"
            "  WITH ORDINALITY AS t(k, f, u, p, s, ff, d, pk, sl, pd, n)"
            # nextval is evaluated after the sort: ids in the order given
            "  ORDER BY n)"
            " INSERT INTO requests (id, key, fingerprint, url, priority, is_start, fifo, state,"
            " data, parent_key, enqueued_at, run_id, slot, packed)"
            " SELECT id, k, f, u, p, s, ff, 'pending', d, pk, %s, %s, sl, pd FROM given"
            " ORDER BY k ON CONFLICT (key) DO NOTHING RETURNING key",
            (self._keys([r.key for r in new]), self._keys([_stored_fingerprint(r) for r in new]),
             [r.url for r in new],
             [r.priority for r in new], [r.is_start for r in new], [r.fifo for r in new],
             [stored[0] for stored in data], self._keys([r.parent_key for r in new]),
             [r.slot for r in new], [stored[1] for stored in data], now, run_id))
        return lambda: len(inserting.fetchall())

    def _read_records(self, cur: Any, run_id: int, count: int, record_ids: list[str]
                      ) -> tuple[float | None, list[int], list[Any]]:
        # One statement: the numbers of first sight from a sequence (no counter row to wait
        # on), taken in item order (the feeds' order); the newest change; and the stored
        # rows, locked in record ID order (a row each: the first carries the rest, a row of
        # NULLs when none is stored). Planned at each call (see _lookup).
        rows = self._lookup(
            cur, "WITH pre AS (SELECT (SELECT max(last_changed) FROM records) AS newest,"
            " ARRAY(SELECT nextval('records_seen_seq') FROM generate_series(1, ?)"
            "  ORDER BY 1) AS seqs)"
            f" SELECT pre.newest, pre.seqs, found.* FROM pre LEFT JOIN LATERAL (SELECT"
            f" {RECORD_STATE} FROM records WHERE record_id = ANY(%b::text[])"
            "  ORDER BY record_id FOR UPDATE) AS found ON true", (count, record_ids))
        return (rows[0][0], list(rows[0][1]),
                [row[2:] for row in rows if row[2] is not None])

    def _count(self, cur: Any, result: CommitResult, run_id: int, leased: int,
               number: int) -> None:
        """Add this transaction's work to this session's counters, and record its number
        (same transaction, one statement: one row per worker, so workers never wait on
        each other here)."""
        if self.session_id is None:
            return
        done = result.completed
        deltas = (leased, done.get("done", 0),
                  done.get("failed", 0) + len(result.quarantined), done.get("redirected", 0),
                  result.records_inserted, result.records_updated, result.records_unchanged,
                  result.records_stale, result.leases_lost)
        cur.execute(
            "UPDATE sessions SET " + ", ".join(f"{c} = {c} + %s" for c in COUNTERS)
            + ", last_commit = %s WHERE session_id = %s",
            (*deltas, number, self.session_id))

    # -- leases -----------------------------------------------------------------------------

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
        return [cast(str, self._key_read(key)) for (key,) in rows]

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
        call ``callback`` for each notification from another worker (several at once make
        one call); see :class:`WorkListener`."""
        if self._listener is None:
            self._listener = WorkListener(lambda: self._connect(set_path=False), self._drop,
                                          self.channel, self._worker or "", callback)
            self._listener.start()
        return True

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()

    def dead_workers(self) -> list[str]:
        """Workers whose session has not ended and whose heartbeat is older than
        :attr:`dead_after_seconds` (empty when sessions are never dead by heartbeat)."""
        if self.dead_after_seconds is None:
            return []
        return [worker for (worker,) in self._read(
            f"{_DEAD_WORKERS} ORDER BY worker", (self.clock() - self.dead_after_seconds,))]

    def _expired_leases(self, now: float) -> tuple[str, tuple[Any, ...]]:
        """Leases whose time is up, and every lease of another worker whose heartbeat is
        older than :attr:`dead_after_seconds` (dead, on whatever host); heartbeats are
        judged only while this worker's own go on (see :meth:`_judges`)."""
        judged = self._judges(now)
        dead_before = now - self.dead_after_seconds if judged and self.dead_after_seconds \
            else float("-inf")
        return (f"leased_until < %s OR (worker IN ({_DEAD_WORKERS})"
                " AND worker IS DISTINCT FROM %s)", (now, dead_before, self._worker))

    def _add_to_counter(self, cur: Any, column: str, count: int) -> None:
        if count and self.session_id is not None:
            cur.execute(f"UPDATE sessions SET {column} = {column} + %s WHERE session_id = %s",
                        (count, self.session_id))

    # -- the outbox --------------------------------------------------------------------------

    def reclaim_space(self, *, everything: bool = False) -> int:
        """PostgreSQL's autovacuum gives the space of dead rows back for reuse (tuned on the
        high-churn tables at creation); nothing to do here: 0."""
        return 0

    COUNTER_TABLE = "sessions"

    def heartbeats(self) -> dict[str, float]:
        return {w: float(at) for w, at in self._read(
            "SELECT worker, max(heartbeat_at) FROM sessions WHERE ended_at IS NULL"
            " GROUP BY worker ORDER BY worker")}

    def live_workers(self) -> list[str]:
        """Sessions not ended whose heartbeat is within the liveness bound (any host)."""
        return [w for (w,) in self._read(*self._live_sessions_query())]

    def _live_workers_in(self, cur: Any) -> list[str]:
        return [w for (w,) in cur.execute(*self._live_sessions_query()).fetchall()]

    def _live_sessions_query(self) -> tuple[str, tuple[float, ...]]:
        if self.dead_after_seconds is None:
            return ("SELECT DISTINCT worker FROM sessions WHERE ended_at IS NULL"
                    " ORDER BY worker", ())
        return ("SELECT DISTINCT worker FROM sessions WHERE ended_at IS NULL"
                " AND heartbeat_at >= %s ORDER BY worker",
                (self.clock() - self.dead_after_seconds,))
