"""The values the store interface takes and gives (:mod:`.base`): the frontier's requests
and their states, a page's unit of work and what its commit did, records and their keys, the
outbox's entries, the download slots' limits and state, and the observation clock. Frozen
dataclasses and enums, no backend's types; the operator queries' read values are in
:mod:`.reads`."""

from __future__ import annotations

import enum
import fnmatch
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CommitResult",
    "Completion",
    "CrawlIdentity",
    "FrontierStatus",
    "LeasedRequest",
    "NewRequest",
    "OutboxEntry",
    "OutboxOutcome",
    "OutboxState",
    "PageValidators",
    "Reclaimed",
    "Record",
    "RecordKey",
    "RecordMove",
    "Reject",
    "Rekey",
    "RequestState",
    "RevisitBounds",
    "RobotsTxt",
    "RunInfo",
    "RunMode",
    "SlotLimits",
    "SlotState",
    "StateChange",
    "StoredIdentity",
    "UnitOfWork",
    "change_key",
    "observation_clock",
    "url_glob_matches",
]

_CLOCK_BASE = time.time() - time.monotonic()


def observation_clock() -> float:
    """Unix seconds that never step: this process's wall clock at its start, carried forward
    by the monotonic clock. Observation times (:attr:`Record.observed_at`) are taken on it,
    so a wall clock stepped back (or forward) while a worker runs does not reorder what the
    worker saw; a backend measures its offset to this clock, not to ``time.time()``."""
    return _CLOCK_BASE + time.monotonic()



class RequestState(str, enum.Enum):
    """States of a frontier entry: ``pending -> leased -> done | failed | redirected``.

    A leased entry whose lease expired (or whose worker is known dead) goes back to pending.
    """

    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"
    REDIRECTED = "redirected"  #: answered with a redirect; the target is its own entry

    @property
    def terminal(self) -> bool:
        return self in (RequestState.DONE, RequestState.FAILED, RequestState.REDIRECTED)


class OutboxState(str, enum.Enum):
    """States of an outbox entry: ``pending -> delivered | failed``."""

    PENDING = "pending"  #: not acknowledged yet (never sent, or to be sent again)
    DELIVERED = "delivered"  #: the target acknowledged it
    FAILED = "failed"  #: the target refused it for good (its answer is kept)


class RunMode(str, enum.Enum):
    """How a session joins the runs (``IDEMPOTENT_RUN_MODE``)."""

    AUTO = "auto"  #: resume an unfinished run, else start a new run
    RESUME = "resume"  #: always continue the last run (a finished run stays finished)
    FRESH = "fresh"  #: always start a new run (the frontier is cleared, records are kept)


@dataclass(frozen=True)
class CrawlIdentity:
    """Whose database it is: the project (Scrapy's ``BOT_NAME``), the spider name and the
    record source (``IDEMPOTENT_SOURCE``). Recorded at creation; another crawl is refused."""

    project: str
    spider: str
    source: str


@dataclass(frozen=True)
class NewRequest:
    """A request to add to the frontier. ``data`` is the request as JSON text.

    With ``filter_fingerprint`` the request is not added when any entry with the same
    fingerprint exists, whatever its key (a ``dont_filter`` start request for a URL makes a
    later ordinary link to that URL a duplicate).
    """

    key: str
    fingerprint: str
    url: str
    priority: int
    data: str
    parent_key: str | None = None
    is_start: bool = False
    filter_fingerprint: bool = True
    #: taken first-in-first-out within its priority and queue (start requests, or other
    #: requests, have their own queue); else last-in-first-out
    fifo: bool = False
    #: its download slot (Scrapy's slot key: the host name, its IP, or ``download_slot``
    #: meta); claims keep each slot's limits (:class:`SlotLimits`). ``""``: no limits
    slot: str = ""


