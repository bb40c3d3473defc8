"""SQLite's own operator queries, for the ``scrapy idempotent`` commands:
:class:`SQLiteOperatorQueries` (mixed into :class:`~.sqlite.SQLiteStore`) opens an existing
database for them, reads its runs and engine settings, dumps its tables, freezes it for a
consistent copy and marks it migrated (``migrate``), and checks its integrity."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..exceptions import StoreError
from .base import CrawlIdentity, FrontierStore
from .reads import EngineSetting, IntegrityReport, RunSummary, SchemaInfo
from .sqlite_schema import SCHEMA_VERSION

__all__ = ["SQLiteOperatorQueries"]


class SQLiteOperatorQueries:
    """The operator queries only the SQLite store has (a mixin of ``SQLiteStore``)."""

    if TYPE_CHECKING:  # SQLiteStore's
        path: str
        busy_timeout_seconds: float
        DUMP_TABLES = FrontierStore.DUMP_TABLES
        _conn: sqlite3.Connection | None
        _migrated_mark: bool

        @property
        def conn(self) -> sqlite3.Connection: ...
        def _error(self, exc: sqlite3.Error, doing: str) -> StoreError: ...
        def _check_ownership(self, conn: sqlite3.Connection) -> tuple[int, bool]: ...
        @staticmethod
        def _stored_identity(conn: sqlite3.Connection | sqlite3.Cursor) -> dict[str, str]: ...
        def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None: ...
        def _live_sessions(self, conn: sqlite3.Connection) -> list[str]: ...
        def _write(self, doing: str = "writing"
                   ) -> contextlib.AbstractContextManager[sqlite3.Cursor]: ...

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

    def runs(self) -> list[RunSummary]:
        return [RunSummary(*row) for row in self.conn.execute(
            "SELECT run_id, started_at, finished_at, reason, leased, done, failed, redirected,"
            " records_inserted, records_updated, records_unchanged, coalesce(j.rejects, 0),"
            " records_stale, leases_reclaimed, leases_lost"
            " FROM runs LEFT JOIN (SELECT run_id, count(*) AS rejects FROM rejects"
            " GROUP BY run_id) AS j USING (run_id) ORDER BY run_id")]

    def dump(self, batch: int = 1000) -> Iterator[tuple[str, list[dict[str, object]]]]:
        # keyset paging on each table's key: one statement per batch
        keys = {"meta": "key", "runs": "run_id", "sessions": "session_id", "requests": "id",
                "records": "record_id", "rejects": "id", "feeds": "rowid",
                "responses": "key", "outbox": "id", "samples": "rowid",
                "record_keys": "record_type", "robots": "netloc", "page_validators": "key",
                "linked_requests": "key"}
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
        self._migrated_mark = False
        try:
            yield
            if self._migrated_mark:
                conn.execute("COMMIT")  # the mark only: the copy is in its target
        except sqlite3.Error as exc:
            raise self._error(exc, "marking the database migrated") from exc
        finally:
            self._migrated_mark = False
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")  # nothing was written: the lock is let go

    def mark_migrated(self, to: str) -> bool:
        self.conn.execute("INSERT INTO meta (key, value) VALUES ('migrated_to', ?)"
                          " ON CONFLICT (key) DO UPDATE SET value = excluded.value", (to,))
        self._migrated_mark = True
        return True

    def unmark_migrated(self) -> str | None:
        with self._write("forgetting the migration") as cur:
            row = cur.execute("SELECT value FROM meta WHERE key = 'migrated_to'").fetchone()
            cur.execute("DELETE FROM meta WHERE key = 'migrated_to'")
        return None if row is None else str(row[0])

    def _check_not_migrated(self, conn: sqlite3.Connection) -> None:
        """Refuse a crawl of a database ``migrate`` copied elsewhere (read-only, before any
        write): two copies of the crawl would diverge."""
        try:
            row = conn.execute("SELECT value FROM meta WHERE key = 'migrated_to'").fetchone()
        except sqlite3.OperationalError:  # no meta table yet (schema 0)
            return
        if row is not None:
            raise StoreError(
                f"{self.path} was migrated to {row[0]} by `scrapy idempotent migrate`: a "
                "crawl here would make a second copy of the crawl that diverges from it; it "
                f"was left untouched: set IDEMPOTENT_DATABASE to {row[0]} to continue the "
                f"crawl there, or run `scrapy idempotent migrate --undo --db {self.path}` to "
                "crawl this file again")

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
