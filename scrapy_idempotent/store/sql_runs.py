"""Runs, and what a database records at its first open, in the SQL store: :class:`SqlRuns`
(mixed into :class:`~.sql.SqlStore`) claims the database's metadata (fingerprinter, crawl
identity, record ID scheme), starts runs, keeps the runs' progress samples and totals, and
serves the records of a run and the state of its feeds."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from ..exceptions import StoreError
from .base import CrawlIdentity, RunMode, RunRecord, RunTotals, Sample
from .rules import (
    MIGRATED_RECORD_ID_SCHEMES,
    record_id_scheme_refusal,
    starts_new_run,
    stored_record_id_scheme,
    window_start,
)
from .sql_dialect import _LAST_RUN, SqlDialect

__all__ = ["SqlRuns"]

#: the run counters a progress sample keeps (:class:`~.Sample`)
_SAMPLE_COUNTERS = ("leased", "done", "failed", "redirected", "records_inserted",
                    "records_updated", "records_unchanged", "records_stale",
                    "leases_reclaimed", "leases_lost")


#: A count of the frontier (:meth:`~.FrontierStore.counts`) that took at least this long
#: (seconds) is kept for the crawl's workers (:meth:`SqlRuns.shared_counts`). A count reads an
#: index entry of every request and record (on PostgreSQL 0.14 s at 500,000 requests, 0.7 s
#: at 2,000,000); each worker's progress line asked for one. Below it, 32 workers counting
#: once a minute each keep a server core busy 5% of the time at most.
SHARED_COUNT_SECONDS = 0.1


class SqlRuns(SqlDialect):
    """The database's metadata, runs, progress samples and feeds (a mixin of ``SqlStore``)."""

    # -- the database's metadata ----------------------------------------------------------

    def _claim_meta(self, cur: Any, fingerprinter: str, identity: CrawlIdentity | None,
                    record_id_scheme: str | None, where: str) -> str:
        """What a database records at its first open (a database of an earlier version gets
        what it lacks now), in the transaction of ``cur``: the fingerprinter, the creation
        time and the frontier's id (a random one: a copy made by ``migrate`` gets its own,
        see :meth:`~.FrontierStore.frontier_id`), the crawl identity (another crawl's is
        refused: checked again here, in the write transaction, for a crawl that claimed it
        since the read-only check) and the record ID scheme. Returns the fingerprinter
        recorded."""
        cur.execute(self._q("INSERT INTO meta VALUES ('fingerprinter', ?), ('created_at', ?),"
                            " ('frontier_id', ?) ON CONFLICT (key) DO NOTHING"),
                    (fingerprinter, repr(self.clock()), uuid.uuid4().hex))
        (stored,) = cur.execute(
            "SELECT value FROM meta WHERE key = 'fingerprinter'").fetchall()[0]
        if identity is not None:
            self._check_identity(self._claim_identity(cur, identity), identity)
        self._claim_record_id_scheme(cur, record_id_scheme, where)
        return str(stored)

    def _claim_identity(self, cur: Any, identity: CrawlIdentity) -> dict[str, str]:
        """The identity recorded in the database, ``identity`` when none was yet."""
        identity_sql = "SELECT key, value FROM meta WHERE key IN ('project', 'spider', 'source')"
        stored = dict(cur.execute(identity_sql).fetchall())
        if not stored:
            cur.execute(self._q("INSERT INTO meta VALUES ('project', ?), ('spider', ?),"
                                " ('source', ?) ON CONFLICT (key) DO NOTHING"),
                        (identity.project, identity.spider, identity.source))
            stored = dict(cur.execute(identity_sql).fetchall())  # (another worker's, maybe)
        return stored

    @abstractmethod
    def _check_identity(self, stored: dict[str, str], identity: CrawlIdentity) -> None:
        """Refuse the database whose recorded identity ``stored`` is another crawl's (an
        empty one is nobody's yet: the first open records it)."""

    def _claim_record_id_scheme(self, cur: Any, scheme: str | None, where: str) -> None:
        """Record ``scheme`` as the record ID scheme of this database's records, unless it
        has one already (:func:`.rules.stored_record_id_scheme`); raise
        :class:`~.StoreError` (the transaction of ``cur`` rolled back) when it has another.
        None: neither recorded nor checked (the commands, a migration's target)."""
        if scheme is None:
            return
        rows = cur.execute("SELECT value FROM meta WHERE key = 'record_id_scheme'").fetchall()
        if rows:
            stored = str(rows[0][0])
        else:
            (has_records,) = cur.execute(
                "SELECT EXISTS (SELECT 1 FROM records)").fetchall()[0]
            stored = stored_record_id_scheme(None, bool(has_records), scheme)
            cur.execute(self._q("INSERT INTO meta VALUES ('record_id_scheme', ?)"
                                " ON CONFLICT (key) DO NOTHING"), (stored,))
        if stored != scheme and stored not in MIGRATED_RECORD_ID_SCHEMES:
            raise StoreError(record_id_scheme_refusal(where, stored, scheme))

    # -- runs and sessions ----------------------------------------------------------------

    def _lock_runs(self, cur: Any) -> None:
        """Serialise the run starts of this crawl in the transaction of ``cur``; nothing by
        default (a backend whose write transactions are serial)."""

    def _lock_frontier(self, cur: Any) -> None:
        """Before a session that finishes the run reads whether anything is left: wait for
        the page commits in progress; nothing by default (write transactions are serial)."""

    def _empty(self, cur: Any, *tables: str) -> None:
        """Delete every row of ``tables`` in the transaction of ``cur``."""
        for table in tables:
            cur.execute(f"DELETE FROM {table}")

    def _start_run(self, cur: Any, run_mode: RunMode, now: float) -> tuple[int, bool]:
        """The run a session joining with ``run_mode`` belongs to, and whether it starts now
        (:func:`.rules.starts_new_run`). A new run ends an unfinished one (``superseded``)
        and empties the frontier, but for what was done within the recrawl window, and the
        response journal."""
        self._lock_runs(cur)
        last = cur.execute(_LAST_RUN).fetchone()
        new = starts_new_run(run_mode, None if last is None else last[1] is not None)
        if last is not None and not new:
            return int(last[0]), False
        cur.execute(self._q("UPDATE runs SET finished_at = ?, reason = 'superseded'"
                            " WHERE finished_at IS NULL"), (now,))
        if self.recrawl_seconds is None:
            self._empty(cur, "requests", "responses")
        else:  # keep what was done in the current window
            cur.execute(self._q("DELETE FROM requests WHERE state NOT IN"
                                " ('done', 'failed', 'redirected') OR finished_at < ?"),
                        (window_start(self.recrawl_seconds, now),))
            self._empty(cur, "responses")
        (run_id,) = cur.execute(self._q("INSERT INTO runs (started_at) VALUES (?)"
                                        " RETURNING run_id"), (now,)).fetchall()[0]
        return int(run_id), True

    # -- progress samples -----------------------------------------------------------------

    #: The table holding the run counters (SQLite: ``runs``; PostgreSQL: one row per session,
    #: added up)
    COUNTER_TABLE = "runs"

    def record_sample(self, interval: float, *, final: bool = False) -> bool:
        run_id = self.run_id
        if run_id is None or interval <= 0:
            return False
        now = self.clock()
        slot = int(now // interval)
        columns = ", ".join(_SAMPLE_COUNTERS)
        sums = ", ".join(f"coalesce(sum({c}), 0)" for c in _SAMPLE_COUNTERS)
        conflict = ("DO UPDATE SET at = excluded.at, "
                    + ", ".join(f"{c} = excluded.{c}" for c in (*_SAMPLE_COUNTERS, "in_flight"))
                    if final else "DO NOTHING")
        with self._write("storing a progress sample") as cur:
            if not final and cur.execute(self._q(
                    "SELECT 1 FROM samples WHERE run_id = ? AND slot = ?"),
                    (run_id, slot)).fetchone():
                return False  # another worker took this slot's sample
            # one statement: the counters and the leases in flight as this transaction sees
            cur.execute(self._q(
                f"INSERT INTO samples (run_id, slot, at, {columns}, in_flight)"
                f" SELECT ?, ?, ?, {sums}, (SELECT count(*) FROM requests"
                "  WHERE state = 'leased')"
                f" FROM {self.COUNTER_TABLE} WHERE run_id = ?"
                f" ON CONFLICT (run_id, slot) {conflict}"), (run_id, slot, now, run_id))
            written: int = cur.rowcount
        return written > 0

    #: The run counters :class:`~.RunTotals` holds, as named in :attr:`COUNTER_TABLE`
    _TOTALS = ("done", "failed", "redirected", "records_inserted", "records_updated",
               "records_unchanged", "records_stale")

    @abstractmethod
    def counts(self) -> dict[str, int]: ...

    def shared_counts(self, max_age: float) -> tuple[dict[str, int], float]:
        """The count another worker kept in ``meta`` (``frontier_counts``: when, on the
        store's clock, by which worker, how long it took, the counts) while younger than
        ``max_age``; else a count now, kept when it took at least
        :data:`SHARED_COUNT_SECONDS`. A worker does not take its own count back (its lines
        are as exact as they were), and a count that cannot be kept (the database busy) is
        answered all the same."""
        now = self.clock()
        worker = self._worker or ""
        for (raw,) in self._crawl_select(
                "SELECT value FROM meta WHERE key = 'frontier_counts'"):
            try:
                kept = json.loads(raw)
                age = now - float(kept["at"])
                by = str(kept["worker"])
                counts = {str(name): int(n) for name, n in kept["counts"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                break  # not one this release wrote: counted again, and replaced
            if 0 <= age < max_age and by != worker:
                return counts, age
        started = time.perf_counter()
        counts = self.counts()
        took = time.perf_counter() - started
        if took >= SHARED_COUNT_SECONDS:
            value = json.dumps({"at": now, "worker": worker, "seconds": round(took, 3),
                                "counts": counts})
            with (contextlib.suppress(StoreError),
                  self._write("keeping the frontier's counts") as cur):
                self._set_meta(cur, "frontier_counts", value)
        return counts, 0.0

    def run_totals(self, run_id: int, *, spider_errors: bool = False) -> RunTotals:
        sums = ", ".join(f"coalesce(sum({c}), 0)" for c in self._TOTALS)
        row = self._crawl_select(
            f"SELECT {sums} FROM {self.COUNTER_TABLE} WHERE run_id = ?", (run_id,))[0]
        errors = None
        if spider_errors:
            kind = "spider_error/"
            errors = int(self._crawl_select(
                "SELECT count(*) FROM requests WHERE state = 'failed'"
                " AND substr(error_kind, 1, ?) = ?", (len(kind), kind))[0][0])
        done, failed, redirected, inserted, updated, unchanged, stale = (int(n) for n in row)
        return RunTotals(run_id, done=done, failed=failed, redirected=redirected,
                         records_inserted=inserted, records_updated=updated,
                         records_unchanged=unchanged, records_stale=stale,
                         spider_errors=errors)

    def samples(self, run_id: int) -> list[Sample]:
        return [Sample(run_id, *row) for row in self._select(
            f"SELECT at, {', '.join(_SAMPLE_COUNTERS)}, in_flight FROM samples"
            " WHERE run_id = ? ORDER BY slot", (run_id,))]

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
                rows = self._select(columns + order, (run_id,))
            else:
                rows = self._select(columns + " AND (seen_seq, seen_at, record_id) > (?, ?, ?)"
                                    + order, (run_id, *after))
            if not rows:
                return
            last = rows[-1]
            after = (last[5], last[6], last[0])
            for row in rows:
                yield RunRecord(*row[:5])

    def feed_base(self, run_id: int, uri: str, size: int) -> int:
        with self._write("recording a feed") as cur:
            cur.execute(self._q("INSERT INTO feeds (run_id, uri, base_size) VALUES (?, ?, ?)"
                                " ON CONFLICT DO NOTHING"), (run_id, uri, size))
            row = cur.execute(self._q("SELECT base_size FROM feeds WHERE run_id = ?"
                                      " AND uri = ?"), (run_id, uri)).fetchone()
        return int(row[0]) if row is not None else size

    def store_feed(self, run_id: int, uri: str, level: int,
                   replace: Callable[[], object]) -> bool:
        key = f"stored {uri}"
        with self._write("storing a feed") as cur:
            cur.execute(self._q("INSERT INTO feeds (run_id, uri, base_size) VALUES (?, ?, -1)"
                                " ON CONFLICT DO NOTHING"), (run_id, key))
            row = cur.execute(self._q("SELECT base_size FROM feeds WHERE run_id = ? AND uri = ?"
                                      + self.LOCK_ROWS), (run_id, key)).fetchone()
            if row is not None and row[0] > level:
                return False
            cur.execute(self._q("UPDATE feeds SET base_size = ? WHERE run_id = ? AND uri = ?"),
                        (level, run_id, key))
            replace()
        return True