@dataclass(frozen=True)
class LeasedRequest:
    """A request claimed by a worker. ``attempts`` counts the times it was claimed, this
    lease included (1 for a first attempt): the claim is written before the request goes to
    the downloader, so a download under way when a worker died counts; a claim given back
    unstarted is taken back."""

    key: str
    fingerprint: str
    data: str
    priority: int
    attempts: int
    #: it was in flight when a worker died, at two deaths or more (started, never
    #: finished): a likely cause, to be run alone. A request in flight at one death only is
    #: replayed at full concurrency with the rest (most kills are not its fault: a redeploy,
    #: the OOM killer); if it was the cause, the next death makes it a suspect, and then
    #: only it is in flight at the deaths that follow, until IDEMPOTENT_MAX_ATTEMPTS
    #: quarantines it.
    suspect: bool = False
    #: when the lease ends unless renewed (unix seconds, the store's clock)
    leased_until: float = field(default=0.0, compare=False)
    #: times it was sent to the network before this lease (not answered by the response
    #: journal or Scrapy's HTTP cache)
    downloads: int = 0
    #: it is in the start requests' queue (see :mod:`scrapy_idempotent._order`)
    is_start: bool = field(default=False, compare=False)
    #: a request of a download slot with a delay: handed to the downloader by then (unix
    #: seconds, the store's clock) or given back unsent, since the slot's next claim counts
    #: on it being sent by then (0: no such bound)
    send_by: float = field(default=0.0, compare=False)
    #: its download slot, when claimed by the crawl's slot limits ("" otherwise): a worker
    #: holds back what it claimed of a slot a site just paused
    slot: str = field(default="", compare=False)
    #: its place in its queue (same priority, same queue): a smaller rank is taken first.
    #: The entry's insertion order, negated for a last-in-first-out entry; so
    #: ``(-priority, is_start, rank)`` orders claimed requests as the claim order does
    rank: int = field(default=0, compare=False)
    #: the validators its page answered with when it was last done (claims load them only
    #: with :setting:`IDEMPOTENT_CONDITIONAL_REQUESTS`): None when none are kept
    validators: PageValidators | None = field(default=None, compare=False)
    #: why its stored request cannot be read back (a packed row damaged on disk: ``data``
    #: is then ""), else "": the worker fails it as ``unloadable`` instead of loading it,
    #: and the claim hands out the rest
    unreadable: str = field(default="", compare=False)


@dataclass(frozen=True)
class PageValidators:
    """What a page answered with, kept per done request for a later run's conditional
    request: its ``ETag`` and ``Last-Modified`` headers (text, as sent; None when absent) and
    the sha256 (hex) of its body. A page with neither header is sent unconditionally
    (``usable`` False), but a sitemap's ``lastmod`` may still skip it."""

    etag: str | None
    last_modified: str | None
    body_hash: str = ""
    #: when the page was last fetched or confirmed unchanged (unix seconds, the store's
    #: clock; 0 when not known): a sitemap's ``lastmod`` is compared with it
    fetched_at: float = field(default=0.0, compare=False)
    #: the size of its body when it was last downloaded in full (bytes; 0 when not known)
    body_bytes: int = field(default=0, compare=False)
    #: with adaptive revisits (:class:`RevisitBounds`): whether its revisit is due at the
    #: claim that loaded these (False: it is done as unchanged without being fetched)
    due: bool = field(default=True, compare=False)

    @property
    def usable(self) -> bool:
        """Whether a conditional request can be made from these."""
        return self.etag is not None or self.last_modified is not None


