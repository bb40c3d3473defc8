"""The store interface: what the frontier, leases, runs and records need from a database.

Plain values in, typed values out (frozen dataclasses, no backend's types); nothing here
imports Scrapy or a database driver. Errors are :class:`~.StoreError`, and
:class:`~.StoreBusy` the one worth retrying. :class:`~.SQLiteStore` is the embedded
implementation; :func:`~.open_store` chooses a backend from the database string. Every backend
passes the same contract tests (``tests/test_store_contract.py`` and the other tests taking
the ``store_factory`` fixture), which read state through this interface only.

Transaction guarantees every implementation gives:

* :meth:`FrontierStore.commit` applies one :class:`UnitOfWork` in ONE transaction: new
  requests, records, rejects, completions and the lease claim are all durable together, or
  none is. This is how "done is the last write" holds: a completion is never committed before
  the records and child requests its response produced.
* With :attr:`UnitOfWork.outbox_targets`, every record the transaction inserts or changes
  gets one outbox entry per target in the same transaction (see :class:`OutboxEntry`): a
  stored change is always announced, and a change that is not stored never is.
* Records: one row per record ID, written only when its content changed (or, unchanged, to
  mark it seen by a run or observed later). A record is never replaced by data observed
  before the stored data (:attr:`Record.observed_at`, compared with the stored one; equal
  times: the later commit wins): such a write is refused, changes nothing, announces
  nothing and is counted (:attr:`CommitResult.records_stale`). Observations are ordered by
  run first (data of a later run is never older than what an earlier run stored, whatever
  any clock says), then by observation time within the run, on the store's time line
  (workers stamp them with :func:`observation_clock`, which a stepped wall clock does not
  move; a backend puts them on its own time line, see :meth:`FrontierStore.commit`). Every
  stored change adds one
  to the record's ``version`` (1 when inserted), which is part of the outbox key.
* A completion deletes the response journaled for its request in the same transaction.
* Enqueue is idempotent by request key: a key already in the frontier is not inserted again,
  whatever its state.
* A lease is held by one worker; a claim never returns a request leased by another worker
  whose lease has not expired.
"""

from __future__ import annotations

import contextlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from ..exceptions import StoreError
from .reads import (
    CrawlMetrics,
    EngineSetting,
    FailedRequest,
    FeedMark,
    FrontierEntry,
    IntegrityReport,
    LeaseHolder,
    OutboxBacklog,
    OutboxRow,
    RejectedItem,
    RejectsRetried,
    RepeatedRequest,
    RequestSummary,
    RetriedFailed,
    RevisitReport,
    RunRecord,
    RunSummary,
    RunTotals,
    Sample,
    SchemaInfo,
    SeqRecord,
    SessionInfo,
    StoredRecord,
)
from .values import (
    CommitResult,
    Completion,
    CrawlIdentity,
    FrontierStatus,
    LeasedRequest,
    NewRequest,
    OutboxEntry,
    OutboxOutcome,
    OutboxState,
    PageValidators,
    Reclaimed,
    Record,
    RecordKey,
    RecordMove,
    Reject,
    Rekey,
    RequestState,
    RevisitBounds,
    RobotsTxt,
    RunInfo,
    RunMode,
    SlotLimits,
    SlotState,
    StateChange,
    StoredIdentity,
    UnitOfWork,
    change_key,
    observation_clock,
    url_glob_matches,
)

__all__ = [
    "CommitResult",
    "Completion",
    "CrawlIdentity",
    "CrawlMetrics",
    "EngineSetting",
    "FailedRequest",
    "FeedMark",
    "FrontierEntry",
    "FrontierStatus",
    "FrontierStore",
    "IntegrityReport",
    "LeaseHolder",
    "LeasedRequest",
    "NewRequest",
    "OutboxBacklog",
    "OutboxEntry",
    "OutboxOutcome",
    "OutboxRow",
    "OutboxState",
    "PageValidators",
    "Reclaimed",
    "Record",
    "RecordKey",
    "RecordMove",
    "Reject",
    "RejectedItem",
    "RejectsRetried",
    "Rekey",
    "RepeatedRequest",
    "RequestState",
    "RequestSummary",
    "RetriedFailed",
    "RevisitBounds",
    "RevisitReport",
    "RobotsTxt",
    "RunInfo",
    "RunMode",
    "RunRecord",
    "RunSummary",
    "RunTotals",
    "Sample",
    "SchemaInfo",
    "SeqRecord",
    "SessionInfo",
    "SlotLimits",
    "SlotState",
    "StateChange",
    "StoredIdentity",
    "StoredRecord",
    "UnitOfWork",
    "change_key",
    "observation_clock",
    "url_glob_matches",
]

