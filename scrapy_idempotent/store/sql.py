"""The SQL every backend shares, written once over a small dialect.

:class:`SqlStore` implements the parts of :class:`~.FrontierStore` whose statements every
supported database understands: the page commit (fence, new requests, records, outbox,
rejects, journal, completions, claim), the outbox (:class:`~.sql_outbox.SqlOutbox`, mixed
in), the leases' reads and releases and the operator queries. A backend subclasses it and
gives what is its own:

* its connections: :meth:`SqlStore._write` (the one write-transaction primitive),
  :meth:`SqlStore._select` (the operator queries' reads) and :meth:`SqlStore._crawl_select`
  (the reads a crawl makes while its writer thread writes);
* its dialect: :meth:`SqlStore._q` (placeholders: statements here are written with ``?``),
  :meth:`SqlStore._any` (a column in a list of values given as one parameter),
  :attr:`SqlStore.LOCK_ROWS` and :attr:`SqlStore.SKIP_LOCKED` (row locking clauses),
  :attr:`SqlStore.TEXT_ORDER` (byte order of text keys) and :attr:`SqlStore.NO_LIMIT`;
* the few statements that differ: the claim (:meth:`SqlStore._claim_rows`), the insert of
  new requests (:meth:`SqlStore._send_insert`), the records' clock and feed order
  (:meth:`SqlStore._read_records`), the run counters (:meth:`SqlStore._count`), and the
  wake-up of idle workers (:meth:`SqlStore._notify`, nothing by default); and where it can
  send many rows as one statement, the terminal completions
  (:meth:`SqlStore._send_finishes`) and the new records (:meth:`SqlStore._insert_records`),
  one statement each by default.

Statements that need an answer go out through :meth:`SqlStore._send`, which returns a
function giving the rows: a backend that pipelines (PostgreSQL) sends and reads later, one that
does not (SQLite) answers at once; the commit reads each answer only where a decision needs it.
The rules the statements carry out are :mod:`.rules`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .base import (
    CommitResult,
    Completion,
    FrontierStore,
    NewRequest,
    Record,
    RecordKey,
    RequestState,
    SlotLimits,
    StateChange,
    UnitOfWork,
    change_key,
)
from .packing import PackedRequestError
from .rules import (
    CLAIMED_COLUMNS,
    Enqueue,
    RecordWrite,
    StoredState,
    after_write,
    apply_state_changes,
    enqueue_decision,
    quarantine_message,
    record_write,
    split_claim,
    window_start,
)
from .sql_dialect import Answer
from .sql_known import SqlKnownRequests
from .sql_leases import SqlLeases
from .sql_operator import SqlOperatorQueries
from .sql_outbox import SqlOutbox
from .sql_pages import SqlPageValidators
from .sql_politeness import SqlPoliteness, _limits_of
from .sql_runs import SqlRuns

__all__ = ["Answer", "SqlStore"]


#: A frontier entry already there: (its row's REQUEST_ROW, state, finished_at); None for one
#: added by the same page commit.
_Known = tuple[Any, str, Any]
#: where a claimed row holds its encoded request and its URL (:data:`.rules.CLAIMED_COLUMNS`)
_DATA, _URL = CLAIMED_COLUMNS.index("data"), CLAIMED_COLUMNS.index("url")
_KEY = CLAIMED_COLUMNS.index("key")
_FINGERPRINT = CLAIMED_COLUMNS.index("fingerprint")
assert (_KEY, _FINGERPRINT) == (1, 2)


class SqlStore(SqlRuns, SqlLeases, SqlKnownRequests, SqlPoliteness, SqlOperatorQueries, SqlOutbox,
               SqlPageValidators, FrontierStore):
    """The :class:`~.FrontierStore` statements every SQL backend shares (see the module
    docstring for what a backend gives)."""

    # -- the page commit ------------------------------------------------------------------

    #: the attributes of this worker's session that moving to the next run changes
    #: (:meth:`_join_run`): put back when the transaction that moved it is not committed
    _SESSION_STATE: tuple[str, ...] = ("run_id",)

    def commit(self, work: UnitOfWork, worker: str) -> CommitResult:
        result = CommitResult()
        if work:
            session = {name: getattr(self, name) for name in self._SESSION_STATE}
            now = self.clock()
            try:
                self._commit_unit(work, worker, self.run_id if self.run_id is not None else 0,
                                  now, result)
            except BaseException:
                for name, value in session.items():
                    setattr(self, name, value)
                raise
            if result.slots_added:  # committed: their rows exist
                self._slot_names().update(result.slots_added)
            if result.record_keys_added:
                self._record_types_stored().update(result.record_keys_added)
            self._learn_known(work, result, now)
        return result

    def _record_types_stored(self) -> set[str]:
        """The record types known to have their natural keys recorded (none are deleted but
        by :meth:`rekey`, which forgets this)."""
        names: set[str] | None = self.__dict__.get("_record_types")
        if names is None:
            names = self.__dict__["_record_types"] = set()
        return names

    def _slot_names(self) -> set[str]:
        """The download slots known to have a row in the slots table (none are deleted)."""
        names: set[str] | None = self.__dict__.get("_slots_stored")
        if names is None:
            names = self.__dict__["_slots_stored"] = set()
        return names

    @abstractmethod
    def _commit_unit(self, work: UnitOfWork, worker: str, run_id: int, now: float,
                     result: CommitResult) -> None:
        """Write ``work`` in one transaction (:meth:`_write_unit` in the backend's write
        transaction), counting into ``result``."""

    def _write_unit(self, cur: Any, work: UnitOfWork, worker: str, run_id: int, now: float,
                    result: CommitResult, number: int = 0) -> None:
        """Write ``work`` in the transaction of ``cur``. The fence comes first: nothing of a
        completion, journaled response or start whose lease is not ``worker``'s any more is
        written, nor the records, rejects and requests its page produced."""
        # a claim takes the work of the current run: of a newer one than this worker's if
        # its own was finished by another worker while it was open (records of the pages it
        # leased before are its own run's, and fenced if that frontier is gone)
        latest = (self._send(cur, "SELECT max(run_id) FROM runs")
                  if self.run_id is not None and work.claim else None)
        # pages answered 304: what they produced when last fetched (their requests are
        # enqueued again as this transaction's, their records seen)
        unchanged = self._unchanged_pages(cur, work.completions)
        requests = work.requests
        if unchanged:
            requests = requests + [new for _, children in unchanged.values()
                                   for new in children]
        fence = self._send_fence(cur, work, worker)
        lookups = self._send_lookups(cur, requests)
        lost = fence()
        if latest is not None:
            newest = latest()[0][0]
            if newest is not None and int(newest) > run_id:
                # what this worker writes from now on is that run's
                run_id = int(newest)
                self._join_run(cur, worker, run_id, now)
                result.run_id = run_id
        if lost:
            requests = [r for r in requests if r.parent_key not in lost]
            unchanged = {key: page for key, page in unchanged.items() if key not in lost}
        inserted = self._insert_requests(cur, requests, now, run_id, result, lookups)
        self._keep_linked(cur, [r for r in work.requests if r.parent_key not in lost]
                          if lost else work.requests)
        records = [r for r in work.records if r[1] not in lost] if lost else work.records
        changes = self._upsert_records(cur, records, now, run_id, result)
        if unchanged:
            self._see_unchanged(cur, unchanged, run_id, now, result)
            result.pages_not_modified += len(unchanged)
            result.requests_relinked += sum(len(children) for _, children in unchanged.values())
        self._keep_validators(cur, work.completions, requests, records, lost,
                              {record.record_id for _, record, _ in changes}, run_id, now)
        if work.outbox_targets and changes:
            self._write_outbox(cur, changes, work.outbox_targets, now, run_id, result)
        state_changes = [change for change, key in work.state_changes if key not in lost]
        if state_changes:
            self._write_state(cur, state_changes)
        for key, value in sorted(work.meta.items()):
            self._set_meta(cur, key, value)
        rejects = [r for r in work.rejects if r.request_key not in lost]
        if rejects:
            cur.executemany(self._q(
                "INSERT INTO rejects (item_type, reason, data, request_key, page_url,"
                " created_at, run_id) VALUES (?, ?, ?, ?, ?, ?, ?)"),
                [(r.item_type, r.reason, r.data, r.request_key, r.page_url, now, run_id)
                 for r in rejects])
            result.rejects += len(rejects)
        responses = [r for r in work.responses if r[0] not in lost]
        if responses:
            cur.executemany(self._q(
                "INSERT INTO responses (key, data, body, stored_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (key) DO UPDATE SET data = excluded.data, body = excluded.body,"
                " stored_at = excluded.stored_at"),
                [(key, data, body, now) for key, data, body in responses])
        self._add_counters(cur, [key for key in work.started if key not in lost],
                           [key for key in work.replayed if key not in lost],
                           [key for key in work.downloaded if key not in lost], worker)
        completing = self._complete(cur, work.completions, lost, worker, now)
        # claimed ahead, never handed out: their claim's attempt is taken back
        self._leased_update(cur, "state = 'pending', worker = NULL, leased_until = NULL,"
                            " attempts = attempts - 1", work.give_back, worker)
        if work.claim:
            self._claim(cur, worker, work.claim, now, result)
            self._load_validators(cur, result)
        added = inserted[0]()  # the keys inserted; the others: inserted meanwhile elsewhere
        result.requests_added += added
        result.requests_duplicate += inserted[1] - added
        self._completed(work.completions, completing(), result)
        self._count(cur, result, run_id, len(result.leased) - len(work.give_back), number)
        if (result.requests_added or result.requests_due_again
                or result.completed.get(RequestState.PENDING.value)):
            self._notify(cur)

    def _add_counters(self, cur: Any, started: Sequence[str], replayed: Sequence[str],
                      downloaded: Sequence[str], worker: str) -> None:
        """Count on the requests ``worker`` leases: ``started`` (``unfinished``, once a key),
        ``replayed`` from the journal (``replays``, once a key) and each network response of
        ``downloaded`` (``downloads``, a key once per response). One statement for the keys
        of one combination of increments: a page's request is most often started and
        downloaded in the same unit, its row then written once, not once a counter."""
        increments: dict[str, list[int]] = {}
        for key in started:
            increments.setdefault(key, [0, 0, 0])[0] = 1
        for key in replayed:
            increments.setdefault(key, [0, 0, 0])[1] = 1
        for key, n in Counter(downloaded).items():
            increments.setdefault(key, [0, 0, 0])[2] = n
        by_increments: dict[tuple[int, ...], list[str]] = {}
        for key, counts in increments.items():
            by_increments.setdefault(tuple(counts), []).append(key)
        columns = ("unfinished", "replays", "downloads")
        for added, keys in sorted(by_increments.items()):
            self._leased_update(cur, ", ".join(
                f"{column} = {column} + {int(n)}"
                for column, n in zip(columns, added, strict=True) if n), keys, worker)

    def _leased_update(self, cur: Any, assignments: str, keys: Sequence[str],
                       worker: str) -> None:
        """``SET assignments`` on the requests of ``keys`` that ``worker`` leases."""
        if keys:
            where, param = self._any_key("key", list(keys))
            cur.execute(self._q(f"UPDATE requests SET {assignments} WHERE {where}"
                                f" AND {self.LEASED_BY}"), (param, worker))

    def _send_fence(self, cur: Any, work: UnitOfWork, worker: str) -> Callable[[], set[str]]:
        """Read (and lock) the rows of ``work``'s requests that ``worker`` leases now; the
        answer: the keys of the unit whose request is not leased by the worker any more
        (another worker took it after the lease expired, or it was finished or released)."""
        keys = {c.key for c in work.completions}
        keys.update(key for key, _, _ in work.responses)
        keys.update(work.started)
        if not keys:
            return set
        where, param = self._any_key("key", sorted(keys))
        held = self._send(cur, f"SELECT key FROM requests WHERE {where} AND {self.LEASED_BY}"
                          f" ORDER BY key{self.LOCK_ROWS}", (param, worker))
        return lambda: keys - {self._key_read(key) for (key,) in held()}

    def _send_lookups(self, cur: Any, requests: list[NewRequest]) -> tuple[Answer, Answer]:
        """Ask for the entries already there: by key (the keys of ``requests``, and the
        fingerprints of those filtered by fingerprint), and by fingerprint (entries whose key
        is not their fingerprint: ``dont_filter`` requests)."""
        if not requests:
            return list, list
        lookup = {r.key for r in requests} | {r.fingerprint for r in requests
                                              if r.filter_fingerprint}
        where, param = self._any_key("key", sorted(lookup))
        by_key = self._send(cur, f"SELECT {self.REQUEST_ROW}, key, state, finished_at"
                            f" FROM requests WHERE {where}", (param,))
        fingerprints = sorted({r.fingerprint for r in requests if r.filter_fingerprint})
        if not fingerprints:
            return by_key, list
        where, param = self._any_key("fingerprint", fingerprints)
        return by_key, self._send(cur, f"SELECT {self.REQUEST_ROW}, fingerprint, state,"
                                  f" finished_at FROM requests WHERE {where}"
                                  " AND key <> fingerprint", (param,))

    def _insert_requests(self, cur: Any, requests: list[NewRequest], now: float, run_id: int,
                         result: CommitResult, lookups: tuple[Answer, Answer]
                         ) -> tuple[Callable[[], int], int]:
        """Add ``requests`` to the frontier: a new key is inserted, a known one is a
        duplicate, already done, or (recrawl window) due again. Returns the insert's answer
        (the number inserted) and the number sent: the others were inserted meanwhile by
        another worker (duplicates)."""
        if not requests:
            return (lambda: 0), 0
        # (``row``: the row's REQUEST_ROW, as read: the updates below find it by that)
        by_key: dict[str, _Known] = {self._key_read(key): (row, state, finished)
                                     for row, key, state, finished in lookups[0]()}
        by_fingerprint: dict[str, _Known] = {}
        for row, fingerprint, state, finished in lookups[1]():
            by_fingerprint.setdefault(self._key_read(fingerprint), (row, state, finished))
        window = window_start(self.recrawl_seconds, now)
        new: list[NewRequest] = []
        due: dict[Any, NewRequest] = {}
        for req in requests:  # a request seen earlier in ``requests`` counts as known
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
        if due:
            # in the order of their rows (REQUEST_ROW): page commits locking the same rows
            # lock them in one order
            cur.executemany(self._q(
                f"UPDATE requests SET state = 'pending', url = ?, {self.DATA_SET}, priority = ?,"
                " is_start = ?, fifo = ?, attempts = 0, replays = 0, downloads = 0,"
                " finished_at = NULL,"
                " error_kind = NULL, error_message = NULL, enqueued_at = ?, run_id = ?"
                f" WHERE {self.REQUEST_ROW} = ?"),
                [(req.url, *self._stored_data(req.data, req.url), req.priority, req.is_start,
                  req.fifo, now, run_id, row)
                 for row, req in sorted(due.items())])
        if not new:
            return (lambda: 0), 0
        self._add_slots(cur, new, result)
        return self._send_insert(cur, new, now, run_id), len(new)

    def _add_slots(self, cur: Any, new: list[NewRequest], result: CommitResult) -> None:
        """Give the download slots of ``new`` requests their row (with this worker's limits)
        unless known to have one: a claim finds pending requests through their slot."""
        known = self._slot_names()
        missing = sorted({r.slot for r in new if r.slot not in known})
        if not missing:
            return
        limits = self.slot_limits or SlotLimits(concurrency=0)
        cur.executemany(self._q(
            "INSERT INTO slots (slot, concurrency, delay) VALUES (?, ?, ?)"
            " ON CONFLICT (slot) DO NOTHING"),
            [(slot, *_limits_of(limits, slot)) for slot in missing])
        result.slots_added.extend(missing)

    def _upsert_records(self, cur: Any, records: list[tuple[Record, str | None]], now: float,
                        run_id: int, result: CommitResult) -> list[tuple[str, Record, int]]:
        """Upsert ``records``; returns the changes written: ``(kind, record, version)`` with
        kind ``inserted`` or ``updated``, in item order (an unchanged or stale record is no
        change)."""
        if not records:
            return []
        # The times users read never go backwards, whatever the wall clock does (a backward
        # step, a worker whose clock lags): a record written now gets a time no earlier than
        # any record's last change, so first_seen <= last_changed always, and `export
        # --since` with a time the data showed finds every change made after it.
        newest, seqs, rows = self._read_records(cur, run_id, len(records),
                                                sorted({r.record_id for r, _ in records}))
        if newest is not None and newest > now:
            now = newest
        known = {row[0]: StoredState(*row[1:]) for row in rows}
        # written in record ID order (a record ID twice keeps its item order: the last
        # wins): page commits inserting the same new records take the unique index's locks
        # in one order, so one waits for the other instead of both deadlocking
        order = sorted(range(len(records)), key=lambda n: records[n][0].record_id)
        observed = [self._observed(record, now) for record, _ in records]
        # every record of the unit is seen in this run once committed: its observation is
        # the later of the one given and the one stored (a stale one keeps what is stored)
        result.observed_max = max([*observed, *(state.observed_at for state in known.values()),
                                   *(() if result.observed_max is None
                                     else (result.observed_max,))])
        fresh: dict[str, int] = {}  # a record ID not stored: the item that inserts it
        for n in order:
            rid = records[n][0].record_id
            if rid not in known:
                fresh.setdefault(rid, n)
        if fresh:
            self._record_keys(cur, [records[n][0].key for n in fresh.values()], now, result)
        inserted = self._insert_records(cur, [
            (rid, records[n][0].source, records[n][0].natural_key, records[n][0].item_type,
             records[n][0].data, records[n][0].content_hash, records[n][1], seqs[n],
             observed[n]) for rid, n in fresh.items()], now, run_id) if fresh else set()
        written: list[tuple[int, str, Record, int]] = []
        for n in order:
            record, request_key = records[n]
            rid = record.record_id
            if fresh.get(rid) == n:
                if rid in inserted:
                    known[rid] = after_write(None, RecordWrite.INSERT, record.content_hash,
                                             observed[n], run_id)
                    result.records_inserted += 1
                    written.append((n, RecordWrite.INSERT.value, record, 1))
                    continue
                # another worker inserted this record ID since the read: the unique index
                # was the backstop; this write becomes an update (or nothing) of that row
                result.records_conflicts += 1
                known[rid] = StoredState(*cur.execute(self._q(
                    "SELECT content_hash, seen_run_id, observed_at, version FROM records"
                    f" WHERE record_id = ?{self.LOCK_ROWS}"), (rid,)).fetchone())
            change = self._upsert_record(cur, record, request_key, run_id, now, observed[n],
                                         seqs[n], known, result)
            if change is not None:
                written.append((n, change[0], record, change[1]))
        return [(kind, record, version) for _, kind, record, version in sorted(written)]

    def _observed(self, record: Record, now: float) -> float:
        """When ``record``'s data was observed, on the store's clock (a record without its
        observation time was observed at its commit)."""
        return (record.observed_at + self._observation_offset()
                if record.observed_at is not None else now)

    def _insert_records(self, cur: Any, rows: list[tuple[Any, ...]], now: float,
                        run_id: int) -> set[str]:
        """Insert new records, ``rows`` of (record ID, source, natural key, item type, data,
        content hash, request key, seen_seq, observed_at) in record ID order; a record ID
        another worker inserted meanwhile is not inserted. Returns the record IDs inserted.
        One statement each here; a backend may send them as one."""
        inserted: set[str] = set()
        for rid, source, natural_key, item_type, data, content_hash, request_key, seq, \
                observed in rows:
            if cur.execute(self._q(
                    "INSERT INTO records (record_id, source, natural_key, item_type, data,"
                    " content_hash, first_seen, last_changed, first_run_id, changed_run_id,"
                    " request_key, seen_run_id, seen_at, seen_seq, observed_at, version)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)"
                    " ON CONFLICT (record_id) DO NOTHING RETURNING record_id"),
                    (rid, source, natural_key, item_type, data, content_hash, now, now, run_id,
                     run_id, request_key, run_id, now, seq, observed)).fetchone() is not None:
                inserted.add(rid)
        return inserted

    def _upsert_record(self, cur: Any, record: Record, request_key: str | None, run_id: int,
                       now: float, observed: float, seq: int, known: dict[str, StoredState],
                       result: CommitResult) -> tuple[str, int] | None:
        """Write one stored record as :func:`.rules.record_write` decides, marking it seen
        in ``run_id`` as its ``seq``-th record when the run sees it first; ``known`` holds
        the rows read (and locked) so far, this record's included. Returns the change stored
        (kind, version), if any."""
        rid = record.record_id
        current = known[rid]
        decision = record_write(current, record.content_hash, observed, run_id)
        if decision is RecordWrite.UPDATE:
            cur.execute(self._q(
                "UPDATE records SET data = ?, content_hash = ?, item_type = ?,"
                " last_changed = ?, changed_run_id = ?, request_key = ?, observed_at = ?,"
                " version = version + 1,"
                " seen_at = CASE WHEN seen_run_id = ? THEN seen_at ELSE ? END,"
                " seen_seq = CASE WHEN seen_run_id = ? THEN seen_seq ELSE ? END,"
                " seen_run_id = ? WHERE record_id = ?"),
                (record.data, record.content_hash, record.item_type, now, run_id, request_key,
                 observed, run_id, now, run_id, seq, run_id, rid))
        elif decision is RecordWrite.SEEN:
            cur.execute(self._q("UPDATE records SET seen_run_id = ?, seen_at = ?,"
                                " seen_seq = ?, observed_at = ? WHERE record_id = ?"),
                        (run_id, now, seq, observed, rid))
        elif decision is RecordWrite.OBSERVED:
            # the same data observed later: an older observation must not replace it
            cur.execute(self._q("UPDATE records SET observed_at = ? WHERE record_id = ?"),
                        (observed, rid))
        if decision.stale:
            result.records_stale += 1
        elif decision is RecordWrite.UPDATE:
            result.records_updated += 1
        else:
            result.records_unchanged += 1
        known[rid] = after_write(current, decision, record.content_hash, observed, run_id)
        return (decision.value, current.version + 1) if decision.change else None

    def _write_state(self, cur: Any, changes: list[StateChange]) -> None:
        """Apply the spider's state ``changes`` to the stored state (its ``meta`` row, made
        first if missing, locked where rows are: the commits of several workers apply
        theirs one after the other)."""
        cur.execute(self._q("INSERT INTO meta (key, value) VALUES ('spider_state', '{}')"
                            " ON CONFLICT (key) DO NOTHING"))
        [(raw,)] = self._lookup(
            cur, f"SELECT value FROM meta WHERE key = 'spider_state'{self.LOCK_ROWS}")
        state = apply_state_changes(json.loads(raw), changes)
        cur.execute(self._q("UPDATE meta SET value = ? WHERE key = 'spider_state'"),
                    (json.dumps(state, ensure_ascii=False, separators=(",", ":")),))

    def _record_keys(self, cur: Any, keys: list[RecordKey | None], now: float,
                     result: CommitResult) -> None:
        """Record the natural keys of the record types of new records, unless known to be
        recorded (the first record of a type records them; a type recorded already keeps
        its keys: a crawl keyed otherwise was refused at its open)."""
        stored = self._record_types_stored()
        missing = {key.record_type: key for key in keys
                   if key is not None and key.record_type not in stored}
        if not missing:
            return
        cur.executemany(self._q(
            "INSERT INTO record_keys (record_type, item_type, fields, recorded_at)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (record_type) DO NOTHING"),
            [(key.record_type, key.item_type, json.dumps(list(key.fields)), now)
             for _, key in sorted(missing.items())])
        result.record_keys_added.extend(sorted(missing))

    def _write_outbox(self, cur: Any, changes: list[tuple[str, Record, int]],
                      targets: tuple[str, ...], now: float, run_id: int,
                      result: CommitResult) -> None:
        """One outbox entry per change and target, in the transaction of the change."""
        cur.executemany(self._q(
            "INSERT INTO outbox (target, idempotency_key, kind, record_id, content_hash,"
            " item_type, source, natural_key, data, run_id, created_at, due_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
            [(target, change_key(record, version), kind, record.record_id,
              record.content_hash, record.item_type, record.source, record.natural_key,
              record.data, run_id, now, now)
             for kind, record, version in changes for target in targets])
        result.outbox_entries += len(changes) * len(targets)

    def _complete(self, cur: Any, completions: list[Completion], lost: set[str], worker: str,
                  now: float) -> Callable[[], set[str]]:
        """Send the completions whose lease is ``worker``'s and end the journal entry of
        each; the answer: the keys whose lease they ended (:meth:`_completed` counts)."""
        live = [done for done in completions if done.key not in lost]
        keys = {done.key for done in live}
        # the terminal ones at once, unless a key is completed twice (then all in order: the
        # first ends the lease, the next finds it ended)
        batch = len(keys) == len(live)
        finishing: list[Completion] = []
        sent: list[Answer] = []
        for done in live:
            if batch and done.state is not RequestState.PENDING:
                finishing.append(done)
            else:
                sent.append(self._send_completion(cur, done, worker, now))
        if finishing:
            sent.append(self._send_finishes(cur, finishing, worker, now))
        self._end_journal(cur, keys - {done.key for done in finishing}, worker)
        return lambda: {self._key_read(row[0]) for answer in sent for row in answer()}

    def _end_journal(self, cur: Any, keys: Collection[str], worker: str) -> None:
        """Delete the journaled responses of ``keys`` whose lease was just ended. Only the
        lease holder's completion ends the journal entry: the rows were fenced (this
        worker's leases), so each key the completions reached is no longer leased to it."""
        if keys:
            where, param = self._any("key", sorted(keys))
            cur.execute(self._q(f"DELETE FROM responses WHERE {where} AND NOT EXISTS"
                                " (SELECT 1 FROM requests q WHERE q.key = "
                                f"{self.KEY_OF_TEXT.format(c='responses.key')}"
                                "  AND q.state = 'leased' AND q.worker = ?)"), (param, worker))

    def _send_completion(self, cur: Any, done: Completion, worker: str, now: float) -> Answer:
        """Send one completion on the request ``worker`` leases; the answer: its key, if
        reached."""
        where = " WHERE key = ? AND state = 'leased' AND worker = ? RETURNING key"
        if done.state is RequestState.PENDING:  # a continuation: the request is replaced
            # (its row's URL not known here: stored unpacked, as text)
            data = "" if done.data is None else f" {self.DATA_SET},"
            return self._send(
                cur, "UPDATE requests SET state = 'pending', worker = NULL,"
                f" leased_until = NULL, unfinished = 0,{data}"
                " priority = COALESCE(?, priority), error_kind = ?, error_message = ?" + where,
                (*(() if done.data is None else self._stored_data(done.data, None)),
                 done.priority, done.error_kind, done.error_message, self._key(done.key),
                 worker))
        return self._send(
            cur, "UPDATE requests SET state = ?, worker = NULL, leased_until = NULL,"
            " unfinished = 0, finished_at = ?, error_kind = ?, error_message = ?" + where,
            (done.state.value, now, done.error_kind, done.error_message, self._key(done.key),
             worker))

    def _send_finishes(self, cur: Any, finishing: list[Completion], worker: str,
                       now: float) -> Answer:
        """Send the terminal completions of ``finishing`` (one per key) on the requests
        ``worker`` leases and end their journal entries; the answer: the keys reached. One
        statement each here; a backend may send them as one."""
        sent = [self._send_completion(cur, done, worker, now) for done in finishing]
        self._end_journal(cur, [done.key for done in finishing], worker)
        return lambda: [row for answer in sent for row in answer()]

    @staticmethod
    def _completed(completions: list[Completion], reached: set[str],
                   result: CommitResult) -> None:
        """Count the completions, in their order: one whose lease it ended (the first of a
        key), or one lost (not this worker's lease, or the key completed again)."""
        counted: set[str] = set()
        for done in completions:
            if done.key in reached and done.key not in counted:
                counted.add(done.key)
                result.completed[done.state.value] = (
                    result.completed.get(done.state.value, 0) + 1)
            else:
                result.leases_lost += 1
                result.lost.append(done.key)

    def _claim(self, cur: Any, worker: str, count: int, now: float,
               result: CommitResult) -> None:
        """Lease up to ``count`` requests; those started too often without finishing are
        failed as ``quarantined`` instead (:func:`.rules.split_claim`). The claim's times
        are read here, inside the transaction (its locks held: a wait for them does not
        age them), with the monotonic clock beside (:attr:`.CommitResult.claimed_at`)."""
        now = max(now, self.clock())
        result.claimed_at = (now, time.monotonic())
        until = now + self.lease_seconds
        send_by: dict[Any, float] = {}  # row id -> when it must be sent (slots with a delay)
        slots: dict[Any, str] = {}  # row id -> its slot (claimed by the slots' limits)
        rows = (self._claim_rows(cur, worker, count, until) if self.slot_limits is None
                else self._claim_by_slot(cur, worker, count, until, now, result, send_by,
                                         slots))
        unreadable: dict[str, str] = {}  # key -> why its stored request cannot be read
        rows = [self._claimed_row(row, unreadable) for row in rows]
        leased, over = split_claim(rows, self.max_attempts, until)
        if unreadable:
            leased = [dataclasses.replace(r, unreadable=unreadable[r.key])
                      if r.key in unreadable else r for r in leased]
        if slots:
            by_key = {row[1]: (send_by.get(row[0], 0.0), slots[row[0]]) for row in rows}
            leased = [dataclasses.replace(r, send_by=by_key[r.key][0], slot=by_key[r.key][1])
                      for r in leased]
        if over:
            cur.executemany(self._q(
                "UPDATE requests SET state = 'failed', worker = NULL, leased_until = NULL,"
                " attempts = attempts - 1, unfinished = 0, finished_at = ?,"
                " error_kind = 'quarantined',"
                " error_message = ? WHERE key = ?"),
                [(now, quarantine_message(r.unfinished), self._key(r.key)) for r in over])
            result.quarantined.extend(r.url for r in over)
        result.leased.extend(leased)

    def _claimed_row(self, row: Sequence[Any], unreadable: dict[str, str]) -> tuple[Any, ...]:
        """A claimed row as read (:data:`.rules.CLAIMED_COLUMNS`) with its key and fingerprint
        as Python holds them and its request's JSON text; "" for a row whose packed request
        cannot be read back (damaged on disk), its reason kept in ``unreadable`` by its key:
        that one request fails, the claim and the crawl go on."""
        key = self._key_read(row[_KEY])
        try:
            data = self._request_data(row[_DATA], row[_URL], key)
        except PackedRequestError as exc:
            unreadable[key] = str(exc)
            data = ""
        return (row[0], key, self._key_read(row[_FINGERPRINT]), *row[_FINGERPRINT + 1:_DATA],
                data, *row[_DATA + 1:])

    # -- frontier reads -------------------------------------------------------------------

    def journaled_response(self, key: str) -> tuple[str, bytes] | None:
        rows = self._crawl_select("SELECT data, body FROM responses WHERE key = ?", (key,))
        return (rows[0][0], bytes(rows[0][1])) if rows else None

    def pending_at_least(self, count: int) -> bool:
        found = self._crawl_select(
            "SELECT count(*) FROM (SELECT 1 FROM requests WHERE state = 'pending' LIMIT ?)"
            " AS ahead", (count,))[0][0]
        return bool(found >= count)

    def counts(self) -> dict[str, int]:
        # Exact, in one statement (one snapshot), without reading the rows: every count but
        # done's is answered by a partial index of its state (the few failed and redirected
        # requests, the pending and leased ones), the total by the table's smallest index;
        # done is the rest. A state outside RequestState (only a hand-edited row: `check`
        # reports it) is counted as done. A GROUP BY state read every row: 5 s and more at
        # five million requests, on the writer's thread at each progress line.
        total, pending, leased, failed, redirected, records = (int(n) for n in self._crawl_select(
            "SELECT (SELECT count(*) FROM requests),"
            " (SELECT count(*) FROM requests WHERE state = 'pending'),"
            " (SELECT count(*) FROM requests WHERE state = 'leased'),"
            " (SELECT count(*) FROM requests WHERE state = 'failed'),"
            " (SELECT count(*) FROM requests WHERE state = 'redirected'),"
            " (SELECT count(*) FROM records)")[0])
        return {RequestState.PENDING.value: pending, RequestState.LEASED.value: leased,
                RequestState.DONE.value: total - pending - leased - failed - redirected,
                RequestState.FAILED.value: failed, RequestState.REDIRECTED.value: redirected,
                "records": records}