@dataclass(frozen=True)
class Completion:
    """The end of one leased request's processing.

    ``state`` is terminal, or :attr:`RequestState.PENDING` for a continuation (a retry of the
    same request), in which case ``data``/``priority`` replace the stored request.
    """

    key: str
    state: RequestState
    error_kind: str | None = None
    error_message: str | None = None
    data: str | None = None
    priority: int | None = None
    #: a done page's validators to keep (replacing the earlier ones, with the records and
    #: the new requests of its page); those of a page that did not end done are forgotten;
    #: None: nothing changes (the feature is off, or no 2xx answer came)
    validators: PageValidators | None = None
    #: the page answered ``304 Not Modified`` to a conditional request: it is done as
    #: unchanged, its stored records seen in this run and the requests it added when last
    #: fetched enqueued again
    not_modified: bool = False
    #: with ``not_modified``: the page was not fetched at all, its revisit not being due
    #: yet (:class:`RevisitBounds`): its validators and revisit time stay as they were
    not_due: bool = False
    #: with ``validators``: the keys of every request the page yielded, in the order
    #: yielded, those known already (added by another page, refused as duplicates) as well
    #: as those it added (the unit's requests whose parent it is, kept either way): a
    #: later ``304`` enqueues all of them again
    links: tuple[str, ...] = ()


@dataclass(frozen=True)
class RevisitBounds:
    """Adaptive revisits (:setting:`IDEMPOTENT_ADAPTIVE_REVISIT`): each page that yields
    records has a revisit interval of its own, within ``[min_seconds, max_seconds]``, halved
    when its records changed since its last fetch and doubled when they did not
    (:func:`.rules.next_revisit`); a later run fetches it only once the interval has passed
    since the start of the run that last fetched it or confirmed it unchanged."""

    min_seconds: float
    max_seconds: float

    @property
    def early_seconds(self) -> float:
        """How early a revisit counts as due (a tenth of the shortest interval), so that a
        run started a little before its schedule (cron jitter, a slow start) does not leave
        a page for the run after."""
        return self.min_seconds / 10


@dataclass(frozen=True)
class RecordKey:
    """How the records of one record type are identified, as the database records it with
    the type's first record: ``record_type`` (the name in their record IDs), ``item_type``
    (``module.QualName`` of the item class that stored it first) and ``fields``, the natural
    key fields (empty: none configured, the page URL or the item's content)."""

    record_type: str
    item_type: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Record:
    """An item as it is stored: identity, type, data and content hash, and when the data
    was observed.

    ``observed_at`` is when the response the item came from was received (unix seconds, the
    worker's :func:`observation_clock`); None: when the record is committed. A stored record
    is never replaced by data observed before it in the same run, nor by data of an earlier
    run (see :meth:`FrontierStore.commit`)."""

    record_id: str
    source: str
    natural_key: str  #: JSON list of the natural key values
    item_type: str
    data: str  #: JSON object of the item's fields in its order (record ID field removed)
    content_hash: str  #: sha256 hex of the data without volatile fields
    observed_at: float | None = None
    #: the record type and natural key fields it was identified by (recorded in the
    #: database with the first record of its type; None: not recorded)
    key: RecordKey | None = None


@dataclass(frozen=True)
class StoredIdentity:
    """A stored record as re-identifying it reads it (:meth:`FrontierStore.stored_identities`):
    its identity and data, when it was observed and first seen, the order of its first sight
    in its run (``seen_seq``), the key of the request whose page stored it (None: an item of
    ``start()``) and that page's URL when the frontier still has that request (else None)."""

    record_id: str
    item_type: str
    natural_key: str
    data: str
    content_hash: str
    observed_at: float
    first_seen: float
    seen_seq: int
    request_key: str | None
    page_url: str | None


@dataclass(frozen=True)
class RecordMove:
    """One stored record given a new identity by :meth:`FrontierStore.rekey`: its new
    record ID and natural key, and (None: unchanged) its data and content hash (file paths
    named by the record ID) and its ``first_seen`` (the earliest of records merged into it)."""

    record_id: str
    new_record_id: str
    natural_key: str
    data: str | None = None
    content_hash: str | None = None
    first_seen: float | None = None


