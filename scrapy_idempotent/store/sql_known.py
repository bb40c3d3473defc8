"""The known-request memory of the SQL store: :class:`SqlKnownRequests` (mixed into
:class:`~.sql.SqlStore`) answers whether a request is known (:meth:`~.FrontierStore.known_request`,
:meth:`~.FrontierStore.known_keys`), most often from memory (:class:`_KnownEntries`) or from
one read of the links a page is about to enqueue (:class:`_LookupBatch`)."""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any, cast

from .base import CommitResult, RequestState, UnitOfWork
from .rules import TERMINAL, Enqueue, known_request_answer, window_start
from .sql_dialect import SqlDialect

__all__ = ["KNOWN_DONE_ENTRIES", "KNOWN_PENDING_ENTRIES", "KNOWN_PENDING_SECONDS",
           "LOOKUP_BATCH", "LOOKUP_BATCH_SECONDS", "SqlKnownRequests"]

#: How many finished entries :meth:`SqlStore.known_request` keeps in memory (about 150 bytes
#: each): most links a crawl rediscovers lead to pages already done, answered without a read.
KNOWN_DONE_ENTRIES = 50_000
#: How many entries known to be pending or leased :meth:`SqlStore.known_request` keeps in
#: memory: the requests this worker added, and those it read so; the links a crawl
#: rediscovers before their page is done.
KNOWN_PENDING_ENTRIES = 50_000
#: For how long (seconds, on the store's clock) an entry remembered as pending or leased is
#: answered so without a read: another worker may finish it meanwhile (then the answer is
#: ``duplicate`` where a read would say ``already_done``: the link is refused all the same).
#: The worker's own completions update the memory at once.
KNOWN_PENDING_SECONDS = 5.0
#: At most this many fingerprints expected to be looked up soon (:meth:`SqlStore.expect_lookups`)
#: are read in one statement.
LOOKUP_BATCH = 500
#: For how long (seconds, on the store's clock) the answers of such a read are used: the links
#: of a page are enqueued right after the page's callback yielded them.
LOOKUP_BATCH_SECONDS = 1.0
_UNKNOWN = object()


class _KnownEntries:
    """The entries :meth:`SqlStore.known_request` answers from memory, of one run: finished
    ones (fingerprint -> finished_at; at most :data:`KNOWN_DONE_ENTRIES`) and those pending
    or leased (fingerprint -> when it was known so; at most :data:`KNOWN_PENDING_ENTRIES`,
    each for :data:`KNOWN_PENDING_SECONDS`). Read on the reactor's thread, updated there
    and on the writer's (after each commit), under a lock."""

    def __init__(self, run_id: int | None) -> None:
        self.run_id = run_id
        self.done: dict[str, float | None] = {}
        self.pending: dict[str, float] = {}
        self._lock = threading.Lock()

    def answer(self, fingerprint: str, now: float, window: float | None) -> object:
        """``known_request``'s answer from memory, or ``_UNKNOWN`` (read it)."""
        with self._lock:
            if fingerprint in self.done:
                answer = known_request_answer(RequestState.DONE.value,
                                              self.done[fingerprint], window)
                if answer is not None:
                    return answer
                del self.done[fingerprint]  # due again: the commit puts it back
                return _UNKNOWN
            since = self.pending.get(fingerprint)
            if since is not None:
                if now - since < KNOWN_PENDING_SECONDS:
                    return Enqueue.DUPLICATE.value
                del self.pending[fingerprint]
        return _UNKNOWN

    def learn(self, fingerprint: str, state: str, finished_at: float | None, now: float, *,
              own_key: bool) -> None:
        """Remember what a read found: a done entry; a pending or leased one when its key is
        the fingerprint (the completion that ends it names that key, see :meth:`finished`;
        another entry of the fingerprint, a ``dont_filter`` request's, is read each time)."""
        if state == RequestState.DONE.value:
            self.finished([(fingerprint, RequestState.DONE)], now, finished_at)
        elif own_key and state not in TERMINAL:
            self.pending_now([fingerprint], now)

    def pending_now(self, fingerprints: list[str], now: float) -> None:
        """Remember ``fingerprints`` as pending or leased at ``now``."""
        if not fingerprints:
            return
        with self._lock:
            pending = self.pending
            for fingerprint in fingerprints:
                pending.pop(fingerprint, None)  # (its place: the newest)
                pending[fingerprint] = now
            while len(pending) > KNOWN_PENDING_ENTRIES:
                del pending[next(iter(pending))]  # the oldest

    def finished(self, entries: list[tuple[str, RequestState]], now: float,
                 finished_at: float | None = None) -> None:
        """Entries finished (key, state): no longer pending; the done ones done since
        ``finished_at`` (default ``now``)."""
        with self._lock:
            for key, state in entries:
                self.pending.pop(key, None)
                if state is RequestState.DONE:
                    self.done[key] = now if finished_at is None else finished_at
            while len(self.done) > KNOWN_DONE_ENTRIES:
                del self.done[next(iter(self.done))]  # the oldest


class _LookupBatch:
    """Fingerprints :meth:`SqlStore.known_request` expects to be asked about (read in one
    statement when the first of them is), and the answers of the last such read
    (fingerprint -> (state, finished_at), None for unknown; each used once). The reactor's
    thread only."""

    def __init__(self) -> None:
        self.expected: set[str] = set()
        self.read: dict[str, tuple[str, Any] | None] = {}
        self.read_at = 0.0


