"""In-flight tracking: which leased request produced which items and child requests.

:class:`InflightTracker` keeps, for every request the scheduler handed out and the engine
still works on, an :class:`InflightRequest`: what its processing produced (child requests,
records, rejects) and how it went (its outcome as the engine reported it). It is the
observer the engine hooks report to (:class:`~.engine_hooks.EngineObserver`), and the
collaborator the components use openly:

* ``RecordIdMiddleware`` marks start requests and attributes output (:meth:`track`);
* ``UpsertPipeline`` takes an item's origin (:meth:`take_item`) and queues its record or
  reject (:meth:`add_record`, :meth:`add_reject`);
* ``ResponseJournalMiddleware`` finds a request's entry (:meth:`for_request`) and keeps its
  raw response (:meth:`keep_response`, :meth:`mark_replayed`);
* the scheduler hands requests out through it (:meth:`handed_out`, the memory requests) and
  gets back what is ready to write (:meth:`drain_into`, the ``complete`` callback).

Requests that cannot be stored (a lambda callback, a Request in meta) are fetched from
memory under the lease of the stored request that yielded them (their owner): the owner is
complete only when they are, so a kill before that fetches the owner again, which yields
them again. Nothing lives only in memory past its owner's lease.

Everything here is keyed by object identity (``id()``), never by ``request.meta``: Scrapy
copies meta into retries and redirects, and spiders copy it into children with
``Request(..., meta=response.meta)``, so a key kept in meta would follow the data to the wrong
request. Each tracked object is held strongly while it is tracked, so its ``id()`` cannot be
reused; every trace of an entry is dropped when it completes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from itemadapter import ItemAdapter, is_item
from scrapy import Request
from scrapy.exceptions import CloseSpider, IgnoreRequest
from scrapy.http import Response
from twisted.python.failure import Failure

from ._order import QueueOrder, queue_position
from .codec import describe
from .exceptions import MissingNaturalKey, UnstorableRequest
from .keys import RequestFingerprints
from .records import RecordIdentity, is_record_id, item_type_name, page_position
from .scrapy_compat import failure_name, stat_counter
from .spider_state import StateTracker
from .store.base import (
    Completion,
    LeasedRequest,
    NewRequest,
    PageValidators,
    Record,
    Reject,
    RequestState,
    StateChange,
    UnitOfWork,
    observation_clock,
)

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred

    from .config import IdempotentConfig

__all__ = [
    "HttpStatusRule",
    "InflightRequest",
    "InflightTracker",
    "ItemOrigin",
    "RequestOrigin",
    "UnattributedWrites",
    "tracker_for",
]

logger = logging.getLogger(__name__)


@dataclass
class ItemOrigin:
    """Where an item comes from (the request and page that produced it) and its record
    identity, as the spider middleware learnt them."""

    item: Any
    producer: InflightRequest | None  #: the in-flight request whose page yielded it
    record_id: str | None
    key_values: list[Any] | None
    error: Exception | None = None
    page_url: str | None = None


@dataclass
class InflightRequest:
    """One leased request while Scrapy works on it, and everything its processing produced."""

    key: str
    fingerprint: str
    priority: int
    attempts: int
    request: Request
    suspect: bool = False  #: in flight when a worker died before
    #: times it was sent to the network (before this lease, and in it so far)
    downloads: int = 0
    #: the batch of writes (:class:`~.writer.WriterThread`) that carries its latest attempt
    #: write (its start, its journaled response, its replay): its callback waits for it
    write_seq: int = 0
    children: list[NewRequest] = field(default_factory=list)
    records: list[tuple[Record, str | None]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    #: changes its callback made to the spider's state (:mod:`.spider_state`)
    state_changes: list[StateChange] = field(default_factory=list)
    tracked: dict[int, Any] = field(default_factory=dict)  #: id -> object attributed to it
    dont_filter_counts: Counter[str] = field(default_factory=Counter)
    page_keys: Counter[str] = field(default_factory=Counter)
    #: when it was handed to the engine (unix seconds)
    handed_out_at: float = field(default_factory=observation_clock)
    #: when its latest response reached the engine (unix seconds): what its items were
    #: observed at (see :attr:`~.store.base.Record.observed_at`)
    received_at: float | None = None
    # outcome, as observed through the engine
    status: int | None = None
    http_error: bool = False
    failure: tuple[str, str] | None = None  #: (error kind, message)
    spider_error: tuple[str, str] | None = None
    redirected: bool = False
    replayed: bool = False  #: answered from the response journal
    interrupted: bool = False  #: its callback raised CloseSpider
    continuation: tuple[str, int] | None = None  #: (request data, priority) of a retry
    # requests that cannot be stored, fetched from memory under the lease of a stored entry
    #: this is such a request (its key is derived, never written)
    memory: bool = False
    #: for a memory request: the leased entry whose lease it lives under (None for one of
    #: start() or of no request: start() yields it again on every crawl)
    owner: InflightRequest | None = None
    #: for a memory request: it is a retry or redirect of its owner (its outcome is the
    #: owner's own)
    continues_owner: bool = False
    #: memory requests under this entry's lease not finished yet: it is done after them
    waiting: int = 0
    own_finished: bool = False  #: Scrapy has finished with this entry's own request
    #: its lease was found lost (another worker has it, or it was released): its memory
    #: requests are dropped and nothing more is fetched under it
    lost: bool = False
    #: fingerprints of the filtered memory requests under this entry's lease (duplicates of
    #: these are refused while it holds the lease)
    memory_seen: set[str] = field(default_factory=set)
    # conditional requests (:mod:`.conditional`)
    #: the validators its page answered with when last done (loaded with its claim)
    validators: PageValidators | None = None
    conditional: bool = False  #: it was sent with those validators
    not_modified: bool = False  #: it was answered 304 to them: done as unchanged
    #: its revisit was not due: answered as unchanged without being fetched
    not_due: bool = False
    #: the validators of the page it was answered with now (its 2xx response)
    answered: PageValidators | None = None

    def completion(self) -> Completion:
        """The frontier state this entry ends in, from what was observed."""
        if self.continuation is not None:
            data, priority = self.continuation
            return Completion(self.key, RequestState.PENDING, data=data, priority=priority,
                              validators=self.answered)
        if self.interrupted:  # released: the next run processes it again
            return Completion(self.key, RequestState.PENDING, "interrupted",
                              "the callback raised CloseSpider", validators=self.answered)
        if self.failure is not None:
            return Completion(self.key, RequestState.FAILED, *self.failure,
                              validators=self.answered)
        if self.redirected:
            return Completion(self.key, RequestState.REDIRECTED)
        if self.http_error:
            return Completion(self.key, RequestState.FAILED, "http_status",
                              f"HTTP {self.status} not handled by the spider")
        if self.spider_error is not None:
            return Completion(self.key, RequestState.FAILED, *self.spider_error,
                              validators=self.answered)
        return Completion(self.key, RequestState.DONE, validators=self.answered,
                          not_modified=self.not_modified, not_due=self.not_due)

    def unit_of_work(self) -> UnitOfWork:
        """Everything this entry produced with its completion: one transaction."""
        return UnitOfWork(requests=self.children, records=self.records,
                          rejects=self.rejects, completions=[self.completion()],
                          state_changes=[(change, self.key) for change in self.state_changes])


@dataclass
class UnattributedWrites:
    """Writes not tied to an in-flight request (start requests, items from ``start()``,
    completions of requests that could not be loaded). They go into the next transaction,
    which is at the latest the completion of whatever request produced them."""

    requests: list[NewRequest] = field(default_factory=list)
    records: list[tuple[Record, str | None]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    state_changes: list[tuple[StateChange, str | None]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests or self.records or self.rejects or self.completions
                    or self.state_changes)

    def drain_into(self, work: UnitOfWork) -> None:
        work.requests[:0] = self.requests
        work.records[:0] = self.records
        work.rejects[:0] = self.rejects
        work.completions[:0] = self.completions
        work.state_changes[:0] = self.state_changes
        self.requests, self.records, self.rejects, self.completions = [], [], [], []
        self.state_changes = []

    def restore_from(self, work: UnitOfWork) -> None:
        """Put the orphan part of a failed unit of work back (nothing of it was written)."""
        self.requests[:0] = work.requests
        self.records[:0] = work.records
        self.rejects[:0] = work.rejects
        self.state_changes[:0] = [(c, k) for c, k in work.state_changes if k is None]


class RequestOrigin(NamedTuple):
    """What produced a request reaching the scheduler (one for every request enqueued: a
    tuple, made several times faster than a frozen dataclass)."""

    parent: InflightRequest | None  #: the in-flight request it came from
    is_start: bool  #: it came from ``Spider.start()``
    #: it is the parent's retry or redirect, returned by a downloader middleware
    from_downloader: bool


@dataclass(frozen=True)
class HttpStatusRule:
    """Whether the callback sees a response (``HttpErrorMiddleware``'s rule)."""

    allow_all: bool  #: ``HTTPERROR_ALLOW_ALL``
    allowed: tuple[int, ...]  #: ``HTTPERROR_ALLOWED_CODES``

    def handled(self, response: Response, spider: object) -> bool:
        if 200 <= response.status < 300:
            return True
        meta = response.meta
        if meta.get("handle_httpstatus_all", False):
            return True
        if "handle_httpstatus_list" in meta:
            return response.status in meta["handle_httpstatus_list"]
        if self.allow_all:
            return True
        allowed = getattr(spider, "handle_httpstatus_list", self.allowed)
        return response.status in allowed


#: The origin of the item the item pipelines are processing (set around the pipeline chain,
#: so the pipeline finds the producing request even when an earlier pipeline replaced the
#: item).
_ITEM_IN_PIPELINES: ContextVar[ItemOrigin | None] = ContextVar("_ITEM_IN_PIPELINES",
                                                                default=None)

#: a memory request waiting to be handed out: (*queue_position, sequence, entry)
_MemoryRequest = tuple[int, int, int, int, InflightRequest]


class InflightTracker:
    """The bookkeeping of requests in flight (see the module docstring).

    ``complete(work, entry)`` is called with each unit of work that became ready to write:
    ``entry`` (a handed-out request) and its memory requests finished, or (``entry`` None) a
    memory request of no stored request finished; ``flush_soon()`` when something was
    buffered that must be written before its response is processed (an attempt started, a
    journaled response): it returns the number of the batch of writes that will carry it,
    and ``writes_durable(number)`` gives None once that batch is written, else a Deferred
    that fires then. A response (or failure) goes on to its callback (errback) only once its
    attempt's writes are durable: a kill in the callback finds the attempt counted (a page
    that kills every crawl is quarantined) and the response journaled (not downloaded again).
    """

    def __init__(self, *, stats: StatsCollector, identity: RecordIdentity,
                 fingerprints: RequestFingerprints, order: QueueOrder,
                 http_status: HttpStatusRule) -> None:
        self.stats = stats
        self._count = stat_counter(stats)  # (for every page)
        self.identity = identity
        self.fingerprints = fingerprints
        self.order = order
        self.http_status = http_status
        self.spider: object = None
        self.complete: Callable[[UnitOfWork, InflightRequest | None], None] = \
            lambda work, entry: None
        self.flush_soon: Callable[[], int] = lambda: 0
        #: told when something was buffered that no response waits for (a download's
        #: count): it is written with the next transaction, soon
        self.write_soon: Callable[[], None] = lambda: None
        self.writes_durable: Callable[[int], Deferred[None] | None] = lambda seq: None
        #: told of each request a callback yielded, before the request reaches the engine
        self.child_request: Callable[[Request], None] = lambda request: None
        self.unattributed = UnattributedWrites()
        #: the spider's state as last seen (see :mod:`.spider_state`)
        self.state = StateTracker(stats)
        self._inflight: dict[int, InflightRequest] = {}  # id(handed-out request) -> entry
        self._by_fingerprint: dict[str, InflightRequest] = {}
        #: id(child request) -> its producer
        self._tracked: dict[int, tuple[InflightRequest | None, Any]] = {}
        self._items: dict[int, ItemOrigin] = {}  # id(item) -> origin
        self._continuations: dict[int, tuple[InflightRequest, Request]] = {}
        self._start_requests: dict[int, Request] = {}
        self._started: list[str] = []  # keys handed out since the last transaction
        self._replayed: list[str] = []  # keys answered from the journal since then
        self._downloaded: list[str] = []  # keys sent to the network since then
        self._journal: list[tuple[InflightRequest, str, bytes]] = []  # responses to keep
        #: fingerprints of filtered requests buffered for a transaction (duplicates of these
        #: are refused before they reach the database)
        self._buffered: Counter[str] = Counter()
        self._suspects = 0
        self._warned_page_key = False
        #: requests that cannot be stored, to fetch from memory, in Scrapy's order
        self._memory: list[_MemoryRequest] = []
        self._memory_sequence = 0
        #: fingerprint of a filtered memory request -> the entry it lives under (None: of
        #: start(), for the whole crawl); forgotten when that entry is lost, or completed
        #: other than done (a later lease of it yields the request again)
        self._memory_seen: dict[str, InflightRequest | None] = {}
        self._unstorable_causes: set[str] = set()  # logged
        #: id(entry) -> entry whose own request is finished, waiting for its memory requests
        self._waiting: dict[int, InflightRequest] = {}

    # -- lookups ----------------------------------------------------------------------------

    def for_request(self, request: Request) -> InflightRequest | None:
        """The entry of a request handed out and still worked on by the engine."""
        return self._inflight.get(id(request))

    def for_response(self, response: Response) -> InflightRequest | None:
        """The in-flight entry ``response`` answers, or None if it is not ours."""
        request = response.request
        if request is None:
            return None
        entry = self._inflight.get(id(request))
        if entry is None:
            fingerprint = self.fingerprints(request)
            entry = self._by_fingerprint.get(fingerprint) if fingerprint is not None else None
        return entry

    def leased(self) -> list[InflightRequest]:
        """Entries handed out and not completed: in flight, or waiting for their memory
        requests (not the memory requests: they have no lease)."""
        entries = [entry for entry in self._inflight.values() if not entry.memory]
        entries.extend(self._waiting.values())
        return entries

    @property
    def in_flight(self) -> bool:
        """Whether the engine works on any request handed out."""
        return bool(self._inflight)

    @property
    def in_flight_count(self) -> int:
        """Requests handed out that the engine has not finished (memory requests included)."""
        return len(self._inflight)

    @property
    def suspects_in_flight(self) -> int:
        """Suspects handed out and not completed (their memory requests included)."""
        return self._suspects

    # -- from the scheduler: requests in and out --------------------------------------------

    def mark_start(self, request: Request) -> None:
        """Remember that ``request`` came from ``Spider.start()`` (keys ``dont_filter`` start
        requests deterministically)."""
        self._start_requests[id(request)] = request

    def origin_of(self, request: Request) -> RequestOrigin:
        """What produced ``request`` (forgotten here: each request is enqueued once)."""
        is_start = self._start_requests.pop(id(request), None) is not None
        continuation = self._continuations.pop(id(request), None)
        if continuation is not None:
            return RequestOrigin(continuation[0], is_start, from_downloader=True)
        parent: InflightRequest | None = None
        owner = self._tracked.pop(id(request), None)
        if owner is not None:
            parent = owner[0]
            if parent is not None:
                parent.tracked.pop(id(request), None)
        return RequestOrigin(parent, is_start, from_downloader=False)

    def is_buffered(self, fingerprint: str) -> bool:
        """Whether a filtered request of ``fingerprint`` waits for a transaction or is a
        memory request (a duplicate of it is refused without asking the store)."""
        return bool(self._buffered[fingerprint]) or fingerprint in self._memory_seen

    def buffer_request(self, new: NewRequest, parent: InflightRequest | None) -> None:
        """Queue ``new`` for the transaction of its parent (or the next one)."""
        if new.filter_fingerprint:
            self._buffered[new.fingerprint] += 1
        (parent.children if parent is not None else self.unattributed.requests).append(new)

    def handed_out(self, leased: LeasedRequest, request: Request) -> InflightRequest:
        """``request`` (loaded from ``leased``) goes to the engine. Its claim counted the
        attempt; the start (an unfinished lease) is written with the next transaction,
        before its response goes on to its callback (see ``writes_durable``)."""
        entry = InflightRequest(key=leased.key, fingerprint=leased.fingerprint,
                                priority=leased.priority, attempts=leased.attempts,
                                request=request, suspect=leased.suspect,
                                downloads=leased.downloads, validators=leased.validators)
        if leased.suspect:
            self._suspects += 1
        self._inflight[id(request)] = entry
        self._by_fingerprint[leased.fingerprint] = entry
        self._started.append(leased.key)
        entry.write_seq = self.flush_soon()
        return entry

    def fail_unloadable(self, key: str, message: str) -> None:
        """A leased request could not be loaded: it ends failed with the next transaction."""
        self.unattributed.completions.append(
            Completion(key, RequestState.FAILED, "unloadable", message))

    def refuse_unidentified(self, request: Request, origin: RequestOrigin) -> None:
        """A request whose fingerprint cannot be computed is refused (``request_dropped``);
        the request it came from ends failed, so the loss stays visible and retryable."""
        self.stats.inc_value("idempotent/requests/unidentified")
        message = f"the request fingerprinter failed for {describe(request)}"
        parent = origin.parent
        if parent is not None and origin.from_downloader:
            # its retry or redirect has no identity: it did not get its page
            parent.failure = ("fingerprint_error", message)
            parent.continuation = None
        elif parent is not None and parent.failure is None:
            parent.failure = ("fingerprint_error_child", message)

    # -- writes waiting for the next transaction --------------------------------------------

    def keep_response(self, entry: InflightRequest, data: str, body: bytes) -> None:
        """Journal the raw response of ``entry`` (see :mod:`.journal`): written with the next
        transaction, before the response goes on to its callback. Not for memory requests
        (nothing of theirs is stored)."""
        if entry.memory:
            return
        self._journal.append((entry, data, body))
        entry.write_seq = self.flush_soon()

    def mark_replayed(self, entry: InflightRequest, *, received_at: float | None = None) -> None:
        """``entry``'s response came from the response journal: this attempt is not a
        download (written with the next transaction, before the response goes on). Its
        items were observed when the response was first received: ``received_at``, if
        known."""
        entry.replayed = True
        entry.received_at = received_at
        self._replayed.append(entry.key)
        entry.write_seq = self.flush_soon()

    def request_sent(self, request: Request) -> None:
        """The downloader sends ``request`` to the network (its download handler): a
        download of its entry, whatever comes back (never an answer of the response journal
        or of Scrapy's HTTP cache: those do not reach the handler). Counted in the frontier
        with the next transaction, written soon; nothing waits for it."""
        entry = self._inflight.get(id(request))
        if entry is None or entry.memory:
            return
        self._count("idempotent/requests/downloaded")
        if entry.downloads:
            self._count("idempotent/requests/downloaded_again")
        entry.downloads += 1
        self._downloaded.append(entry.key)
        self.write_soon()

    @property
    def has_attempt_writes(self) -> bool:
        """Attempts started, replayed or journaled responses (or downloads) wait for a
        transaction."""
        return bool(self._started or self._journal or self._replayed or self._downloaded)

    def drain_into(self, work: UnitOfWork) -> None:
        """Add every buffered write to ``work`` (and forget them here): the unattributed
        writes, the attempts started and replayed, and the journaled responses of requests
        still in flight (a completed one needs no journal entry)."""
        self.state_boundary(None)  # changes made outside callbacks go with this one
        self.unattributed.drain_into(work)
        work.started[:0] = self._started
        self._started = []
        work.replayed[:0] = self._replayed
        self._replayed = []
        work.downloaded[:0] = self._downloaded
        self._downloaded = []
        if self._journal:
            inflight = self._inflight
            work.responses = [(e.key, data, body) for e, data, body in self._journal
                              if inflight.get(id(e.request)) is e]
            self._journal = []

    def restore_from(self, work: UnitOfWork) -> None:
        """``work`` was not written: its buffered writes wait for the next transaction."""
        self.unattributed.restore_from(work)
        self._started[:0] = work.started
        self._replayed[:0] = work.replayed
        self._downloaded[:0] = work.downloaded

    def written(self, work: UnitOfWork) -> None:
        """``work`` was committed: its requests are no longer buffered (written, or known)."""
        buffered = self._buffered
        for new in work.requests:
            if new.filter_fingerprint:
                buffered[new.fingerprint] -= 1
                if buffered[new.fingerprint] <= 0:
                    del buffered[new.fingerprint]

    # -- what the engine hooks report (engine_hooks.EngineObserver) -------------------------

    def request_finished(self, request: Request) -> None:
        """The engine is done with ``request``: complete its entry (if it is ours)."""
        try:
            self._finish(request)
        except Exception:
            logger.exception("scrapy_idempotent: error completing %s", describe(request))

    def downloader_output(self, result: Request | Response | Failure,
                          request: Request) -> Deferred[None] | None:
        entry = self._inflight.get(id(request))
        if entry is None:
            return None
        self._observe(entry, result)
        if isinstance(result, Request):
            return None  # a retry or redirect: its own attempt comes later
        return self.writes_durable(entry.write_seq)

    def spider_output(self, result: Any, request: Request,
                      response: Response | Failure) -> Any:
        # The final output of a callback or errback, with the request the engine handed
        # out: what RecordIdMiddleware did not see (errback output bypasses every spider
        # middleware; a project's middleware nearer the engine adds output) is
        # attributed here.
        entry = self._inflight.get(id(request))
        page_url = response.url if isinstance(response, Response) else request.url
        return self.track_output(result, entry, page_url)

    def spider_error(self, failure: Failure, request: Request,
                     response: Response | Failure) -> None:
        # Every exception of a callback or errback, CloseSpider included (which sends no
        # spider_error signal), with the request the engine handed out.
        entry = self._inflight.get(id(request))
        if entry is None:
            return
        exc = failure.value
        if isinstance(exc, CloseSpider):
            # The callback stopped the crawl: its page is not done; it stays due.
            entry.interrupted = True
        elif entry.spider_error is None:
            entry.spider_error = (f"spider_error/{type(exc).__name__}", str(exc)[:1000])

    @contextlib.contextmanager
    def item_in_pipelines(self, item: Any,
                          response: Response | Failure | None) -> Iterator[None]:
        if id(item) not in self._items:
            # not seen on its way (an item of start() added by a project's middleware
            # nearer the engine): the response names the request it belongs to
            if isinstance(response, Response):
                self.track(item, self.for_response(response), response.url)
            else:
                self.track(item, None, None)
        token = _ITEM_IN_PIPELINES.set(self._items.get(id(item)))
        try:
            yield
        finally:
            _ITEM_IN_PIPELINES.reset(token)

    def _observe(self, entry: InflightRequest, result: Any) -> None:
        if isinstance(result, Request):  # a redirect or retry from a downloader middleware
            self._continuations[id(result)] = (entry, result)
            if self.fingerprints(result) != entry.fingerprint:
                entry.redirected = True
        elif isinstance(result, Response):
            if not (entry.replayed and entry.received_at is not None):
                entry.received_at = observation_clock()
            entry.status = result.status
            entry.http_error = not self.http_status.handled(result, self.spider)
        elif isinstance(result, Failure):
            exc = result.value
            kind = "ignored" if isinstance(exc, IgnoreRequest) else "download_error"
            entry.failure = (f"{kind}/{failure_name(exc)}", str(exc)[:1000])

    # -- attribution (the spider middleware and the errback hook) ---------------------------

    def state_boundary(self, entry: InflightRequest | None) -> None:
        """Give what the spider's state changed since the last boundary to ``entry`` (whose
        callback just ran a step: its page's commit carries it), or with ``None`` to the
        next transaction (see :mod:`.spider_state`)."""
        changes = self.state.changes()
        if not changes:
            return
        if entry is not None and id(entry.request) in self._inflight:
            entry.state_changes.extend(changes)
        else:
            self.unattributed.state_changes.extend((change, None) for change in changes)

    def track(self, output: Any, entry: InflightRequest | None, page_url: str | None) -> None:
        """Attribute one output of a callback (or errback) to the entry that produced it; for
        an item also compute its record ID and stamp it into the item when the item type has
        room for ``IDEMPOTENT_RECORD_ID_FIELD``."""
        if isinstance(output, Request):
            if entry is not None:
                self._tracked[id(output)] = (entry, output)
                entry.tracked[id(output)] = output
                self.child_request(output)
            return
        if output is None or not is_item(output):
            return  # not an item (Scrapy passes such output on as it is): nothing to key
        origin = ItemOrigin(item=output, producer=entry, record_id=None, key_values=None,
                            page_url=page_url)
        try:
            key_values = self.identity.natural_key(output, page_url)
        except MissingNaturalKey as exc:
            origin.error = exc
        else:
            if entry is not None and self.identity.key_fields(output) is None:
                position = self._page_position(entry, key_values[0], output)
                if position is not None:
                    key_values = [*key_values, *position]
            origin.key_values = key_values
            origin.record_id = self.identity.record_id(
                key_values, self.identity.record_key(output).record_type)
            self._stamp(output, origin.record_id)
        self._items[id(output)] = origin
        if entry is not None:
            entry.tracked[id(output)] = output

    def track_output(self, result: Any, entry: InflightRequest | None, page_url: str) -> Any:
        """``result`` (an iterable or async iterable) with each output not tracked yet
        attributed to ``entry``."""
        def untracked(output: Any) -> bool:
            return id(output) not in self._items and id(output) not in self._tracked

        if hasattr(result, "__aiter__"):
            async def tracked_async(it: AsyncIterator[Any]) -> AsyncIterator[Any]:
                async for output in it:
                    if untracked(output):
                        self.track(output, entry, page_url)
                    yield output
            return tracked_async(result)

        def tracked_sync(it: Iterable[Any]) -> Iterable[Any]:
            for output in it:
                if untracked(output):
                    self.track(output, entry, page_url)
                yield output
        return tracked_sync(result)

    def _stamp(self, item: Any, record_id: str) -> None:
        field_name = self.identity.record_id_field
        if field_name is None:
            return
        # An item type without such a field keeps its record ID beside it (in its origin).
        with contextlib.suppress(KeyError, TypeError, AttributeError):
            ItemAdapter(item)[field_name] = record_id

    def _page_position(self, entry: InflightRequest, key: str, item: Any) -> list[str] | None:
        """What tells ``item`` apart from the other items of ``entry``'s page keyed by the
        page URL (:func:`~.records.page_position`), counted in a stat and warned about once.
        Several items of a page without a configured key are then several records, never
        one that overwrites the others; their identity is their position, stable while the
        page yields them in the same order."""
        position = page_position(entry.page_keys, key, item_type_name(item))
        if position is None:
            return None
        self.stats.inc_value("idempotent/items/keyed_by_rank")
        if not self._warned_page_key:
            self._warned_page_key = True
            logger.warning(
                "scrapy_idempotent: %s yielded several items without a configured natural "
                "key (%s among them), so each is identified by its position on the page: "
                "if the page reorders them, their records are updated with each other's "
                "data; set IDEMPOTENT_NATURAL_KEYS = {%r: '<field>'} (further cases are "
                "counted in the stat idempotent/items/keyed_by_rank)",
                key, type(item).__name__, type(item).__name__,
            )
        return position

    # -- the pipeline's side ----------------------------------------------------------------

    def take_item(self, item: Any) -> ItemOrigin:
        """What :meth:`track` learnt about ``item``, or a fresh origin for an item no
        middleware saw (an earlier pipeline replaced it, or it came from ``start()``)."""
        origin = self._items.pop(id(item), None)
        if origin is not None:
            if origin.producer is not None:
                origin.producer.tracked.pop(id(item), None)
            return origin
        return self._origin_of_replaced(item)

    def record_id_of(self, item: Any) -> str | None:
        """The record ID ``item`` is to be stored under, without taking it (a media pipeline
        naming files by it, before the upsert); None when it has none (no natural key)."""
        origin = self._items.get(id(item))
        if origin is None:
            origin = self._origin_of_replaced(item)
        return origin.record_id

    def _origin_of_replaced(self, item: Any) -> ItemOrigin:
        # An earlier pipeline returned another object: the item the pipelines started with
        # tells which request (and page) it belongs to.
        first = _ITEM_IN_PIPELINES.get()
        entry = first.producer if first is not None else None
        page_url = first.page_url if first is not None else None
        if entry is not None and id(entry.request) not in self._inflight:
            entry = None
        origin = ItemOrigin(item=item, producer=entry, record_id=None, key_values=None,
                            page_url=page_url)
        try:
            keyed = self.identity.key_fields(item) is not None
        except MissingNaturalKey as exc:  # (its record type was stored under another key)
            origin.error = exc
            return origin
        if not keyed and first is not None and first.record_id is not None:
            # keyed by its page (and rank) or its content: the item the pipelines started
            # with names the record, not the content an earlier pipeline changed
            origin.record_id, origin.key_values = first.record_id, first.key_values
            return origin
        if not page_url and not keyed:
            stamped = _stamped_id(item, self.identity.record_id_field)
            if stamped is not None:
                origin.record_id, origin.key_values = stamped, []
                return origin
        try:
            origin.key_values = self.identity.natural_key(item, page_url)
            origin.record_id = self.identity.record_id(
                origin.key_values, self.identity.record_key(item).record_type)
        except MissingNaturalKey as exc:
            origin.error = exc
        return origin

    def add_record(self, origin: ItemOrigin, record: Record) -> None:
        """Queue a record for the transaction that completes its request, with the time its
        data was observed: when the response it came from reached the engine; without one
        (an errback's item), when its request was handed out; without a request (an item
        of ``start()``), now."""
        target = self._target(origin)
        if target is None:
            observed = observation_clock()
        elif target.received_at is not None:
            observed = target.received_at
        else:
            observed = target.handed_out_at
        record = dataclasses.replace(record, observed_at=observed)
        key = target.key if target is not None else None
        (target.records if target is not None else self.unattributed.records).append(
            (record, key))

    def add_reject(self, origin: ItemOrigin, reject: Reject) -> None:
        """Queue a rejected item for the transaction that completes its request."""
        target = self._target(origin)
        (target.rejects if target is not None else self.unattributed.rejects).append(reject)

    def _target(self, origin: ItemOrigin) -> InflightRequest | None:
        entry = origin.producer
        return entry if entry is not None and id(entry.request) in self._inflight else None

    # -- completion -------------------------------------------------------------------------

    def _finish(self, request: Request) -> None:
        entry = self._inflight.pop(id(request), None)
        if entry is None:
            return  # not handed out by us (robots.txt, media downloads)
        if self._by_fingerprint.get(entry.fingerprint) is entry:
            del self._by_fingerprint[entry.fingerprint]
        for oid in entry.tracked:
            self._tracked.pop(oid, None)
            self._items.pop(oid, None)
        if entry.memory:
            self._finish_memory(entry)
        elif entry.waiting:  # done only when its memory requests are
            entry.own_finished = True
            self._waiting[id(entry)] = entry
        else:
            self._complete(entry)

    def _complete(self, entry: InflightRequest) -> None:
        """Hand everything ``entry`` produced, with its completion, to ``complete``."""
        if entry.suspect:
            # counted until its memory requests are finished too: they run inside it
            self._suspects -= 1
        if entry.lost or entry.completion().state is not RequestState.DONE:
            # a later lease of it fetches it again, which yields its memory requests again
            self._forget_memory_seen(entry)
        if entry.lost:
            # its lease was found lost at a renewal: nothing of its work is written (this
            # process may hold the entry again under a new lease by now, which the store's
            # fence by worker would not tell apart)
            self.stats.inc_value("idempotent/requests/leases_lost")
            return
        self.complete(entry.unit_of_work(), entry)

    def lose(self, held: set[str]) -> int:
        """The leases of entries whose keys are not in ``held`` were lost: their memory
        requests not handed out yet are dropped (a worker that lost its leases stops
        handing out what it claimed), those in flight are finished without writing
        anything, and their fingerprints are forgotten (whoever leases the entry next
        fetches it and they are yielded again). Returns how many entries were lost."""
        lost = [entry for entry in self.leased() if entry.key not in held and not entry.lost]
        for entry in lost:
            entry.lost = True
            self._forget_memory_seen(entry)
        if lost:
            self._drop_memory_of_lost()
        return len(lost)

    def _drop_memory_of_lost(self) -> None:
        kept = [m for m in self._memory if m[-1].owner is None or not m[-1].owner.lost]
        dropped = len(self._memory) - len(kept)
        if not dropped:
            return
        owners = []
        for *_, memory in self._memory:
            if memory.owner is not None and memory.owner.lost:
                memory.owner.waiting -= 1
                owners.append(memory.owner)
        heapq.heapify(kept)
        self._memory = kept
        self.stats.inc_value("idempotent/requests/lease_lost_dropped", dropped)
        for owner in {id(owner): owner for owner in owners}.values():
            self._settle_if_done(owner)

    def _forget_memory_seen(self, entry: InflightRequest) -> None:
        for fingerprint in entry.memory_seen:
            if self._memory_seen.get(fingerprint) is entry:
                del self._memory_seen[fingerprint]
        entry.memory_seen.clear()

    # -- requests fetched from memory -------------------------------------------------------

    @property
    def memory_requests(self) -> int:
        """Memory requests waiting to be handed out."""
        return len(self._memory)

    def hold_in_memory(self, request: Request, exc: UnstorableRequest, *, key: str,
                       fingerprint: str, origin: RequestOrigin, filtered: bool,
                       continues: bool) -> bool:
        """Keep a request that cannot be stored in memory, to be fetched under the lease of
        the stored entry it came from (its owner; see the module docstring). A memory
        request of ``start()`` (or of no request) has no owner: ``start()`` yields it again
        on every crawl. Counted, and logged once per cause. Refused (False) when its owner's
        lease is lost: nothing more is fetched under it."""
        parent = origin.parent
        owner = parent.owner if parent is not None and parent.memory else parent
        if owner is not None and owner.lost:
            self.stats.inc_value("idempotent/requests/lease_lost_dropped")
            return False
        self._count_unstorable(exc)
        entry = InflightRequest(key=key, fingerprint=fingerprint, priority=request.priority,
                                attempts=1, request=request, memory=True, owner=owner,
                                continues_owner=continues and parent is not None and (
                                    parent is owner or parent.continues_owner))
        if continues and parent is not None:
            # the retry or redirect supersedes what its request's attempt observed
            parent.failure = parent.spider_error = None
            parent.http_error = False
        if owner is not None:
            owner.waiting += 1
        if filtered:
            self._memory_seen[fingerprint] = owner
            if owner is not None:
                owner.memory_seen.add(fingerprint)
        is_start, fifo = self.order.place(request)
        self._memory_sequence += 1
        heapq.heappush(self._memory, (
            *queue_position(request.priority, is_start, fifo, self._memory_sequence),
            self._memory_sequence, entry))
        return True

    def _count_unstorable(self, exc: UnstorableRequest) -> None:
        self.stats.inc_value("idempotent/requests/unstorable")
        cause = exc.path if exc.path in ("callback", "errback", "_class", "request") \
            else f"{exc.path}: {exc.reason}"
        if cause not in self._unstorable_causes:
            self._unstorable_causes.add(cause)
            logger.warning(
                "scrapy_idempotent: %s; it is fetched from memory, under the lease of the "
                "request that yielded it: if the crawl stops first, that request is fetched "
                "again and yields it again (further requests with this cause are counted in "
                "idempotent/requests/unstorable)", exc)

    def memory_goes_before(self, head: LeasedRequest) -> bool:
        """Whether the next memory request goes before ``head``, the next request claimed
        ahead: the claim's rule (:func:`~._order.queue_position`: priority, then other
        requests before start ones), and at an equal place the newer first for a LIFO
        queue, the older for a FIFO one (a memory request is newer than what was claimed
        before it was yielded). Before a suspect, memory requests go first: they hold
        leases already taken."""
        if head.suspect:
            return True
        neg_priority, start_queue, order, *_ = self._memory[0]
        mine = (neg_priority, start_queue)
        theirs = queue_position(head.priority, head.is_start, True, 0)[:2]
        if mine != theirs:
            return mine < theirs
        return order < 0  # LIFO: the memory request is the newer

    def hand_out_memory(self) -> Request:
        """The next memory request (there must be one), now in flight."""
        *_, entry = heapq.heappop(self._memory)
        self._inflight[id(entry.request)] = entry
        self.stats.inc_value("idempotent/requests/from_memory")
        return entry.request

    def _finish_memory(self, entry: InflightRequest) -> None:
        """A memory request is finished: what it produced goes to its owner's transaction
        (or, without an owner, is written now); its failure fails its owner."""
        owner = entry.owner
        if owner is not None and owner.lost:
            # its lease is gone: nothing it produced can be written under it
            owner.waiting -= 1
            self._settle_if_done(owner)
            return
        key = owner.key if owner is not None else None
        children = [dataclasses.replace(c, parent_key=key) for c in entry.children]
        records = [(record, key) for record, _ in entry.records]
        rejects = [dataclasses.replace(r, request_key=key) for r in entry.rejects]
        if owner is None:
            self.complete(UnitOfWork(requests=children, records=records, rejects=rejects,
                                     state_changes=[(c, None) for c in entry.state_changes]),
                          None)
            return
        owner.children.extend(children)
        owner.records.extend(records)
        owner.rejects.extend(rejects)
        owner.state_changes.extend(entry.state_changes)
        self._pass_outcome(entry, owner)
        owner.waiting -= 1
        self._settle_if_done(owner)

    @staticmethod
    def _pass_outcome(entry: InflightRequest, owner: InflightRequest) -> None:
        """A memory request's interruption or failure is its owner's."""
        completion = entry.completion()
        if entry.interrupted:
            owner.interrupted = True
        elif completion.state is RequestState.FAILED and owner.failure is None:
            kind = completion.error_kind or "failed"
            owner.failure = (
                kind if entry.continues_owner else f"unstorable_child/{kind}",
                f"{describe(entry.request)} (fetched from memory: it cannot be stored): "
                f"{completion.error_message or kind}"[:1000])

    def _settle_if_done(self, owner: InflightRequest) -> None:
        """Complete ``owner`` once its own request and its memory requests are finished."""
        if owner.waiting == 0 and owner.own_finished:
            del self._waiting[id(owner)]
            self._complete(owner)


def _stamped_id(item: Any, field_name: str | None) -> str | None:
    if field_name is None:
        return None
    value = ItemAdapter(item).get(field_name)
    return value if is_record_id(value) else None


def tracker_for(config: IdempotentConfig, stats: StatsCollector,
                fingerprints: RequestFingerprints) -> InflightTracker:
    """The in-flight tracker of a crawl with ``config``."""
    return InflightTracker(
        stats=stats,
        identity=RecordIdentity.from_config(config),
        fingerprints=fingerprints,
        order=config.queue_order,
        http_status=HttpStatusRule(allow_all=config.httperror_allow_all,
                                   allowed=config.httperror_allowed_codes),
    )