@dataclass(frozen=True)
class Rekey:
    """What :meth:`FrontierStore.rekey` writes in one transaction: the records ``moves``
    (to new IDs), the records ``merged`` into others (deleted; the outbox entries of each
    follow ``outbox`` too), ``outbox`` (stored record ID -> new one, for every record whose
    ID changes, merged ones included), ``keys`` (the record keys recorded from now on: they
    replace those recorded), ``scheme`` (the record ID scheme from now on), ``records`` (how
    many records were read: another count in the transaction means a crawl wrote meanwhile,
    and nothing is written) and ``cleanup`` (file paths to remove once this is committed,
    kept in the database until :meth:`FrontierStore.end_rekey_cleanup`)."""

    moves: tuple[RecordMove, ...]
    merged: tuple[str, ...]
    outbox: dict[str, str]
    keys: tuple[RecordKey, ...]
    scheme: str
    records: int
    cleanup: tuple[str, ...] = ()


def change_key(record: Record, version: int) -> str:
    """The idempotency key of the change that stored ``record`` as its ``version``-th
    version: ``<record_id>:<version>:<content_hash>`` (see :class:`OutboxEntry`)."""
    return f"{record.record_id}:{version}:{record.content_hash}"


@dataclass(frozen=True)
class OutboxEntry:
    """One announcement of a record change to one target, written by
    :meth:`FrontierStore.commit` in the transaction that stored the change.

    ``key`` is the idempotency key: ``<record_id>:<version>:<content_hash>``, with
    ``version`` the record's change counter (1 when inserted, one more with every stored
    change): the same for every delivery of this change (and for every target), and another
    for every other change, a change back to earlier content included; a receiver
    deduplicates by it.
    ``entry_id`` grows with every entry written (later changes have larger ids)."""

    entry_id: int
    target: str
    key: str
    kind: str  #: ``inserted`` or ``updated``
    record_id: str
    content_hash: str
    item_type: str
    source: str
    natural_key: str  #: JSON list of the natural key values
    data: str  #: the record's data (JSON object) as stored by this change
    run_id: int
    created_at: float  #: when the change was committed (unix seconds, the store's clock)
    attempts: int = 0  #: deliveries tried before this one
    #: the end of the hold the claim wrote (the store's clock); given back with the outcome
    #: (:attr:`OutboxOutcome.held_until`), it is the claim's token
    held_until: float = 0.0


@dataclass(frozen=True)
class OutboxOutcome:
    """What one delivery attempt of entry ``entry_id`` came to: ``DELIVERED``, ``FAILED``
    (refused for good), or ``PENDING`` with ``retry_at`` (unix seconds) for another try.
    ``detail`` is the target's answer (status and body) or the error, kept in the entry.
    ``held_until`` is the claim's token (:attr:`OutboxEntry.held_until`): the outcome is
    recorded only while the entry is still held by that claim; None: whatever holds it."""

    entry_id: int
    state: OutboxState
    detail: str = ""
    retry_at: float | None = None
    held_until: float | None = None


@dataclass(frozen=True)
class Reject:
    """An item that could not become a record (for example, no natural key)."""

    item_type: str
    reason: str
    data: str
    request_key: str | None
    page_url: str | None = None  #: URL of the page that produced the item, if known


@dataclass(frozen=True)
class StateChange:
    """One change of the spider's ``state`` dict (see :mod:`.spider_state`): at ``path``
    (the keys from the top), ``op`` is ``"add"`` (the number ``value`` added to the number
    there: counters of several workers add up), ``"set"`` (``value``, a tagged-JSON value,
    put there) or ``"delete"`` (the key removed)."""

    op: str
    path: tuple[str, ...]
    value: Any = None


