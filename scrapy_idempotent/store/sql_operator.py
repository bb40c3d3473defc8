"""The operator queries of the SQL store, for the ``scrapy idempotent`` commands (see the
section of the same name in base.py): :class:`SqlOperatorQueries` (mixed into
:class:`~.sql.SqlStore`) reads the frontier's entries, failures, rejects and records, puts
failed requests and rejected pages back, and re-identifies the records (``rekey``)."""

from __future__ import annotations

import json
import re
from typing import Any

from ..exceptions import StoreError
from .base import (
    FailedRequest,
    FrontierEntry,
    RecordKey,
    RejectedItem,
    RejectsRetried,
    Rekey,
    RepeatedRequest,
    RequestSummary,
    RetriedFailed,
    SessionInfo,
    StoredIdentity,
    StoredRecord,
    url_glob_matches,
)
from .rules import anomaly_checks
from .sql_dialect import _LAST_RUN, _PENDING_AGAIN, SqlDialect

__all__ = ["SqlOperatorQueries"]

#: the columns of a frontier entry (:class:`~.FrontierEntry`; a fingerprint stored NULL is
#: the key's)
_ENTRY = ("SELECT key, coalesce(fingerprint, key), url, state, priority, is_start, {data},"
          " parent_key, worker, leased_until, attempts, unfinished, replays, enqueued_at,"
          " finished_at, error_kind, error_message, run_id, downloads FROM requests")


