"""What the operator queries return: the read types of the ``scrapy idempotent`` commands.

Apart from the write interface (:mod:`.base`, which re-exports them): frozen dataclasses of
plain values, read by :class:`~.FrontierStore`'s operator queries and by nothing that writes.
Times are unix seconds (float), None where there is none. States are text as stored
(``pending``, ``done``...): a damaged database may hold a state the package never writes, and
the operator commands must still show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CrawlMetrics",
    "EngineSetting",
    "FailedRequest",
    "FeedMark",
    "FrontierEntry",
    "IntegrityReport",
    "LeaseHolder",
    "OutboxBacklog",
    "OutboxRow",
    "RejectedItem",
    "RejectsRetried",
    "RepeatedRequest",
    "RequestSummary",
    "RetriedFailed",
    "RevisitReport",
    "RunRecord",
    "RunSummary",
    "RunTotals",
    "Sample",
    "SchemaInfo",
    "SeqRecord",
    "SessionInfo",
    "StoredRecord",
]


@dataclass(frozen=True)
class OutboxRow:
    """An outbox entry as stored (:meth:`FrontierStore.outbox_entries`)."""

    entry_id: int
    target: str
    key: str  #: the idempotency key
    kind: str
    record_id: str
    state: str  #: an :class:`OutboxState` value
    attempts: int
    detail: str | None  #: the last outcome's detail
    data: str | None  #: None once delivered (the record data is dropped then)


@dataclass(frozen=True)
class SchemaInfo:
    """The schema of a database opened with :meth:`FrontierStore.open_existing`."""

    version: int  #: as found in the database
    supported: int  #: the version this scrapy_idempotent reads and writes

    @property
    def current(self) -> bool:
        return self.version == self.supported


@dataclass(frozen=True)
class EngineSetting:
    """A setting of the database engine the store relies on, as found (SQLite's journal mode
    must be ``wal``); ``expected`` None: shown, never a problem."""

    name: str  #: ``journal_mode``
    label: str  #: ``journal mode``, as shown to a user
    value: str  #: as found, lower case
    expected: str | None = None

    @property
    def ok(self) -> bool:
        return self.expected is None or self.value == self.expected


@dataclass(frozen=True)
class IntegrityReport:
    """The database engine's own consistency check."""

    method: str  #: how it was checked (``PRAGMA integrity_check``)
    problems: tuple[str, ...] = ()  #: what it found, empty when nothing

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class RunSummary:
    """A run, with counters cumulative over all its sessions."""

    run_id: int
    started_at: float
    finished_at: float | None  #: None while unfinished
    reason: str | None
    leased: int
    done: int
    failed: int
    redirected: int
    records_inserted: int
    records_updated: int
    records_unchanged: int
    rejects: int  #: items kept in the rejects table during the run
    records_stale: int = 0  #: records refused: the stored one was observed later
    leases_reclaimed: int = 0  #: leases taken back from expired or dead workers
    leases_lost: int = 0  #: completions refused: their lease was another worker's by then


@dataclass(frozen=True)
class RunTotals:
    """What run ``run_id`` has committed so far, every worker and every session of it
    together (:meth:`~.FrontierStore.run_totals`): what the run-wide ``CLOSESPIDER_*``
    limits and the ``idempotent/run/...`` stats count. A page killed before its commit
    counts nothing (it is fetched again and counted then)."""

    run_id: int
    done: int = 0
    failed: int = 0
    redirected: int = 0
    records_inserted: int = 0
    records_updated: int = 0
    records_unchanged: int = 0
    records_stale: int = 0
    #: failed entries whose callback or errback raised (error kind ``spider_error/...``);
    #: None when not read (a count over the failed entries)
    spider_errors: int | None = None

    @property
    def pages(self) -> int:
        """Requests completed: done, failed or redirected."""
        return self.done + self.failed + self.redirected

    @property
    def items(self) -> int:
        """Items that passed every pipeline and reached the store: records inserted,
        updated, unchanged, or refused as stale (Scrapy's ``item_scraped`` of them)."""
        return (self.records_inserted + self.records_updated + self.records_unchanged
                + self.records_stale)


