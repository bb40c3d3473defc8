"""The PostgreSQL store's connections (see the module docstring of :mod:`.postgresql`,
**Connections** and **Times**): :class:`PostgreSQLConnections` (mixed into
:class:`~.postgresql.PostgreSQLStore`) opens one connection per thread and checks the server,
measures the server's clock, reopens a lost connection (on a thread of its own,
:class:`_Reconnecting`, for a thread that never waits), translates psycopg's errors, and
gives the store its write transaction (plain or pipelined, :class:`_StatementCursors`) and
its reads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..exceptions import StoreBusy, StoreError
from .base import observation_clock

if TYPE_CHECKING:
    import psycopg

__all__ = ["MIN_SERVER_VERSION", "PostgreSQLConnections", "check_server_version"]

logger = logging.getLogger("scrapy_idempotent.store.postgresql")

#: The oldest PostgreSQL server the store works with (``server_version_num``).
MIN_SERVER_VERSION = 140000
#: a read asked on a thread that never waits (the reactor's) is made by the store's reader
#: thread and answered within this many seconds, or StoreBusy: a server that stops answering
#: without closing the connection (a paused machine, packets dropped) holds that thread, not
#: the reactor; while it is held, such reads are StoreBusy at once
READ_DEADLINE_SECONDS = 2.0
#: id(connection) -> (pid, start time) of its server process
conn_backends: dict[int, tuple[int, Any]] = {}
#: round trips that measure this process's clock against the server's at each connection;
#: the quickest decides, and one of at most OFFSET_GOOD_ROUND_TRIP seconds ends the measure
OFFSET_ROUND_TRIPS = 5
OFFSET_GOOD_ROUND_TRIP = 0.002


def clock_offset(samples: Iterable[tuple[float, float, float]]) -> float:
    """The server's clock minus this process's, from ``(sent, server, received)`` round
    trips (this process's clock when the question left and when the answer came, the
    server's in between): the quickest round trip's, its server time against the trip's
    midpoint. A trip is off by at most half its length, and a slow one (the process or the
    server descheduled on a loaded machine: hundreds of milliseconds) would put every time
    this process compares with the server's off by as much: a claim would take a site whose
    pause another worker wrote before the pause ends."""
    sent, server, received = min(samples, key=lambda sample: sample[2] - sample[0])
    return server - (sent + received) / 2


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


class _CommitOutcomeUnknown(StoreError):
    """The connection was lost during COMMIT: the transaction may or may not have happened."""


class _StatementCursors:
    """The cursor of a pipelined transaction (:meth:`PostgreSQLStore._pipelined`): each
    statement is sent on a cursor of its own. psycopg attaches an answer to the cursor that
    sent its statement whenever it arrives; once the server has flushed answers early (a
    large one fills its output buffer), an earlier statement's answer can arrive while the
    same cursor sends the next statement, and that statement's fetch then reads it (the
    claim's rows read as the journal insert's "INSERT 0 1", or as another statement's rows).
    A cursor that sent one statement only can only hold that statement's answer."""

    __slots__ = ("connection",)

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self.connection = connection

    def execute(self, query: Any, params: Any = None, **options: Any) -> psycopg.Cursor[Any]:
        return self.connection.cursor().execute(query, params, **options)

    def executemany(self, query: Any, params_seq: Any, **options: Any) -> None:
        self.connection.cursor().executemany(query, params_seq, **options)


class _Reconnecting:
    """A lost connection being reopened on a thread of its own, for a thread that must not
    wait for it (:meth:`PostgreSQLStore.never_wait_here`): tried again, backing off up to
    1 s, while the server refuses or is not ready (:class:`~.StoreBusy`), until it answers,
    an error that a retry cannot cure comes (kept in :attr:`error`), or :meth:`stop`."""

    def __init__(self, store: PostgreSQLConnections) -> None:
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


class PostgreSQLConnections:
    """This thread's connection, the write transaction and the reads (a mixin of
    ``PostgreSQLStore``, whose constructor sets the attributes below)."""

    url: str
    shown_url: str
    schema: str
    synchronous: str
    busy_timeout_seconds: float
    transactions: int
    _fixed_clock: Callable[[], float] | None
    _observed_offset: float
    _connected_since: float
    _local: threading.local
    _lock: threading.Lock
    _opened: bool
    _connections: list[psycopg.Connection[Any]]
    _orphans: list[tuple[int, Any]]
    _reader: concurrent.futures.ThreadPoolExecutor | None
    _reading: concurrent.futures.Future[list[Any]] | None
    _reconnecting: _Reconnecting | None

    # -- connections ------------------------------------------------------------------------

    def clock(self) -> float:
        """Unix seconds: the injected clock, or the database server's (see the class)."""
        if self._fixed_clock is not None:
            return self._fixed_clock()
        return observation_clock() + self._observed_offset

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
        # a str parameter is sent as text, not as a literal of unknown type: compared with
        # or written to a bytea key column (postgresql_schema, step 22) it is an error, where
        # PostgreSQL would read hex digits of unknown type as escape-format bytea (their
        # ASCII bytes: another key, silently); key parameters are bytes (SqlDialect._key)
        from psycopg.types.string import StrDumper

        conn.adapters.register_dumper(str, StrDumper)
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
            if self._fixed_clock is None:
                self._observed_offset = clock_offset(self._round_trips(conn))
            self._connected_since = self.clock()  # (again) after a break: see reclaim_expired
        except psycopg.Error as exc:
            conn.close()
            raise self._error(exc, "opening") from exc
        with self._lock:
            self._connections.append(conn)
        return conn

    @staticmethod
    def _round_trips(conn: psycopg.Connection[Any]) -> Iterator[tuple[float, float, float]]:
        """Up to :data:`OFFSET_ROUND_TRIPS` round trips reading the server's clock (see
        :func:`clock_offset`), fewer once one is quick."""
        for _ in range(OFFSET_ROUND_TRIPS):
            sent = observation_clock()
            (server,) = conn.execute(
                "SELECT extract(epoch FROM clock_timestamp())::float8").fetchone() or (0,)
            received = observation_clock()
            yield sent, float(server), received
            if received - sent <= OFFSET_GOOD_ROUND_TRIP:
                return

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

    def _drop_if_in_transaction(self) -> None:
        """After a failed transaction: if its ROLLBACK failed too (cancelled by a short
        statement_timeout on a starved server), the connection is still in the failed
        transaction; it is dropped rather than handed to the next statement."""
        from psycopg.pq import TransactionStatus

        conn = getattr(self._local, "conn", None)
        if (conn is not None and not conn.closed and not conn.broken
                and conn.info.transaction_status != TransactionStatus.IDLE):
            self._drop(conn)

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
            self._drop_if_in_transaction()
            if isinstance(error, _CommitOutcomeUnknown) and repeatable:
                raise StoreBusy(f"{error}; it is repeated (doing it twice is the same as "
                                "once)") from exc
            raise error from exc
        self.transactions += 1

    @contextlib.contextmanager
    def _pipelined(self, doing: str) -> Iterator[_StatementCursors]:
        """:meth:`_write` in psycopg's pipeline mode, for the page commit (not repeatable:
        a connection lost during COMMIT raises :class:`_CommitOutcomeUnknown`).

        Statements are sent without waiting for their answers; the client waits only where
        it reads one (a fetch) and once at the end for COMMIT's. They still run one after
        the other, in the order sent, in the one transaction; an error in any of them fails
        the transaction, raised at the next wait at the latest, and the transaction is
        rolled back. Each statement goes on a cursor of its own (see
        :class:`_StatementCursors`)."""
        import psycopg
        from psycopg.pq import TransactionStatus

        committing = False
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = self.conn
            # BEGIN and COMMIT as statements: psycopg's transaction() would wait for the
            # server after BEGIN and twice at its end
            with conn.pipeline():
                cur = _StatementCursors(conn)
                cur.execute("BEGIN")
                yield cur
                committing = True  # from here on the server may have committed
                cur.execute("COMMIT")
        except BaseException as exc:
            if conn is not None and not conn.closed and not conn.broken:
                with contextlib.suppress(psycopg.Error):
                    if conn.info.transaction_status != TransactionStatus.IDLE:
                        conn.execute("ROLLBACK")
            error = (self._error(exc, doing, committing=committing)
                     if isinstance(exc, psycopg.Error) else None)
            self._drop_if_in_transaction()
            if error is not None:
                raise error from exc
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
