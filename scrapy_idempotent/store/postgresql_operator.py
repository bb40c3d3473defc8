"""The PostgreSQL store's own operator queries, for the ``scrapy idempotent`` commands:
:class:`PostgreSQLOperatorQueries` (mixed into :class:`~.postgresql.PostgreSQLStore`) opens an
existing crawl's schema for them (the one crawl in the database when none is named), reads
its runs, loads a migrated crawl with ``COPY`` (``migrate``), and checks the schema's tables
and indexes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..exceptions import StoreError
from .base import CrawlIdentity
from .packing import unpack
from .postgresql_connection import PostgreSQLConnections
from .postgresql_schema import (
    ALL_COUNTERS,
    APPLICATION,
    LOADED,
    SCHEMA_VERSION,
    TABLES,
    schema_for,
)
from .reads import EngineSetting, IntegrityReport, RunSummary, SchemaInfo

if TYPE_CHECKING:
    import psycopg

__all__ = ["PostgreSQLOperatorQueries"]


class PostgreSQLOperatorQueries(PostgreSQLConnections):
    """The operator queries only the PostgreSQL store has (a mixin of ``PostgreSQLStore``)."""

    requested_schema: str | None

    if TYPE_CHECKING:  # PostgreSQLStore's
        def close(self) -> None: ...
        def _tables(self, schema: str) -> set[str]: ...
        def _check_ownership(self) -> tuple[int, bool]: ...
        def _stored_identity(self) -> dict[str, str]: ...
        def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None: ...
        def _key(self, key: str | None) -> bytes | None: ...
        def _stored_data(self, data: str, url: str | None) -> tuple[Any, ...]: ...

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

    def runs(self) -> list[RunSummary]:
        sums = ", ".join(f"coalesce(sum(s.{c}), 0)::bigint AS {c}" for c in ALL_COUNTERS)
        names = ("run_id", "started_at", "finished_at", "reason", *ALL_COUNTERS, "rejects")
        return [RunSummary(**dict(zip(names, row, strict=True))) for row in self._read(
            f"SELECT r.run_id, r.started_at, r.finished_at, r.reason, {sums},"
            " (SELECT count(*) FROM rejects j WHERE j.run_id = r.run_id) AS rejects"
            " FROM runs r LEFT JOIN sessions s ON s.run_id = r.run_id"
            " GROUP BY r.run_id ORDER BY r.run_id")]

    # -- migration --------------------------------------------------------------------------

    def load(self, batches: Iterator[tuple[str, list[dict[str, object]]]]) -> dict[str, int]:
        """See :meth:`.FrontierStore.load`: rows are copied with ``COPY`` in one transaction;
        ids are kept (the claim order depends on them) and the identity sequences moved past
        them; each run's counters become one session row of worker ``migrated``."""
        written: dict[str, int] = {}
        runs: list[dict[str, object]] = []
        # the highest request id copied: the table was empty and its id has no index (its
        # max() would read the whole table)
        top_request = 1
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
                         if r["key"] not in ("application", "schema_version",
                                             "frontier_id", "frontier_counts")])
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
                        row.setdefault("slot", "")
                        if row["fingerprint"] == row["key"]:  # stored only where it differs
                            row["fingerprint"] = None
                        # stored as a crawl stores it: a row of an older release holds its
                        # request whole (text), or packed whole (a BLOB)
                        url, data = str(row["url"]), row["data"]
                        row["data"], row["packed"] = self._stored_data(
                            data if isinstance(data, str)
                            else unpack(cast(bytes, data), url, str(row["key"])), url)
                        # the key columns as bytes (COPY would read text as escape-format
                        # bytea: its characters' bytes, another key), a non-hex key refused
                        for column in ("key", "fingerprint", "parent_key"):
                            if row.get(column) is not None:
                                row[column] = self._key(str(row[column]))
                        if row["state"] == "leased":  # leases do not move
                            row.update(state="pending", worker=None, leased_until=None)
                        top_request = max(top_request, int(str(row["id"])))
                    self._copy(cur, "requests", LOADED["requests"], rows)
                elif table == "linked_requests":
                    for row in rows:
                        row["filter_fingerprint"] = bool(row["filter_fingerprint"])
                        row["fifo"] = bool(row["fifo"])
                    self._copy(cur, table, LOADED[table], rows)
                elif table in LOADED:
                    self._copy(cur, table, LOADED[table], rows)
                else:
                    raise StoreError(f"cannot load rows of an unknown table {table!r}")
                written[table] = written.get(table, 0) + len(rows)
            cur.execute("SELECT setval(pg_get_serial_sequence('requests', 'id'), %s)",
                        (top_request,))
            for table, column in (("runs", "run_id"), ("sessions", "session_id"),
                                  ("rejects", "id"), ("outbox", "id")):
                cur.execute(f"SELECT setval(pg_get_serial_sequence('{table}', '{column}'),"
                            f" greatest((SELECT max({column}) FROM {table}), 1))")
            cur.execute("SELECT setval('records_seen_seq',"
                        " greatest((SELECT max(seen_seq) FROM records), 1))")
            # every slot of the requests gets its row (its limits: the first worker's), and
            # its flag of pending requests (the requests were copied before their slots had
            # rows to flag)
            cur.execute("INSERT INTO slots (slot, concurrency, has_pending)"
                        " SELECT slot, 1, bool_or(state = 'pending') FROM requests"
                        " GROUP BY slot ON CONFLICT (slot) DO UPDATE"
                        " SET has_pending = slots.has_pending OR excluded.has_pending")
            cur.executemany(
                "INSERT INTO sessions (run_id, worker, started_at, ended_at, reason,"
                " heartbeat_at, " + ", ".join(ALL_COUNTERS) + ") VALUES (%s, 'migrated', %s,"
                " %s, 'migrated', %s, " + ", ".join("%s" for _ in ALL_COUNTERS) + ")",
                [(r["run_id"], r["started_at"], r["finished_at"] or r["started_at"],
                  r["started_at"], *(r.get(c) or 0 for c in ALL_COUNTERS)) for r in runs])
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
                    sorted(TABLES[SCHEMA_VERSION] - self._tables(self.schema))]
        problems += [f"index {name} is not valid (rebuild it: REINDEX INDEX {name})"
                     for (name,) in self._read(
                         "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                         " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s"
                         " AND NOT (i.indisvalid AND i.indisready)", (self.schema,))]
        return IntegrityReport(method="tables and index validity", problems=tuple(problems))