@dataclass(frozen=True)
class SessionInfo:
    """A session: one crawl process's part of a run. ``ended_at`` and ``reason`` are None
    when the process never closed (it is still running, or it was killed)."""

    session_id: int
    run_id: int
    worker: str
    started_at: float
    ended_at: float | None
    reason: str | None


@dataclass(frozen=True)
class RequestSummary:
    """Over the whole frontier."""

    requests: int
    leases: int  #: sum of attempts
    repeated: int  #: entries leased more than once
    most_attempts: int
    expired_leases: int  #: leased, lease time over
    journaled_responses: int
    replays: int  #: attempts answered from the response journal
    downloads: int  #: requests sent to the network (see :attr:`FrontierEntry.downloads`)
    downloaded_again: int  #: entries sent to the network more than once


@dataclass(frozen=True)
class RepeatedRequest:
    key: str
    url: str
    state: str
    attempts: int
    worker: str | None
    error_kind: str | None


@dataclass(frozen=True)
class FailedRequest:
    key: str
    url: str
    error_kind: str | None
    error_message: str | None
    attempts: int
    finished_at: float | None
    parent_key: str | None
    run_id: int


@dataclass(frozen=True)
class RetriedFailed:
    """What :meth:`FrontierStore.retry_failed` did."""

    retried: int  #: entries put back to pending
    run_id: int | None  #: the last run, None when there is none
    reopened: bool  #: the last run was finished and is open again


@dataclass(frozen=True)
class RejectsRetried:
    """What :meth:`FrontierStore.retry_rejects` did."""

    pages: int  #: entries put back to pending
    rejects: int  #: rejects marked as put back
    without_page: int  #: rejects whose page is not in the frontier, or unknown
    run_id: int | None
    reopened: bool


@dataclass(frozen=True)
class StoredRecord:
    """A record as :meth:`FrontierStore.records_page` returns it; ``natural_key`` and
    ``data`` are JSON text (the codec's tagged JSON)."""

    record_id: str
    source: str
    natural_key: str
    item_type: str
    data: str
    first_seen: float
    last_changed: float
    first_run_id: int
    changed_run_id: int
    content_hash: str = ""  #: sha256 hex of the data without volatile fields
    request_key: str | None = None  #: of the request whose response last wrote it
    version: int = 1  #: the record's change counter: 1 when inserted, +1 per change stored
    observed_at: float | None = None  #: when the stored data was last observed


@dataclass(frozen=True)
class FrontierEntry:
    """One request of the frontier, as stored (:meth:`FrontierStore.entry`)."""

    key: str
    fingerprint: str
    url: str
    state: str
    priority: int
    is_start: bool
    data: str  #: the request as JSON text
    parent_key: str | None
    worker: str | None  #: the lease holder while leased
    leased_until: float | None
    attempts: int  #: times started since it was last (re)queued by an operator
    #: times started in a row without finishing (the worker died, or the lease expired)
    unfinished: int
    replays: int  #: attempts answered from the response journal
    enqueued_at: float
    finished_at: float | None
    error_kind: str | None
    error_message: str | None
    run_id: int
    #: times it was sent to the network (each recorded with the transaction after it)
    downloads: int = 0


@dataclass(frozen=True)
class RunRecord:
    """A record of a run's feeds (:meth:`FrontierStore.run_records`)."""

    record_id: str
    item_type: str
    data: str  #: JSON text
    first_seen: float
    last_changed: float


@dataclass(frozen=True)
class SeqRecord:
    """A record of a run with its sequence of first sight (:meth:`FrontierStore.stream_feed`)."""

    record: RunRecord
    seq: int


@dataclass(frozen=True)
class FeedMark:
    """How far a streamed feed is durably written (:meth:`FrontierStore.stream_feed`): the
    file of batch ``batch_id`` holds, up to byte ``offset``, one entry per accepted record of
    the run up to sequence ``seq`` (a record's number of first sight in the run). Bytes past
    ``offset`` (a format's closing bytes, or what a killed writer left) are cut before the
    file is written again."""

    #: the last record sequence (``seen_seq``) written or passed over (not accepted)
    seq: int = 0
    #: the file's size after the entry of ``seq``
    offset: int = 0
    #: the batch (``%(batch_id)d``) being written
    batch_id: int = 1
    #: entries in the file of ``batch_id``
    items: int = 0
    #: the sequence of the first entry in that file (0: none yet)
    first_seq: int = 0
    #: entries in every batch of the feed
    total: int = 0
    #: the size the first file had before the run wrote to it (an appended feed's old part)
    base: int = 0