@dataclass
class UnitOfWork:
    """Everything one transaction writes. ``claim`` asks for that many new leases;
    ``started`` lists leased requests the worker has handed to the engine since the last
    transaction (each counts one unfinished lease until it completes; its claim counted the
    attempt)."""

    requests: list[NewRequest] = field(default_factory=list)
    #: (record, key of the request that produced it)
    records: list[tuple[Record, str | None]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    #: (key, data, body) of raw responses to journal (requests still being processed)
    responses: list[tuple[str, str, bytes]] = field(default_factory=list)
    #: leased requests answered from the response journal since the last transaction (each
    #: attempt of theirs was not a download)
    replayed: list[str] = field(default_factory=list)
    #: leased requests sent to the network since the last transaction: a key once per
    #: sending (a retry's included), added to its ``downloads``
    downloaded: list[str] = field(default_factory=list)
    claim: int = 0
    #: requests the worker claimed ahead and never started, put back to pending before the
    #: claim, so that the claim takes the first requests in queue order, new ones included
    give_back: list[str] = field(default_factory=list)
    #: targets to announce every record inserted or changed by this unit to (one outbox
    #: entry per target and change); empty: no outbox entries
    outbox_targets: tuple[str, ...] = ()
    #: (change of the spider's state, key of the request whose callback made it; None: of
    #: no request), applied in order to the stored state (fenced as records are)
    state_changes: list[tuple[StateChange, str | None]] = field(default_factory=list)
    #: ``meta`` rows to write (key -> text; the cookie jars: :mod:`.cookies`)
    meta: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.requests or self.records or self.rejects or self.completions
                    or self.started or self.responses or self.replayed or self.downloaded
                or self.claim
                    or self.give_back or self.state_changes or self.meta)


@dataclass
class CommitResult:
    """What a :meth:`FrontierStore.commit` did. Counts are of this transaction only."""

    requests_added: int = 0
    requests_duplicate: int = 0  #: key already pending or leased
    requests_already_done: int = 0  #: key already in a terminal state
    requests_due_again: int = 0  #: terminal in an earlier recrawl window: pending again
    records_inserted: int = 0
    records_updated: int = 0
    records_unchanged: int = 0
    #: inserts that met the unique index because another worker inserted the same record ID
    #: meanwhile (they became updates, or nothing): the duplicate rate of concurrent workers
    records_conflicts: int = 0
    #: records refused because the stored one was observed later (a page downloaded earlier
    #: but committed later): nothing of them was written
    records_stale: int = 0
    #: the latest observation time (the store's clock) of the records this transaction
    #: wrote, or found stored newer; None without records
    observed_max: float | None = field(default=None, compare=False)
    rejects: int = 0
    completed: dict[str, int] = field(default_factory=dict)  #: state value -> count
    leases_lost: int = 0  #: completions whose lease was not this worker's: nothing written
    #: keys of those completions (their records, rejects, children were not written either)
    lost: list[str] = field(default_factory=list, compare=False)
    leased: list[LeasedRequest] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)  #: URLs failed as quarantined
    outbox_entries: int = 0  #: outbox entries written (changes x targets)
    #: record types whose natural keys this transaction recorded (their first record)
    record_keys_added: list[str] = field(default_factory=list, compare=False)
    #: the run this worker moved to with this transaction: its own run was finished by
    #: another worker and a newer one started meanwhile (None: it stays in its run)
    run_id: int | None = None
    #: the claim took fewer than asked because slots were paused or waiting out their
    #: delay: seconds until the first of them may send again (None: none waits)
    claim_again_in: float | None = None
    #: slots this transaction added to the slots table (known to exist once committed)
    slots_added: list[str] = field(default_factory=list, compare=False)
    #: ``(store clock, time.monotonic())`` read together as the claim was made: the times
    #: of :attr:`leased` (``leased_until``, ``send_by``, on the store's clock) are turned
    #: into this host's monotonic clock with it (``t - store + monotonic``), so that a
    #: worker decides when a claimed request expires or is too late to send whatever its
    #: wall clock says (skewed from the database server's, or stepped); (0, 0) before a claim
    claimed_at: tuple[float, float] = field(default=(0.0, 0.0), compare=False)
    #: leases whose time was up that the claim took back first, their slots paused (with
    #: the crawl's limits: :meth:`~.FrontierStore.reclaim_leases`); None: none
    reclaimed: Reclaimed | None = None
    #: pages done as unchanged (``304 Not Modified``)
    pages_not_modified: int = 0
    #: requests of those pages' last fetches enqueued again (new, or due again, or known)
    requests_relinked: int = 0


