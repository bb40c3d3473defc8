"""What the in-flight tracker (:mod:`.inflight`) keeps: an :class:`InflightRequest` for each
request the engine works on (what its processing produced, how it went), where each item and
request came from (:class:`ItemOrigin`, :class:`RequestOrigin`), the writes of no request
(:class:`UnattributedWrites`), and ``HttpErrorMiddleware``'s rule (:class:`HttpStatusRule`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from .store.base import (
    Completion,
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
    from scrapy import Request
    from scrapy.http import Response

__all__ = [
    "HttpStatusRule",
    "InflightRequest",
    "ItemOrigin",
    "RequestOrigin",
    "UnattributedWrites",
]


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
    #: with ``answered``: the keys of every request its callback yielded that the frontier
    #: took or knew already, in the order yielded (a later 304 enqueues them all again)
    links: list[str] = field(default_factory=list)

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
                          not_modified=self.not_modified, not_due=self.not_due,
                          links=tuple(self.links))

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