@dataclass(frozen=True)
class RejectedItem:
    id: int
    item_type: str
    reason: str
    data: str  #: JSON text
    request_key: str | None
    page_url: str | None
    created_at: float
    run_id: int
    retried_at: float | None  #: when its page was put back, None if not yet
    page_state: str | None  #: of the page's frontier entry, None when not in the frontier


@dataclass(frozen=True)
class LeaseHolder:
    worker: str
    leases: int
    leased_until: float  #: latest expiry among its leases, unix seconds


@dataclass(frozen=True)
class Sample:
    """A run's counters as they were at ``at`` (:meth:`~.FrontierStore.samples`), one per
    slot of ``IDEMPOTENT_SAMPLE_SECONDS``: cumulative over every worker of the run."""

    run_id: int
    at: float
    leased: int
    done: int
    failed: int
    redirected: int
    records_inserted: int
    records_updated: int
    records_unchanged: int
    records_stale: int
    leases_reclaimed: int
    leases_lost: int
    in_flight: int  #: requests leased (their claims counted in ``leased``), not completed yet


@dataclass(frozen=True)
class OutboxBacklog:
    """Outbox entries of one target waiting for delivery."""

    entries: int  #: pending entries
    oldest_at: float  #: when the oldest of them was written (unix seconds)


@dataclass(frozen=True)
class RevisitReport:
    """The pages kept for conditional requests and adaptive revisits
    (:meth:`~.FrontierStore.revisits`), as of ``read_at`` (unix seconds, the store's clock).

    ``pages``: pages kept; ``scheduled``: those with a revisit time (pages that yield
    records, with :setting:`IDEMPOTENT_ADAPTIVE_REVISIT`); ``due``: the scheduled pages whose
    revisit is due now; ``next_due_at``: the earliest revisit time not due yet (None: none).
    For run ``run_id`` (the latest run): ``fetched`` pages downloaded in full,
    ``not_modified`` pages confirmed unchanged by a ``304`` (or a sitemap's ``lastmod``),
    ``not_due`` pages not fetched at all (their revisit not due), and ``bytes_saved``: the
    bodies of the pages not downloaded in full, at their size when last downloaded."""

    read_at: float
    pages: int
    scheduled: int
    due: int
    next_due_at: float | None
    run_id: int | None
    fetched: int
    not_modified: int
    not_due: int
    bytes_saved: int

    @property
    def requests_saved(self) -> int:
        """The requests the run did not send (pages not due)."""
        return self.not_due


@dataclass(frozen=True)
class CrawlMetrics:
    """The crawl-wide figures of :meth:`~.FrontierStore.crawl_metrics`: what every worker
    (live, finished or killed) committed, read in one call. Times are unix seconds."""

    read_at: float  #: the store's clock when read
    requests: dict[str, int]  #: frontier entries by state (every state, 0 included)
    records: int  #: records stored
    runs: tuple[RunSummary, ...]  #: every run, oldest first (counters over all sessions)
    failures: dict[str, int]  #: failed entries by error kind ('' when none was recorded)
    summary: RequestSummary  #: attempts, repeats, downloads, expired leases
    leases: tuple[LeaseHolder, ...]  #: leases held, by worker
    live_workers: tuple[str, ...]  #: workers whose sessions still run
    outbox: dict[str, dict[str, int]]  #: target -> state -> entries
    #: target -> its pending entries (targets with none are left out)
    outbox_backlog: dict[str, OutboxBacklog] = field(default_factory=dict)
    #: worker -> its latest heartbeat (unix seconds), for stores with heartbeats
    heartbeats: dict[str, float] = field(default_factory=dict)
    #: the pages kept for conditional requests and revisits (None: the store keeps none)
    revisits: RevisitReport | None = None