@dataclass(frozen=True)
class SlotLimits:
    """The politeness a claim keeps per download slot, for the whole crawl (every worker's
    leases of a slot together): at most ``concurrency`` leased requests of a slot at once,
    and at least ``delay_seconds`` between two claims of one (a slot with a delay gives one
    request per claim). ``per_slot``: ``(slot, concurrency, delay_seconds)`` of the slots
    with their own (Scrapy's ``DOWNLOAD_SLOTS``); a concurrency or delay of None there is
    the default. The store also keeps a slot's own delay (robots.txt's ``Crawl-delay``,
    :meth:`FrontierStore.set_slot_delay`): the longer delay holds."""

    concurrency: int
    delay_seconds: float = 0.0
    per_slot: tuple[tuple[str, int | None, float | None], ...] = ()
    #: the pause a slot gets when the leases of a dead worker that held one of its requests
    #: are taken back (it may have got a 429 it could not write): the first backoff, from
    #: the take-back on (0: none)
    dead_worker_pause_seconds: float = 0.0


@dataclass(frozen=True)
class Reclaimed:
    """Leases put back to pending because nobody works on them any more
    (:meth:`~.FrontierStore.reclaim_leases`): ``released`` of the dead workers named,
    ``expired`` whose time was up (on PostgreSQL also those of workers whose heartbeat is
    stale), and with the crawl's limits the download slots paused in the same transaction
    because such a lease was of theirs (:attr:`SlotLimits.dead_worker_pause_seconds`), by
    the worker that held it (a slot already paused longer is not listed)."""

    released: int = 0
    expired: int = 0
    dead: tuple[str, ...] = ()  #: the dead workers whose leases were released
    paused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    paused_seconds: float = 0.0  #: how long each of those slots is paused from the take-back


@dataclass(frozen=True)
class SlotState:
    """A download slot as stored (:meth:`FrontierStore.slots`): its requests leased (in
    flight, all workers) and pending, when it may be sent to next, and the pause a site
    asked for (a 429 or 503) with the answers in a row that made it (``backoffs``)."""

    slot: str
    leased: int
    pending: int
    next_send_at: float  #: unix seconds, the store's clock
    paused_until: float  #: unix seconds; in the past when not paused
    backoffs: int
    crawl_delay: float  #: robots.txt's Crawl-delay for the slot (0: none)


@dataclass(frozen=True)
class RobotsTxt:
    """A site's robots.txt as the crawl keeps it (:meth:`FrontierStore.robots_txt`): the
    answer to ``/robots.txt`` of the site ``netloc`` (host, and port when given: the key of
    Scrapy's parsers), fetched once for the crawl and read by every worker and resume."""

    netloc: str
    url: str  #: the URL that answered (after redirects)
    status: int  #: its HTTP status
    body: bytes  #: the robots.txt as received (empty for a 4xx: everything is allowed)
    age_seconds: float  #: how long ago it was fetched, on the store's clock


@dataclass(frozen=True)
class FrontierStatus:
    """``claimable``: pending entries exist; ``leased_elsewhere``: other workers hold leases,
    or leases (this worker's included) have expired and can be reclaimed."""

    claimable: bool
    leased_elsewhere: bool


@dataclass(frozen=True)
class RunInfo:
    """The run a worker joined. ``new`` is True when this session started the run."""

    run_id: int
    new: bool
    counts: dict[str, int]


def url_glob_matches(glob: str, url: str) -> bool:
    """The operator queries' URL glob, the reference every backend follows (translating it
    into its own pattern language where it can): the whole URL matches, case-sensitively;
    ``*`` is any run of characters (``/`` included), ``?`` one character, ``[abc]`` and
    ``[a-z]`` one of a set, ``[!abc]`` one not in it; every other character, ``^`` and ``]``
    included, is itself. Python's :func:`fnmatch.fnmatchcase`."""
    return fnmatch.fnmatchcase(url, glob)