class SqlOperatorQueries(SqlDialect):
    """The operator queries every SQL backend shares (a mixin of ``SqlStore``)."""

    # -- operator queries -----------------------------------------------------------------
    # For the ``scrapy idempotent`` commands; see the section of the same name in base.py.

    def _record_types_stored(self) -> set[str]:
        raise NotImplementedError

    def entry(self, key: str) -> FrontierEntry | None:
        found = self._entries_where("key = ?", (self._key(key),), 1)
        return found[0] if found else None

    def entries(self, *, after: str | None = None, limit: int = 1000) -> list[FrontierEntry]:
        if not after:
            return self._entries_where("1 = 1", (), limit)
        return self._entries_where("key > ?", (self._key(after),), limit)

    def _entries_where(self, where: str, params: tuple[Any, ...],
                       limit: int) -> list[FrontierEntry]:
        entry = _ENTRY.format(data=self.DATA_READ.format(r=""))
        # (key order: text in SQLite's binary order, or bytes: the hex digits' order)
        rows = self._select(f"{entry} WHERE {where} ORDER BY key LIMIT ?", (*params, limit))
        read = self._key_read
        return [FrontierEntry(*(read(row[0]), read(row[1]), *row[2:5], bool(row[5]),
                                self._request_data(row[6], row[2], read(row[0])),
                                read(row[7]), *row[8:]))
                for row in rows]

    def meta(self) -> dict[str, str]:
        return dict(self._select("SELECT key, value FROM meta ORDER BY key"))

    # -- record identity --------------------------------------------------------------------

    def record_keys(self) -> list[RecordKey]:
        return [RecordKey(record_type, item_type, tuple(json.loads(fields)))
                for record_type, item_type, fields in self._select(
                    "SELECT record_type, item_type, fields FROM record_keys"
                    " ORDER BY record_type")]

    def stored_identities(self, after: str | None = None, batch: int = 5000
                          ) -> list[StoredIdentity]:
        where = "" if after is None else "WHERE r.record_id > ?"
        return [StoredIdentity(*row) for row in self._select(
            "SELECT r.record_id, r.item_type, r.natural_key, r.data, r.content_hash,"
            " r.observed_at, r.first_seen, r.seen_seq, r.request_key, q.url FROM records AS r"
            f" LEFT JOIN requests AS q ON q.key = {self.KEY_OF_TEXT.format(c='r.request_key')}"
            f" {where} ORDER BY r.record_id LIMIT ?",
            (*(() if after is None else (after,)), batch))]

    def rekey(self, change: Rekey) -> None:
        with self._write("re-identifying the records") as cur:
            (count,) = cur.execute("SELECT count(*) FROM records").fetchall()[0]
            if int(count) != change.records:
                raise StoreError(
                    f"the records changed while they were re-identified ({change.records} "
                    f"read, {count} now): a crawl wrote meanwhile; nothing was changed")
            self._rekey_records(cur, change)
            self._rekey_outbox(cur, change.outbox)
            # pages' validators name their records by the old IDs: fetched in full next time
            cur.execute("DELETE FROM page_validators")
            cur.execute("DELETE FROM linked_requests")
            cur.execute("DELETE FROM record_keys")
            now = self.clock()
            cur.executemany(self._q(
                "INSERT INTO record_keys (record_type, item_type, fields, recorded_at)"
                " VALUES (?, ?, ?, ?)"),
                [(key.record_type, key.item_type, json.dumps(list(key.fields)), now)
                 for key in change.keys])
            self._set_meta(cur, "record_id_scheme", change.scheme)
            if change.cleanup:
                self._set_meta(cur, "rekey_cleanup", json.dumps(list(change.cleanup)))
        self._record_types_stored().clear()

    def _rekey_records(self, cur: Any, change: Rekey) -> None:
        """Delete the merged records, then move every other one to its new ID in two steps
        (through a temporary ID no record ID can have: a new ID may be the stored ID of
        another record that moves too)."""
        for start in range(0, len(change.merged), 1000):
            where, param = self._any("record_id", sorted(change.merged[start:start + 1000]))
            cur.execute(f"DELETE FROM records WHERE {where}", (param,))
        cur.executemany(self._q(
            "UPDATE records SET record_id = ?, natural_key = ?,"
            " data = coalesce(?, data), content_hash = coalesce(?, content_hash),"
            " first_seen = CASE WHEN ? < first_seen THEN ? ELSE first_seen END"
            " WHERE record_id = ?"),
            [(f"~{move.new_record_id}", move.natural_key, move.data, move.content_hash,
              move.first_seen, move.first_seen, move.record_id)
             for move in change.moves])
        cur.execute(self._q("UPDATE records SET record_id = substr(record_id, 2)"
                            " WHERE record_id LIKE '~%'"))

    def _rekey_outbox(self, cur: Any, moved: dict[str, str]) -> None:
        """Outbox entries name the record by its new ID; their idempotency keys stay (a
        receiver that had an entry must know it again when it is delivered again)."""
        if not moved:
            return
        rows = cur.execute("SELECT id, record_id FROM outbox").fetchall()
        cur.executemany(self._q("UPDATE outbox SET record_id = ? WHERE id = ?"),
                        [(moved[record_id], id_) for id_, record_id in rows
                         if record_id in moved])

    def end_rekey_cleanup(self) -> None:
        with self._write("forgetting the files removed after re-identifying") as cur:
            cur.execute("DELETE FROM meta WHERE key = 'rekey_cleanup'")

    def sessions(self) -> list[SessionInfo]:
        return [SessionInfo(*row) for row in self._select(
            "SELECT session_id, run_id, worker, started_at, ended_at, reason FROM sessions"
            " ORDER BY session_id")]

    def request_summary(self) -> RequestSummary:
        row = self._select(
            "SELECT count(*), coalesce(sum(attempts), 0),"
            " coalesce(sum(CASE WHEN attempts > 1 THEN 1 ELSE 0 END), 0),"
            " coalesce(max(attempts), 0),"
            " coalesce(sum(CASE WHEN state = 'leased' AND leased_until < ? THEN 1 ELSE 0 END),"
            "  0), coalesce(sum(replays), 0), coalesce(sum(downloads), 0),"
            " coalesce(sum(CASE WHEN downloads > 1 THEN 1 ELSE 0 END), 0)"
            " FROM requests", (self.clock(),))[0]
        requests, leases, repeated, most, expired, replays, downloads, again = (
            int(v) for v in row)
        journaled = int(self._select("SELECT count(*) FROM responses")[0][0])
        return RequestSummary(requests=requests, leases=leases, repeated=repeated,
                              most_attempts=most, expired_leases=expired,
                              journaled_responses=journaled, replays=replays,
                              downloads=downloads, downloaded_again=again)

    def failure_counts(self) -> dict[str, int]:
        return {kind: int(n) for kind, n in self._select(
            "SELECT coalesce(error_kind, ''), count(*) FROM requests WHERE state = 'failed'"
            " GROUP BY 1 ORDER BY 2 DESC, 1")}

    def repeated_requests(self, limit: int) -> list[RepeatedRequest]:
        return [RepeatedRequest(self._key_read(row[0]), *row[1:]) for row in self._select(
            "SELECT key, url, state, attempts, worker, error_kind FROM requests"
            " WHERE attempts > 1 ORDER BY attempts DESC, id LIMIT ?", (limit,))]

    def _failed_filter(self, kinds: list[str] | None, url_glob: str | None,
                       url_regex: str | None) -> tuple[str, list[Any]]:
        """The failed requests of ``kinds`` (a kind or any sub-kind ``kind/...``) whose URL
        matches: URLs are matched here, in Python (the interface's glob, Python regular
        expressions), whatever pattern language the database has."""
        where, params = ["state = 'failed'"], []
        if kinds:
            where.append("(" + " OR ".join(
                "error_kind = ? OR substr(error_kind, 1, ?) = ?" for _ in kinds) + ")")
            for kind in kinds:
                params += [kind, len(kind) + 1, f"{kind}/"]
        if url_glob is not None or url_regex is not None:
            glob = url_glob
            pattern = re.compile(url_regex) if url_regex is not None else None
            keys = [key for key, url in self._select(
                        "SELECT key, url FROM requests WHERE " + " AND ".join(where), params)
                    if (glob is None or url_glob_matches(glob, url))
                    and (pattern is None or pattern.search(url) is not None)]
            matching, param = self._any("key", keys, sql_type=self.KEY_TYPE)  # (as read)
            where.append(matching)
            params.append(param)
        return " AND ".join(where), params

    def failed_requests(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                        url_regex: str | None = None,
                        limit: int | None = None) -> list[FailedRequest]:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        read = self._key_read
        return [FailedRequest(read(row[0]), row[1], row[2], row[3], row[4], row[5],
                              read(row[6]), row[7])
                for row in self._select(
            "SELECT key, url, error_kind, error_message, attempts, finished_at, parent_key,"
            f" run_id FROM requests WHERE {where} ORDER BY finished_at DESC, id DESC LIMIT ?",
            (*params, self.NO_LIMIT if limit is None else limit))]

    def count_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> int:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        return int(self._select(f"SELECT count(*) FROM requests WHERE {where}", params)[0][0])

    def retry_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> RetriedFailed:
        where, params = self._failed_filter(kinds, url_glob, url_regex)
        with self._write("putting failed requests back") as cur:
            cur.execute(self._q(
                f"{_PENDING_AGAIN}, attempts = 0, replays = 0, downloads = 0, finished_at = NULL,"
                " error_kind = NULL,"
                f" error_message = NULL WHERE {where}"), params)
            retried: int = cur.rowcount
            if retried:
                self._notify(cur, force=True)
            last = self._reopen(cur, bool(retried))
        return RetriedFailed(retried=retried, run_id=last[0] if last else None,
                             reopened=bool(retried and last and last[1] is not None))

    def _reopen(self, cur: Any, changed: bool) -> tuple[Any, ...] | None:
        """The last run ``(run_id, finished_at)``, reopened when ``changed`` and finished."""
        last = cur.execute(_LAST_RUN).fetchone()
        if changed and last is not None and last[1] is not None:
            cur.execute(self._q("UPDATE runs SET finished_at = NULL, reason = NULL"
                                " WHERE run_id = ?"), (last[0],))
        return tuple(last) if last is not None else None

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
        return [StoredRecord(*row) for row in self._select(
            "SELECT record_id, source, natural_key, item_type, data, first_seen, last_changed,"
            " first_run_id, changed_run_id, content_hash, request_key, version, observed_at"
            f" FROM records WHERE {' AND '.join(where)} ORDER BY record_id LIMIT ?",
            (*params, limit))]

    @staticmethod
    def _rejects_filter(run_id: int | None, pending_only: bool) -> tuple[str, list[Any]]:
        where, params = ["1 = 1"], []
        if run_id is not None:
            where.append("j.run_id = ?")
            params.append(run_id)
        if pending_only:
            where.append("j.retried_at IS NULL")
        return " AND ".join(where), params

    def rejects(self, *, run_id: int | None = None, pending_only: bool = False,
                limit: int | None = None) -> list[RejectedItem]:
        where, params = self._rejects_filter(run_id, pending_only)
        return [RejectedItem(*row) for row in self._select(
            "SELECT j.id, j.item_type, j.reason, j.data, j.request_key,"
            " coalesce(j.page_url, r.url) AS page_url, j.created_at, j.run_id, j.retried_at,"
            " r.state AS page_state FROM rejects j LEFT JOIN requests r"
            f" ON r.key = {self.KEY_OF_TEXT.format(c='j.request_key')}"
            f" WHERE {where} ORDER BY j.created_at DESC, j.id DESC LIMIT ?",
            (*params, self.NO_LIMIT if limit is None else limit))]

    def count_rejects(self, *, run_id: int | None = None, pending_only: bool = False) -> int:
        where, params = self._rejects_filter(run_id, pending_only)
        return int(self._select(f"SELECT count(*) FROM rejects j WHERE {where}", params)[0][0])

    def retry_rejects(self) -> RejectsRetried:
        now = self.clock()
        with self._write("putting rejected pages back") as cur:
            last = cur.execute(_LAST_RUN).fetchone()
            if last is None:
                return RejectsRetried(pages=0, rejects=0, without_page=0, run_id=None,
                                      reopened=False)
            cur.execute(self._q(
                f"{_PENDING_AGAIN}, attempts = 0, replays = 0, downloads = 0, unfinished = 0,"
                " finished_at = NULL, error_kind = NULL, error_message = NULL WHERE key IN"
                f" (SELECT {self.KEY_OF_TEXT.format(c='request_key')} FROM rejects"
                " WHERE run_id = ? AND retried_at IS NULL)"
                " AND state IN ('done', 'failed', 'redirected')"), (last[0],))
            pages: int = cur.rowcount
            cur.execute(self._q(
                "UPDATE rejects SET retried_at = ? WHERE run_id = ? AND retried_at IS NULL"
                " AND EXISTS (SELECT 1 FROM requests q WHERE q.key = "
                + self.KEY_OF_TEXT.format(c="rejects.request_key")
                + " AND q.state IN ('pending', 'leased'))"), (now, last[0]))
            marked: int = cur.rowcount
            (without,) = cur.execute(self._q(
                "SELECT count(*) FROM rejects WHERE run_id = ? AND retried_at IS NULL"),
                (last[0],)).fetchone()
            self._reopen(cur, bool(pages))
        return RejectsRetried(pages=pages, rejects=marked, without_page=int(without),
                              run_id=last[0], reopened=bool(pages and last[1] is not None))

    def anomalies(self) -> dict[str, int]:
        return {name: int(self._select(sql)[0][0])
                for name, sql in anomaly_checks(self.KEY_OF_TEXT).items()}
