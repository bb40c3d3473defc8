"""In-flight bookkeeping: which leased request produced which items and child requests.

Everything here is keyed by object identity (``id()``), never by ``request.meta``: Scrapy
copies meta into retries and redirects, and spiders copy it into children with
``Request(..., meta=response.meta)``, so a key kept in meta would follow the data to the wrong
request. Each tracked object is held strongly while it is tracked,
so its ``id()`` cannot be reused; every trace of an entry is dropped when it completes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .store.base import Completion, NewRequest, Record, Reject, RequestState, UnitOfWork

if TYPE_CHECKING:
    from scrapy import Request

__all__ = ["Entry", "ItemTag", "Pending"]


@dataclass
class ItemTag:
    """What the spider middleware learnt about an item: its producer and record identity."""

    item: Any
    entry: Entry | None
    record_id: str | None
    key_values: list[Any] | None
    error: Exception | None = None
    page_url: str | None = None


@dataclass
class Entry:
    """One leased request while Scrapy works on it, and everything its processing produced."""

    key: str
    fingerprint: str
    priority: int
    attempts: int
    request: Request
    suspect: bool = False  #: in flight when a worker died before
    downloads: int = 0  #: times it was sent to the network before this lease
    children: list[NewRequest] = field(default_factory=list)
    records: list[tuple[Record, str | None]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    tracked: dict[int, Any] = field(default_factory=dict)  #: id -> object attributed to it
    dont_filter_counts: Counter[str] = field(default_factory=Counter)
    page_keys: Counter[str] = field(default_factory=Counter)
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
    owner: Entry | None = None
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

    def completion(self) -> Completion:
        """The frontier state this entry ends in, from what was observed."""
        if self.continuation is not None:
            data, priority = self.continuation
            return Completion(self.key, RequestState.PENDING, data=data, priority=priority)
        if self.interrupted:  # released: the next run processes it again
            return Completion(self.key, RequestState.PENDING, "interrupted",
                              "the callback raised CloseSpider")
        if self.failure is not None:
            return Completion(self.key, RequestState.FAILED, *self.failure)
        if self.redirected:
            return Completion(self.key, RequestState.REDIRECTED)
        if self.http_error:
            return Completion(self.key, RequestState.FAILED, "http_status",
                              f"HTTP {self.status} not handled by the spider")
        if self.spider_error is not None:
            return Completion(self.key, RequestState.FAILED, *self.spider_error)
        return Completion(self.key, RequestState.DONE)


@dataclass
class Pending:
    """Writes not tied to an in-flight entry (start requests, items from ``start()``,
    completions of requests that could not be loaded). They go into the next transaction,
    which is at the latest the completion of whatever request produced them."""

    requests: list[NewRequest] = field(default_factory=list)
    records: list[tuple[Record, str | None]] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests or self.records or self.rejects or self.completions)

    def drain_into(self, work: UnitOfWork) -> None:
        work.requests[:0] = self.requests
        work.records[:0] = self.records
        work.rejects[:0] = self.rejects
        work.completions[:0] = self.completions
        self.requests, self.records, self.rejects, self.completions = [], [], [], []

    def restore_from(self, work: UnitOfWork) -> None:
        """Put the orphan part of a failed unit of work back (nothing of it was written)."""
        self.requests[:0] = work.requests
        self.records[:0] = work.records
        self.rejects[:0] = work.rejects