class SqlKnownRequests(SqlDialect):
    """Whether a request is known to the frontier, answered from memory where it can be (a
    mixin of ``SqlStore``)."""

    def known_request(self, fingerprint: str, *, key: str | None = None) -> str | None:
        # Most lookups are answered from memory (see _KnownEntries): a fingerprint found
        # done stays done in this run (the crawl moves no entry out of done but one due
        # again, which the window check below sees); one found pending or leased, or added
        # by this worker, is answered so for KNOWN_PENDING_SECONDS, or until this worker
        # finishes it. Operators' retries (done pages of rejected items put back) are
        # fetched all the same: a stale answer only refuses a known link.
        if key is None:
            known = self._known_entries()
            now = self.clock()
            window = window_start(self.recrawl_seconds, now)
            answer = known.answer(fingerprint, now, window)
            if answer is not _UNKNOWN:
                return cast("str | None", answer)
            batch = self._lookups
            if fingerprint in batch.expected:
                self._read_expected(batch, now)
            if fingerprint in batch.read and now - batch.read_at < LOOKUP_BATCH_SECONDS:
                row = batch.read.pop(fingerprint)
                return None if row is None else known_request_answer(row[0], row[1], window)
            # by key when its key is its fingerprint, else by the fingerprint index
            rows = self._crawl_select(
                "SELECT state, finished_at, key FROM requests WHERE key = ? UNION ALL"
                " SELECT * FROM (SELECT state, finished_at, key FROM requests"
                "  WHERE fingerprint = ? AND key <> fingerprint LIMIT 1) AS other LIMIT 1",
                (self._key(fingerprint), self._key(fingerprint)))
            if rows:
                known.learn(fingerprint, rows[0][0], rows[0][1], now,
                            own_key=self._key_read(rows[0][2]) == fingerprint)
        else:
            rows = self._crawl_select("SELECT state, finished_at FROM requests WHERE key = ?",
                                      (self._key(key),))
        if not rows:
            return None
        return known_request_answer(rows[0][0], rows[0][1],
                                    window_start(self.recrawl_seconds, self.clock()))

    def remembered_request(self, fingerprint: str) -> str | None:
        now = self.clock()
        answer = self._known_entries().answer(fingerprint, now,
                                              window_start(self.recrawl_seconds, now))
        return None if answer is _UNKNOWN else cast("str | None", answer)

    def expect_lookups(self, fingerprints: Collection[str]) -> None:
        batch = self._lookups
        known = self._known_entries()
        for fingerprint in fingerprints:
            if len(batch.expected) >= LOOKUP_BATCH:
                return
            if fingerprint not in known.done and fingerprint not in known.pending:
                batch.expected.add(fingerprint)

    @property
    def _lookups(self) -> _LookupBatch:
        batch: _LookupBatch | None = self.__dict__.get("_lookup_batch")
        if batch is None:
            batch = self.__dict__["_lookup_batch"] = _LookupBatch()
        return batch

    def _read_expected(self, batch: _LookupBatch, now: float) -> None:
        """Read the entries of the fingerprints expected to be looked up (see
        :meth:`expect_lookups`) in one statement, as :meth:`known_request` reads one; the
        answers replace those of the previous read."""
        fingerprints = sorted(batch.expected)
        batch.expected.clear()
        found: dict[str, tuple[str, Any, bool]] = {}
        by_key, keys = self._any_key("key", fingerprints)
        by_fingerprint, values = self._any_key("fingerprint", fingerprints)
        for stored, state, finished_at, own in self._crawl_select(
                f"SELECT key, state, finished_at, 1 FROM requests WHERE {by_key} UNION ALL"
                " SELECT fingerprint, state, finished_at, 0 FROM requests"
                f" WHERE {by_fingerprint} AND key <> fingerprint", (keys, values)):
            fingerprint = self._key_read(stored)
            if own or fingerprint not in found:  # the entry keyed by it first
                found[fingerprint] = (state, finished_at, bool(own))
        known = self._known_entries()
        batch.read = {}
        for fingerprint in fingerprints:
            row = found.get(fingerprint)
            batch.read[fingerprint] = None if row is None else (row[0], row[1])
            if row is not None:
                known.learn(fingerprint, row[0], row[1], now, own_key=row[2])
        batch.read_at = now

    def _known_entries(self) -> _KnownEntries:
        """What :meth:`known_request` remembers, of the current run only (a new run starts
        from another frontier)."""
        run_id = self.run_id
        held: _KnownEntries | None = self.__dict__.get("_known")
        if held is None or held.run_id != run_id:
            held = self.__dict__["_known"] = _KnownEntries(run_id)
        return held

    def _learn_known(self, work: UnitOfWork, result: CommitResult, now: float) -> None:
        """After ``work`` committed: the filtered requests it added (or found pending) are
        pending now, the entries it finished are done (remembered only when every request of
        the unit was added or found pending: an already done one is not told apart)."""
        known = self._known_entries()
        lost = set(result.lost)
        if not result.requests_already_done:
            known.pending_now([r.fingerprint for r in work.requests
                               if r.filter_fingerprint and r.key == r.fingerprint
                               and r.parent_key not in lost], now)
        finished = [(done.key, done.state) for done in work.completions
                    if done.state.terminal and done.key not in lost]
        if finished:
            known.finished(finished, now)

    def known_keys(self, keys: Collection[str]) -> dict[str, str]:
        if not keys:
            return {}
        where, param = self._any_key("key", list(keys))
        window = window_start(self.recrawl_seconds, self.clock())
        answers = {self._key_read(key): known_request_answer(state, finished_at, window)
                   for key, state, finished_at in self._crawl_select(
                       f"SELECT key, state, finished_at FROM requests WHERE {where}", (param,))}
        return {key: answer for key, answer in answers.items() if answer is not None}