class FrontierStore(ABC):
    """A durable frontier with leases, plus the records table. See the module docstring."""

    #: the run this worker's session belongs to (set by :meth:`begin_session`; a commit
    #: that joins a newer run moves it), None before a session
    run_id: int | None = None
    #: unix seconds on the store's time line (a backend's: the database server's clock)
    clock: Callable[[], float]

    def frontier_id(self) -> str:
        """The id this database's frontier got at its first open: random, unique to the
        database (a PostgreSQL schema), never copied by ``migrate`` (a copy gets its own).
        What names things kept outside the database for this frontier (the Redis set of
        :mod:`~scrapy_idempotent.redis_dedup`). Raises :class:`~.StoreError` before
        :meth:`open`."""
        found = self.meta().get("frontier_id")
        if not found:
            raise StoreError("the frontier has no id yet: open the store first")
        return found

    @abstractmethod
    def open(self, *, fingerprinter: str, identity: CrawlIdentity | None = None,
             record_id_scheme: str | None = None) -> str | None:
        """Create or migrate the schema. Returns the fingerprinter recorded at creation when
        it differs from ``fingerprinter`` (request keys may not match), else None.

        ``identity`` is recorded at creation (or at the first open of a database made before
        identities existed); a database of another identity is refused. So is
        ``record_id_scheme`` (how the caller derives record IDs, as ``meta`` key
        ``record_id_scheme``; a database made before it was recorded holds the first
        scheme's records): a database whose records have another scheme is refused (None:
        not checked). Raises
        :class:`~.StoreError` for a corrupt, unreadable, newer-schema or foreign database,
        or another crawl's, before anything in it is changed; :class:`~.StoreBusy` when
        another process holds it locked too long (worth retrying)."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def begin_session(self, worker: str, run_mode: RunMode) -> RunInfo:
        """Join the current run or start a new one (see :class:`RunMode`). A new run clears
        the frontier and keeps the records."""

    @abstractmethod
    def end_session(self, worker: str, reason: str, inflight: Sequence[str] = (), *,
                    finish_run: bool = True) -> int:
        """Release the worker's leases; mark the run finished when ``reason`` is
        ``finished``, ``finish_run`` is true (false: work of the close, such as the feeds,
        failed and must be done again) and nothing is pending or leased. ``inflight``: keys
        the worker started and gives back unfinished at a clean stop; they did not kill it,
        so they are not suspects (their unfinished count is taken back). Returns the leases
        released."""

    @abstractmethod
    def commit(self, work: UnitOfWork, worker: str) -> CommitResult:
        """Apply ``work`` in one transaction (see the module docstring)."""

    @abstractmethod
    def journaled_response(self, key: str) -> tuple[str, bytes] | None:
        """The ``(data, body)`` journaled for ``key``, if any (a commit's
        :attr:`UnitOfWork.responses` journals them)."""

    @abstractmethod
    def pending_at_least(self, count: int) -> bool:
        """Whether the frontier holds at least ``count`` pending entries (all workers'): a
        read bounded by ``count``, outside any transaction, on the reads' connection (never
        waits for the writer; raises StoreBusy while it cannot read at once)."""

    @abstractmethod
    def known_request(self, fingerprint: str, *, key: str | None = None) -> str | None:
        """How a commit would count an ordinary request (``filter_fingerprint``) of this
        fingerprint if it were committed now: ``"duplicate"`` (pending or leased),
        ``"already_done"``, or None when it would be added, or be due again. A read outside
        any transaction, to skip encoding rediscovered links; the commit decides again.
        With ``key``, the entry of exactly that key (a ``dont_filter`` request, which the
        fingerprint does not filter)."""

    def remembered_request(self, fingerprint: str) -> str | None:
        """:meth:`known_request`'s answer for ``fingerprint`` when this worker's memory of
        known entries holds it (no read), else None: not remembered, which says nothing of
        the frontier (ask :meth:`known_request`). The default remembers nothing."""
        return None

    def expect_lookups(self, fingerprints: Collection[str]) -> None:
        """:meth:`known_request` will soon be asked about ``fingerprints`` (the links of a
        page, seen before they are enqueued): a store may read them in one statement when
        the first of them is asked. The default does nothing."""
        return None

    def known_keys(self, keys: Collection[str]) -> dict[str, str]:
        """:meth:`known_request` by key for each of ``keys`` (the ``dont_filter`` start
        requests a restarted ``start()`` yields again, checked in batches): each known key's
        answer; a key absent from the result is unknown. One read for the batch where the
        store can (this default asks key by key)."""
        answers = {key: self.known_request(key, key=key) for key in keys}
        return {key: answer for key, answer in answers.items() if answer is not None}

    @abstractmethod
    def status(self, worker: str) -> FrontierStatus: ...

    @abstractmethod
    def renew_leases(self, worker: str) -> list[str]:
        """Extend every unexpired lease of ``worker`` to the lease time from now. Returns the
        keys renewed: a lease of the worker's that is not among them expired (another worker
        may take it, or already did) and must not be handed out or worked on further."""

    @abstractmethod
    def release_leases(self, workers: list[str]) -> int:
        """Put the leases of ``workers`` back to pending at once (dead workers: their slots
        are paused as :meth:`reclaim_leases` says). Returns how many."""

    @abstractmethod
    def reclaim_expired(self) -> int:
        """Put leases whose time is up back to pending. Returns how many."""

    @abstractmethod
    def reclaim_leases(self, dead: Sequence[str] = (), *, expired: bool = True,
                       is_dead: Callable[[str], bool] | None = None,
                       starting: bool = False) -> Reclaimed:
        """In one transaction, put back to pending the leases of the ``dead`` workers and,
        with ``expired``, those whose time is up (:meth:`reclaim_expired`). ``is_dead``: the
        workers holding leases are read first (on the calling thread's connection: the
        writer's), and those it says are dead are added to ``dead``; without ``expired``,
        nothing is written when none is. With the crawl's limits (:meth:`keep_slot_limits`),
        every download slot of such a lease is paused for
        :attr:`SlotLimits.dead_worker_pause_seconds` from now on the store's clock, unless a
        longer pause is stored: a worker that died may have got a 429 it could not write.
        :meth:`release_leases` and :meth:`reclaim_expired` pause so too. With ``starting``
        (a worker's take-back at its start, its session begun), not when no other worker
        of the crawl is alive: a lone worker's restart, silent toward every site since the
        kill, sends as any restart does."""

    @abstractmethod
    def reclaim_space(self, *, everything: bool = False) -> int:
        """Give the space of deleted rows (journaled responses of completed requests, an
        emptied frontier) back to the file system, when there is enough of it to matter or
        with ``everything``; with ``everything`` also empty the write-ahead log. In bounded
        steps, so that the write lock is never held long. Returns the bytes given back (0 when
        there was nothing to do)."""

    def watch_for_work(self, callback: Callable[[], object]) -> bool:
        """Call ``callback()`` (from another thread) whenever another worker may have made
        requests claimable (new requests, leases given back), until :meth:`close`. Calls
        may be grouped (one for several changes) and may come when nothing is claimable
        after all; none may come for a change, so the caller still polls, less eagerly.
        Returns False when this store cannot tell (the default): the caller polls."""
        return False

    def never_wait_here(self, never: bool = True) -> None:
        """From now on (``never`` false: no longer) the calling thread never waits for the
        database to come back: a store that lost its connection raises :class:`~.StoreBusy`
        at once on this thread and reconnects on another. The scheduler's reads on the
        reactor thread while the writer thread runs. The default does nothing (a store
        whose reads do not reconnect)."""
        return None

    @abstractmethod
    def lease_holders(self) -> list[LeaseHolder]: ...

    # -- conditional requests -------------------------------------------------------------
    #: claims load the validators of the pages they lease (LeasedRequest.validators)
    claims_load_validators: bool = False

    #: adaptive revisits: the bounds of each page's revisit interval (None: off, every
    #: page is due in every run)
    revisit_bounds: RevisitBounds | None = None

    def load_validators_with_claims(self, on: bool, *,
                                    revisit: RevisitBounds | None = None) -> None:
        """Whether claims load the validators of the pages they lease, for conditional
        requests (:setting:`IDEMPOTENT_CONDITIONAL_REQUESTS`); with ``revisit``, page
        commits keep each page's revisit interval and claims say whether it is due
        (:setting:`IDEMPOTENT_ADAPTIVE_REVISIT`)."""
        self.claims_load_validators = on
        self.revisit_bounds = revisit if on else None

    # -- download slots (politeness for the whole crawl) ----------------------------------
    #: the limits claims keep per slot; None: claims take the head of the frontier whatever
    #: its slots (each worker keeps Scrapy's own limits)
    slot_limits: SlotLimits | None = None

    def keep_slot_limits(self, limits: SlotLimits | None) -> None:
        """Claim by ``limits`` from now on (None: the frontier's head, whatever its slots).
        A backend that keeps slots also writes them into every slot it holds: the crawl's
        limits are those of the worker that started last."""
        self.slot_limits = limits

    def pause_slot(self, slot: str, *, retry_after: float | None, first_seconds: float,
                   max_seconds: float, jitter: float = 0.0) -> float:
        """A site answered ``slot``'s request with 429 or 503: pause the slot for every
        worker (one transaction, durable when this returns): for ``retry_after`` seconds
        when the site said (at most ``max_seconds``), else ``first_seconds`` doubled with
        every such answer in a row (``backoffs``), at most ``max_seconds``, lengthened by up
        to ``jitter`` of itself. A pause never shortens one already longer. Returns the
        seconds paused from now (0: a store that keeps no slots pauses nothing)."""
        return 0.0

    def slot_answered(self, slot: str) -> None:
        """``slot`` answered normally again: its next 429 or 503 starts from the first
        pause (its ``backoffs`` back to 0)."""
        return None

    def set_slot_delay(self, slot: str, delay_seconds: float) -> None:
        """Keep ``delay_seconds`` (robots.txt's ``Crawl-delay``) as ``slot``'s own delay:
        claims keep the longer of it and the configured delay."""
        return None

    def slots(self) -> list[SlotState]:
        """Every download slot with requests leased or pending, or paused (operator read),
        the busiest first."""
        return []

    # -- robots.txt (the crawl's, not a process's) ------------------------------------------

    @abstractmethod
    def robots_txt(self, netloc: str) -> RobotsTxt | None:
        """The robots.txt kept for the site ``netloc``, however old (None: never kept)."""

    @abstractmethod
    def keep_robots_txt(self, netloc: str, url: str, status: int, body: bytes, *,
                        max_age_seconds: float) -> RobotsTxt:
        """Keep a robots.txt just fetched for ``netloc`` (one transaction), unless the store
        holds one younger than ``max_age_seconds`` (another worker fetched it meanwhile:
        theirs is kept, so every worker applies the same rules). Returns the robots.txt kept
        now: this one, or the other worker's."""

    @abstractmethod
    def counts(self) -> dict[str, int]:
        """Frontier entries by state value, plus ``records``."""

    def unfinished(self) -> bool:
        """Whether any request is pending or leased (all workers'): what a close asks to know
        whether the crawl finished, without counting the frontier. This one counts."""
        counts = self.counts()
        return bool(counts[RequestState.PENDING.value] or counts[RequestState.LEASED.value])

    def shared_counts(self, max_age: float) -> tuple[dict[str, int], float]:
        """:meth:`counts` as the crawl's workers share them, with their age in seconds: a
        backend whose count is slow on a large frontier keeps one, and answers with it
        while it is younger than ``max_age`` (another worker's, or this one's), instead of
        counting again. This one counts each time (age 0)."""
        return self.counts(), 0.0

    # -- the outbox ------------------------------------------------------------------------

    @abstractmethod
    def claim_outbox(self, targets: Sequence[str], limit: int, hold_seconds: float, *,
                     exclude: Collection[int] = ()) -> list[OutboxEntry]:
        """Up to ``limit`` pending entries of ``targets`` that are due (never tried, or their
        retry time has come), oldest first, except the entry ids in ``exclude`` (deliveries
        of the caller still in flight), each held for ``hold_seconds`` (one transaction): no
        other claim returns them meanwhile. An entry whose holder died is due again when the
        hold ends, so a delivery may be repeated (at least once), never lost. Each entry's
        :attr:`~OutboxEntry.held_until` is the claim's token for :meth:`settle_outbox`."""

    @abstractmethod
    def settle_outbox(self, outcomes: Sequence[OutboxOutcome]) -> list[OutboxOutcome]:
        """Record delivery outcomes in one transaction: delivered and failed entries are
        final (a later outcome for them changes nothing); a pending outcome counts one
        attempt and makes the entry due at ``retry_at``. The record data of a delivered
        entry is dropped (its key, kind and record ID are kept). An outcome with a
        ``held_until`` token changes its entry only while the entry is still held by that
        claim (a late outcome of a claim whose hold ended and was claimed again changes
        nothing). Returns the outcomes that changed an entry, in the order given."""

    @abstractmethod
    def outbox_next_due(self, targets: Sequence[str]) -> float | None:
        """When the next pending entry of ``targets`` is due (unix seconds, the store's
        clock; in the past when one is due now), or None when none is pending."""

    @abstractmethod
    def outbox_counts(self) -> dict[str, dict[str, int]]:
        """Outbox entries by target, then by state value (every state, zero included)."""

    def outbox_backlog(self) -> dict[str, OutboxBacklog]:
        """Pending outbox entries by target: how many, and when the oldest was written
        (targets with none are left out)."""
        return {}

    @abstractmethod
    def outbox_entries(self, *, after: int | None = None, limit: int = 1000) -> list[OutboxRow]:
        """Outbox entries in the order they were written, the first ``limit`` after entry
        ``after`` (keyset paging by ``entry_id``)."""

    # -- operator queries -------------------------------------------------------------------
    # What the ``scrapy idempotent`` commands (``scrapy_idempotent/commands/``) read and
    # change: the typed values above. Failed-request filters: ``kinds`` matches an error kind
    # exactly or as a prefix ending at a ``/`` (``download_error`` matches
    # ``download_error/TimeoutError``); ``url_glob`` is the glob of :func:`url_glob_matches`
    # on the whole URL; ``url_regex`` a regular expression searched in the URL (Python
    # syntax).

    @abstractmethod
    def open_existing(self, *, readonly: bool = True,
                      identity: CrawlIdentity | None = None) -> SchemaInfo:
        """Open a database that already exists, without creating, migrating or otherwise
        changing it (not even an engine setting), read-only unless ``readonly`` is False.
        Before opening it for writing, refuse (untouched) a database that is not this
        package's or, with ``identity``, that belongs to another crawl, as :meth:`open` does.
        Returns the schema version found and supported. Raises :class:`~.StoreError` when
        there is no database there or it cannot be read."""

    @abstractmethod
    def entry(self, key: str) -> FrontierEntry | None:
        """The frontier entry of ``key``, None when there is none."""

    @abstractmethod
    def entries(self, *, after: str | None = None, limit: int = 1000) -> list[FrontierEntry]:
        """Frontier entries in key order, the first ``limit`` after key ``after`` (keyset
        paging, as :meth:`records_page`)."""

    @abstractmethod
    def engine_settings(self) -> list[EngineSetting]:
        """The settings of the database engine the store relies on, as found (``check``
        reports one whose value is not the expected one)."""

    @abstractmethod
    def meta(self) -> dict[str, str]:
        """The ``meta`` table: ``fingerprinter``, ``created_at`` (unix seconds as text), ..."""

    @abstractmethod
    def runs(self) -> list[RunSummary]:
        """Every run, oldest first."""

    @abstractmethod
    def run_totals(self, run_id: int, *, spider_errors: bool = False) -> RunTotals:
        """Run ``run_id``'s counters as committed, summed over every session (one indexed
        read, outside any transaction; a crawl makes it beside its writer). With
        ``spider_errors`` also the failed entries of the frontier whose callback raised (a
        count over the failed entries)."""

    @abstractmethod
    def sessions(self) -> list[SessionInfo]:
        """Every session (one per crawl process), oldest first."""

    @abstractmethod
    def request_summary(self) -> RequestSummary: ...

    @abstractmethod
    def failure_counts(self) -> dict[str, int]:
        """Failed entries by error kind ("" for none), most frequent first (ties by kind)."""

    @abstractmethod
    def repeated_requests(self, limit: int) -> list[RepeatedRequest]:
        """Entries leased more than once, most attempts first (ties in enqueue order)."""

    @abstractmethod
    def failed_requests(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                        url_regex: str | None = None,
                        limit: int | None = None) -> list[FailedRequest]:
        """Failed entries matching the filters, latest failure first, at most ``limit``."""

    @abstractmethod
    def count_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> int:
        """How many failed entries match the filters."""

    @abstractmethod
    def retry_failed(self, *, kinds: list[str] | None = None, url_glob: str | None = None,
                     url_regex: str | None = None) -> RetriedFailed:
        """Put the failed entries matching the filters back to pending, in one transaction:
        error kind and message, finish time and attempts are reset. When any was put back and
        the last run is finished, the run is reopened (its ``finished_at`` and ``reason``
        cleared) so that the next crawl in run mode ``auto`` resumes it instead of starting a
        new run over an emptied frontier."""

    @abstractmethod
    def records_page(self, *, after: str | None = None, limit: int = 1000,
                     changed_since: float | None = None,
                     changed_since_run: int | None = None) -> list[StoredRecord]:
        """Records in record-ID order, the first ``limit`` after record ID ``after`` (keyset
        paging: pass the last ``record_id`` of a page to get the next), optionally only those
        inserted or changed at or after ``changed_since`` or in run ``changed_since_run`` or a
        later one."""

    @abstractmethod
    def run_records(self, run_id: int) -> Iterator[RunRecord]:
        """Every record inserted, updated or seen unchanged in run ``run_id`` (what the run's
        feeds hold), in the order the run first stored or saw them (ties by record ID).
        Streamed by pages, with no read transaction held between them (the caller may write
        to the store while it iterates): memory does not grow with the table; a record the
        run stores meanwhile comes after those already read."""

    @abstractmethod
    def feed_base(self, run_id: int, uri: str, size: int) -> int:
        """The size in bytes an appended feed ``uri`` had before run ``run_id`` first wrote
        to it: ``size`` is recorded (one transaction) the first time it is asked for that run
        and feed, and the recorded size is returned then and later."""

    @abstractmethod
    def store_feed(self, run_id: int, uri: str, level: int,
                   replace: Callable[[], object]) -> bool:
        """Fence of a feed's stores: in one transaction, unless a version of feed ``uri`` of
        run ``run_id`` at a higher ``level`` was stored already (a newer snapshot: more
        items, or the complete feed of the finished run), record ``level`` as the stored one
        and call ``replace()`` (which puts this version in place, a rename) inside the
        transaction, so that stores of several crawl processes are applied one at a time
        and an older version never replaces a newer one. True when stored; False (nothing
        done) when a newer version was stored. An exception from ``replace`` rolls back.
        The level is kept in the ``feeds`` table, under the key ``"stored " + uri``."""

    #: The records' sequence of first sight in a run (``seen_seq``) is in commit order: a
    #: record committed after another has a higher one, so a feed can be written while the
    #: crawl runs by following the sequence (:meth:`stream_feed`). False where concurrent
    #: transactions take numbers out of commit order (PostgreSQL's sequences).
    STREAMS_FEEDS: bool = False

    def stream_feed(self, run_id: int, key: str, worker: str, *, lease_seconds: float,
                    base: Callable[[], int], holder_gone: Callable[[str], bool],
                    write: Callable[[FeedMark, Callable[[int, int], list[SeqRecord]]],
                                    FeedMark],
                    release: bool = False) -> FeedMark | None:
        """Write the next part of streamed feed ``key`` of run ``run_id`` as ``worker``.

        The feed's row (table ``feeds``, under ``key``) is created first, in a transaction
        of its own, with ``base()`` (the size of the file before the run) as its mark, so the
        base is durable before anything is written. Then, in one write transaction: the feed
        is claimed for ``worker`` until ``lease_seconds`` from now unless another worker
        holds it (its claim unexpired and ``holder_gone(holder)`` false: None is returned,
        nothing done); ``write(mark, fetch)`` writes the file from the durable ``mark`` on
        (``fetch(after_seq, limit)``: the run's records with a higher sequence, in sequence
        order) and returns the new mark once the file is synced; the new mark is recorded.
        An exception from ``write`` rolls back (the mark stays). ``release``: the claim is
        given up at the end (a closing worker). Only where :attr:`STREAMS_FEEDS`."""
        raise NotImplementedError("this store does not stream feeds")

    @abstractmethod
    def rejects(self, *, run_id: int | None = None, pending_only: bool = False,
                limit: int | None = None) -> list[RejectedItem]:
        """Rejected items, latest first (of run ``run_id``; with ``pending_only`` those not
        put back yet), at most ``limit``."""

    @abstractmethod
    def count_rejects(self, *, run_id: int | None = None, pending_only: bool = False) -> int:
        """How many rejected items match, as :meth:`rejects` filters them."""

    @abstractmethod
    def retry_rejects(self) -> RejectsRetried:
        """Put the pages of the last run's rejected items that were not put back yet back to
        pending (their attempts, finish time and error reset), mark those rejects as put
        back, and reopen the run if it had finished (as :meth:`retry_failed`), in one
        transaction."""

    # -- record identity (``scrapy idempotent rekey``) --------------------------------------

    def spider_state(self) -> Any:
        """The spider's ``state`` as committed (tagged-JSON values; ``{}`` before any)."""
        raw = self.meta().get("spider_state")
        return json.loads(raw) if raw else {}

    @abstractmethod
    def record_keys(self) -> list[RecordKey]:
        """The natural keys recorded per record type (by the first record of each), sorted
        by record type."""

    @abstractmethod
    def stored_identities(self, after: str | None = None, batch: int = 5000
                          ) -> list[StoredIdentity]:
        """At most ``batch`` stored records in record ID order, after ``after`` (paging),
        as re-identifying them reads them."""

    @abstractmethod
    def rekey(self, change: Rekey) -> None:
        """Apply ``change`` in one transaction (see :class:`Rekey`): all of it or nothing.
        Raises :class:`~.StoreError` when the records are not the ``change.records`` that
        were read (a crawl wrote meanwhile)."""

    def rekey_cleanup(self) -> list[str]:
        """The file paths a committed :meth:`rekey` left to remove (see
        :class:`Rekey`); empty when none."""
        raw = self.meta().get("rekey_cleanup")
        return list(json.loads(raw)) if raw else []

    @abstractmethod
    def end_rekey_cleanup(self) -> None:
        """Forget the file paths of :meth:`rekey_cleanup`: they were removed."""

    # -- moving a crawl to another database (``scrapy idempotent migrate``) -----------------
    #: The tables :meth:`dump` yields, in the order :meth:`load` takes them.
    DUMP_TABLES = ("meta", "runs", "sessions", "requests", "records", "rejects", "feeds",
                   "responses", "outbox", "samples", "record_keys", "robots",
                   "page_validators", "linked_requests")

    def dump(self, batch: int = 1000) -> Iterator[tuple[str, list[dict[str, object]]]]:
        """Every row of the crawl, as ``(table, rows)`` batches of at most ``batch`` rows in
        :data:`DUMP_TABLES` order; rows are dicts of plain values keyed by the SQLite
        store's column names (``responses.body`` is bytes). Each batch is read by one
        statement: read inside :meth:`frozen` for one consistent copy (else a commit landing
        between two batches is half in it). Raises :class:`~.StoreError` for a backend that
        cannot be read this way."""
        raise StoreError(f"{type(self).__name__} cannot be migrated from")
        yield  # pragma: no cover

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Inside the block, nothing is committed to this store by anyone else, and its reads
        (:meth:`dump`) see one state: the copy of a migration, which also ends inside the
        block, so that nothing lands in the source after the copy and before the target has
        it. Writers of other processes wait meanwhile (and give up after their busy timeout).
        Opened with ``open_existing(readonly=False)``; nothing is written. Raises
        :class:`~.StoreBusy` when another process holds the write lock past the busy
        timeout, :class:`~.StoreError` for a backend that cannot be migrated from."""
        raise StoreError(f"{type(self).__name__} cannot be migrated from")
        yield  # pragma: no cover

    def mark_migrated(self, to: str) -> bool:
        """Inside :meth:`frozen`, once the copy is in ``to`` (shown as in logs, no password):
        mark this database migrated there, committed when the block ends, so that nothing
        lands here after the copy; :meth:`open` refuses a crawl of it from then on, naming
        ``to``, until :meth:`unmark_migrated`. False: this backend keeps no such mark."""
        return False

    def unmark_migrated(self) -> str | None:
        """Forget the mark of :meth:`mark_migrated` (crawls of this database are allowed
        again); returns where it was migrated to, None when it was not marked."""
        return None

    def crawl_metrics(self) -> CrawlMetrics:
        """The figures of the whole crawl as stored (all workers, whatever became of their
        processes), for monitoring (``scrapy idempotent metrics``). Only reads; each part is
        one of the operator reads, so it costs what they cost together (a few passes over
        the frontier's indexes)."""
        counts = self.counts()
        records = counts.pop("records")
        return CrawlMetrics(
            read_at=time.time(), requests=counts, records=records, runs=tuple(self.runs()),
            failures=self.failure_counts(), summary=self.request_summary(),
            leases=tuple(self.lease_holders()), live_workers=tuple(self.live_workers()),
            outbox=self.outbox_counts(), outbox_backlog=self.outbox_backlog(),
            heartbeats=self.heartbeats(), revisits=self.revisits())

    def revisits(self) -> RevisitReport | None:
        """The pages kept for conditional requests and adaptive revisits, and what the
        latest run saved with them (None: this store keeps no pages)."""
        return None

    def heartbeats(self) -> dict[str, float]:
        """Each live worker's latest heartbeat (unix seconds), for a store whose sessions
        beat one (PostgreSQL); empty for one without (SQLite: liveness is the pid)."""
        return {}

    def record_sample(self, interval: float, *, final: bool = False) -> bool:
        """Store the current run's counters as its sample of the slot of ``interval``
        seconds that now falls in, unless a worker stored that slot's already (with
        ``final``, replace it: the run's last figures). True when written."""
        return False

    def samples(self, run_id: int) -> list[Sample]:
        """The samples of run ``run_id`` (:meth:`record_sample`), oldest first."""
        return []

    def live_workers(self) -> list[str]:
        """The workers whose sessions still run (not ended, and not known dead): a crawl of
        this store in progress, even one holding no lease at the moment."""
        return sorted({h.worker for h in self.lease_holders()})

    def load(self, batches: Iterator[tuple[str, list[dict[str, object]]]]) -> dict[str, int]:
        """Write :meth:`dump` output into this store, opened and empty (no runs, requests
        or records yet), in one transaction: all of it, or nothing. Leases do not move:
        a leased request arrives pending. Returns the rows written per table. Raises
        :class:`~.StoreError` when the store is not empty or cannot be loaded."""
        raise StoreError(f"{type(self).__name__} cannot be migrated to")

    @abstractmethod
    def integrity_check(self) -> IntegrityReport:
        """The database engine's own consistency check."""

    @abstractmethod
    def anomalies(self) -> dict[str, int]:
        """Counts of rows in states the package never writes, by check name (zero included):
        ``unknown_state``, ``leased_without_owner``, ``owner_without_lease``,
        ``finished_without_time``, ``unfinished_with_time``, ``failed_without_kind``,
        ``finished_never_leased``, ``orphan_journal``, ``record_times``."""
