"""``IdempotentScheduler``: Scrapy's scheduler on a durable frontier with leases.

Set ``SCHEDULER = "scrapy_idempotent.IdempotentScheduler"`` (the add-on does it). The
scheduler keeps every request in the store, hands them out under a lease, and marks a request
done only when Scrapy has completely finished with it, in the same transaction as the records
and child requests its response produced ("done is the last write").

When is a request finished? Not when a spider middleware's output iterator ends: items are
processed concurrently and child requests reach the scheduler later. The exact moment is the
engine's ``_slot.remove_request(request)``, which fires once per handed-out request after its
items went through the pipelines and its children were enqueued, whatever the outcome. It is
private API: :class:`~.engine_hooks.EngineHooks` wraps it (and the engine's other steps the
scheduler observes), checks at open that every hook exists on the running Scrapy, refusing
to run otherwise (:class:`~.UnsupportedScrapy`), and reports to the scheduler's
``request_finished``, ``downloader_output``, ``spider_output``, ``spider_error`` and
``item_in_pipelines``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import heapq
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from itemadapter import is_item
from scrapy import Request
from scrapy.core.scheduler import BaseScheduler
from scrapy.exceptions import CloseSpider, IgnoreRequest
from scrapy.http import Response
from scrapy.utils.url import strip_url
from twisted.internet import task
from twisted.python.failure import Failure

from . import __version__, engine_hooks, signals
from ._dupes import DuplicateFilter
from ._order import QueueOrder
from ._tracking import Entry, ItemTag, Pending
from .codec import RequestCodec, describe
from .config import IdempotentConfig, config_for
from .exceptions import MissingNaturalKey, StoreBusy, StoreError, UnstorableRequest
from .records import RecordIdentity, item_type_name
from .store.base import (
    Completion,
    CrawlIdentity,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
)
from .store.registry import open_store, redacted
from .store.workers import LIVE_WORKERS as _LIVE_WORKERS
from .store.workers import worker_id, worker_is_dead

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

    from .store.base import CommitResult

__all__ = ["IdempotentScheduler", "is_idempotent_scheduler", "worker_id", "worker_is_dead"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The tag of the item the item pipelines are processing (set around the pipeline chain, so
#: our pipeline finds the producing request even when an earlier pipeline replaced the item).
_ITEM_IN_PIPELINES: ContextVar[ItemTag | None] = ContextVar("_ITEM_IN_PIPELINES", default=None)

#: Attempts at a write transaction before the crawl is closed (database locked or I/O error).
_COMMIT_ATTEMPTS = 5
#: Reason the spider closes with when the store keeps failing.
STORE_ERROR_REASON = "idempotent_store_error"



def _is_feed_not_stored(exc: BaseException) -> bool:
    """Feeds not stored: each cause was logged with its traceback already."""
    from .feeds import FeedNotStored

    return isinstance(exc, FeedNotStored)


def is_idempotent_scheduler(obj: object) -> bool:
    """Whether ``obj`` (a scheduler or a scheduler class) is an :class:`IdempotentScheduler`.

    ``isinstance``/``issubclass`` cannot tell: Scrapy's ``BaseScheduler`` metaclass answers
    True for any class with the scheduler methods (scrapy/core/scheduler.py).
    """
    cls = obj if isinstance(obj, type) else type(obj)
    return IdempotentScheduler in cls.__mro__


class IdempotentScheduler(BaseScheduler):
    """A durable, leased frontier as Scrapy's scheduler.

    Enqueue is idempotent by request key: the crawler's request fingerprint (hex), or for a
    request with ``dont_filter=True`` a key derived from its parent's key (``start`` for
    start requests), its fingerprint and its rank among the parent's ``dont_filter`` children
    with that fingerprint, so a replayed parent or a restarted ``start()`` maps to the same
    keys. Leasing order: Scrapy's default scheduler's (see :mod:`._order`).

    Never raises into Scrapy from :meth:`enqueue_request` or :meth:`next_request`: a raise
    there loses requests or hangs the crawl. A duplicate is refused (False) as Scrapy's
    dupefilter refuses it (see :mod:`._dupes`). A request that cannot be stored is fetched
    from memory under the lease of the request it came from (:meth:`_hold_in_memory`); a
    store that keeps failing closes the spider with reason ``idempotent_store_error``.
    """

    def __init__(self, crawler: Crawler, config: IdempotentConfig,
                 store: FrontierStore | None = None) -> None:
        self.crawler = crawler
        self.config = config
        self.stats = crawler.stats
        self.worker = worker_id()
        self.store: FrontierStore = store or open_store(config.database,
                                                        **config.store_options())
        self.identity = RecordIdentity(
            source=config.source,
            natural_keys=config.natural_keys,
            url_ignore_params=config.url_ignore_params,
            record_id_field=config.record_id_field,
            volatile_fields=config.volatile_fields,
        )
        self.spider: Spider | None = None
        self.codec: RequestCodec | None = None
        self._fingerprinter = crawler.request_fingerprinter
        self._local: deque[Any] = deque()  # LeasedRequest claimed, not yet handed out
        self._inflight: dict[int, Entry] = {}  # id(handed-out request) -> entry
        self._by_fingerprint: dict[str, Entry] = {}
        self._tracked: dict[int, tuple[Entry | None, Any]] = {}  # id(child request) -> owner
        self._items: dict[int, ItemTag] = {}  # id(item) -> tag
        self._continuations: dict[int, tuple[Entry, Request]] = {}
        self._start_requests: dict[int, Request] = {}
        self._root_counts: dict[str, int] = {}
        self._pending = Pending()
        self._started: list[str] = []  # keys handed out since the last transaction
        self._replayed: list[str] = []  # keys answered from the journal since then
        self._journal: list[tuple[Entry, str, bytes]] = []  # responses to journal
        self._suspects_inflight = 0
        self._renewed_until = 0.0  #: leases held at the last renewal last until then
        self._flush_call: Any = None
        self._maybe_claimable = True
        self._recheck_at = 0.0
        self._dead_check_at = 0.0
        self._closing = False
        self._failed = False
        self._warned_page_key = False
        self._hooks: engine_hooks.EngineHooks | None = None
        self._session = False  # a session was begun in the store (open() got that far)
        settings = crawler.settings
        self._httperror_allow_all = settings.getbool("HTTPERROR_ALLOW_ALL")
        self._httperror_allowed = [int(s) for s in settings.getlist("HTTPERROR_ALLOWED_CODES")]
        self._order = QueueOrder.from_settings(settings)
        self._dupes = DuplicateFilter.from_settings(settings, crawler.stats)
        #: fingerprints of filtered requests buffered for a transaction (duplicates of these
        #: are refused before they reach the database)
        self._buffered: Counter[str] = Counter()
        self._fingerprint_errors: set[str] = set()  # exception types logged
        #: requests that cannot be stored, to fetch from memory: heap of (-priority, queue,
        #: order, sequence, entry), in Scrapy's order; see _hold_in_memory
        self._memory: list[tuple[int, int, int, int, Entry]] = []
        self._memory_seq = 0
        #: fingerprint of a filtered memory request -> the entry it lives under (None: of
        #: start(), for the whole crawl); forgotten when that entry is lost, or completed
        #: other than done (a later lease of it yields the request again)
        self._memory_seen: dict[str, Entry | None] = {}
        self._unstorable_causes: set[str] = set()  # logged
        #: id(entry) -> entry whose own request is finished, waiting for its memory requests
        self._waiting: dict[int, Entry] = {}
        self._renewal: task.LoopingCall | None = None
        self._before_end: list[Callable[[FrontierStore, int, bool], Any]] = []
        #: key -> (request, fingerprint) of completions on their way to the database: the
        #: request_done signal is sent for each once the transaction writing it has committed
        self._announce: dict[str, tuple[Request | None, str]] = {}
        self.run_id: int | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """Read and validate the ``IDEMPOTENT_*`` settings (a bad one raises
        :class:`~.ConfigError` here, before the first request)."""
        assert crawler.spider is not None
        with engine_hooks.start_failure_exits_nonzero(crawler):
            return cls(crawler, config_for(crawler))

    # -- lifecycle --------------------------------------------------------------------------

    def open(self, spider: Spider) -> None:
        """Open the store, join or start a run, reclaim the leases of this host's dead
        workers, and hook into the engine. Raises :class:`~.StoreError` or
        :class:`~.UnsupportedScrapy` before anything is fetched (and ``scrapy crawl`` then
        exits non-zero)."""
        with engine_hooks.start_failure_exits_nonzero(self.crawler):
            self._open(spider)

    def _open(self, spider: Spider) -> None:
        self.spider = spider
        self.codec = RequestCodec(spider, self.config.request_classes)
        fingerprinter = type(self._fingerprinter)
        name = f"{fingerprinter.__module__}.{fingerprinter.__qualname__}"
        identity = CrawlIdentity(project=str(self.crawler.settings.get("BOT_NAME") or ""),
                                 spider=spider.name, source=self.config.source)
        changed = self._retry("opening", lambda: self.store.open(fingerprinter=name,
                                                                  identity=identity))
        run = self._retry("starting", lambda: self.store.begin_session(
            self.worker, self.config.run_mode))
        _LIVE_WORKERS.add(self.worker)
        self._session = True
        if changed is not None:
            logger.warning(
                "The frontier in %s was built with request fingerprinter %s; this crawl uses "
                "another one, so known requests may be fetched again.",
                redacted(self.config.database), changed,
            )
        reclaimed = self._reclaim_dead_workers()
        # begin_session counted the frontier already (a full scan on a big one): derive the
        # figures after the reclaim instead of counting again
        counts = dict(run.counts)
        counts["pending"] += reclaimed
        counts["leased"] -= reclaimed
        self.run_id = run.run_id
        self.stats.set_value("idempotent/run_id", run.run_id)
        logger.info(
            "scrapy_idempotent %s: %s run %d in %s: %d pending, %d leased (%d reclaimed from "
            "dead workers), %d done, %d failed, %d records",
            __version__, "started" if run.new else "resumed", run.run_id,
            redacted(self.config.database), counts["pending"], counts["leased"], reclaimed,
            counts["done"] + counts["redirected"], counts["failed"], counts["records"],
        )
        self._hooks = engine_hooks.EngineHooks(self.crawler.engine, self)
        self._hooks.install()
        from scrapy import signals

        self.crawler.signals.connect(self._engine_stopped, signal=signals.engine_stopped)
        self._renewal = task.LoopingCall(self._tick)
        self._renewal.start(self.config.lease_seconds / 3, now=False)

    def before_session_end(self, hook: Callable[[FrontierStore, int, bool], Any]) -> None:
        """Call ``hook(store, run_id, finishing)`` (a coroutine function) at close, once every
        write of this crawl is committed and before the run can be marked finished; a kill
        during the hook, or an exception it raises, leaves the run unfinished, so the next
        crawl calls it again. ``finishing``: this close ends the run. The feed exporter writes
        the feeds here."""
        self._before_end.append(hook)

    def close(self, reason: str) -> Deferred[None] | None:
        """Flush what is buffered, run the :meth:`before_session_end` hooks, release this
        worker's remaining leases (a graceful stop frees them at once), and record the end of
        this session; on ``finished`` with an empty frontier the run is marked finished."""
        self._closing = True
        if self._renewal is not None and self._renewal.running:
            self._renewal.stop()
        if self._hooks is not None:
            self._hooks.remove()
        if not self._session:  # open() failed before the store was usable: nothing to close
            self.store.close()
            return None
        if self._before_end and not self._failed:
            from scrapy.utils.defer import deferred_from_coro

            return deferred_from_coro(self._close_after_hooks(reason))
        self._end_session(reason)
        return None

    async def _close_after_hooks(self, reason: str) -> None:
        hook_failed = False
        try:
            self._commit(UnitOfWork())
            finishing = False
            if reason == "finished" and not self._failed and self.run_id is not None:
                counts = self.store.counts()
                finishing = not counts["pending"] and not counts["leased"]
            if not self._failed and self.run_id is not None:
                for hook in self._before_end:
                    try:
                        await hook(self.store, self.run_id, finishing)
                    except Exception as exc:
                        hook_failed = True
                        logger.error("scrapy_idempotent: %s", exc,
                                     exc_info=not _is_feed_not_stored(exc))
        finally:
            self._end_session(reason, finish_run=not hook_failed)

    def _end_session(self, reason: str, finish_run: bool = True) -> None:
        try:
            if not self._failed:
                self._commit(UnitOfWork())
            inflight = [entry.key for entry in self._leased_entries()]
            released = self._retry("closing", lambda: self.store.end_session(
                self.worker, reason, inflight, finish_run=finish_run))
            if released:
                self.stats.inc_value("idempotent/requests/released", released)
            self._reclaim_space(everything=True)
            self._local.clear()
            counts = self.store.counts()
            records = counts["records"]
            fetched = self.stats.get_value("idempotent/requests/leased", 0)
            if records:
                self.stats.set_value("idempotent/requests_per_record",
                                     round(fetched / records, 3))
            done_filtered = self.stats.get_value("idempotent/requests/already_done", 0)
            logger.info(
                "scrapy_idempotent: closing (%s): %d pending, %d leased, %d done, %d failed, "
                "%d records; %d requests released; %d requests not fetched because already "
                "done",
                reason, counts["pending"], counts["leased"],
                counts["done"] + counts["redirected"], counts["failed"], records, released,
                done_filtered,
            )
        except Exception:
            logger.exception("scrapy_idempotent: error while closing the frontier")
        finally:
            _LIVE_WORKERS.discard(self.worker)
            self.store.close()

    def _engine_stopped(self) -> None:
        """A crawl closed by a store error must not look successful: ``scrapy crawl`` (and
        ``runspider``) exit with 1 only when the crawl failed to start, which Scrapy (2.12
        to 2.19) tells by the crawler having no spider once the crawl is over
        (``CrawlerProcess._crawl``: ``bootstrap_failed |= not crawler.spider``). Engine
        stopped is the last signal of a crawl, after every extension's close work."""
        if self._failed:
            self.crawler.spider = None

    # -- what the engine hooks report (engine_hooks.EngineObserver) -------------------------

    def request_finished(self, request: Request) -> None:
        """The engine is done with ``request``: complete its entry (if it is ours)."""
        try:
            self._finish(request)
        except Exception:
            logger.exception("scrapy_idempotent: error completing %s", describe(request))

    def downloader_output(self, result: Request | Response | Failure,
                          request: Request) -> None:
        entry = self._inflight.get(id(request))
        if entry is not None:
            self._count_download(entry)
            self._observe(entry, result)

    def spider_output(self, result: Any, request: Request,
                      response: Response | Failure) -> Any:
        # The final output of a callback or errback, with the request the engine handed
        # out: what RecordIdMiddleware did not see (errback output bypasses every spider
        # middleware; a project's middleware nearer the engine adds output) is
        # attributed here.
        entry = self._inflight.get(id(request))
        page_url = response.url if isinstance(response, Response) else request.url
        return self._track_output(result, entry, page_url)

    def spider_error(self, failure: Failure, request: Request,
                     response: Response | Failure) -> None:
        # Every exception of a callback or errback, CloseSpider included (which sends no
        # spider_error signal), with the request the engine handed out.
        entry = self._inflight.get(id(request))
        if entry is not None:
            self._observe_error(entry, failure)

    @contextlib.contextmanager
    def item_in_pipelines(self, item: Any,
                          response: Response | Failure | None) -> Iterator[None]:
        if id(item) not in self._items:
            # not seen on its way (an item of start() added by a project's middleware
            # nearer the engine): the response names the request it belongs to
            if isinstance(response, Response):
                self.track(item, self.entry_for(response), response.url)
            else:
                self.track(item, None, None)
        token = _ITEM_IN_PIPELINES.set(self._items.get(id(item)))
        try:
            yield
        finally:
            _ITEM_IN_PIPELINES.reset(token)

    # -- the scheduler contract -------------------------------------------------------------

    def has_pending_requests(self) -> bool:
        """True while anything could still be handed out: claimed or buffered requests,
        pending entries, or entries other workers hold (their lease may come back). Never
        raises; on a store error it answers True and lets the close take its course."""
        if self._failed:
            return False
        if self._local or self._pending.requests or self._memory:
            return True
        try:
            status = self.store.status(self.worker)
            if status.claimable:
                self._maybe_claimable = True
                return True
            if status.leased_elsewhere:
                now = time.time()
                if now >= self._dead_check_at:
                    self._dead_check_at = now + 1.0
                    if self._reclaim_dead_workers() or self.store.reclaim_expired():
                        self._maybe_claimable = True
                return True
            return False
        except Exception:
            logger.exception("scrapy_idempotent: cannot read the frontier")
            self._fail("cannot read the frontier")
            return False

    def request_state(self, fingerprint: str) -> str | None:
        """What this crawl knows of requests with ``fingerprint`` (hex), for inputs that
        wait on a request they fed: ``"buffered"`` (accepted by this worker, written with its
        next transaction), ``"duplicate"`` (pending or leased in the frontier),
        ``"already_done"`` (finished in this recrawl window: its ``request_done`` was sent), or
        None (unknown, or due again). A read outside any transaction; raises StoreError."""
        if self._buffered[fingerprint] or fingerprint in self._memory_seen:
            return "buffered"
        return self.store.known_request(fingerprint)

    def enqueue_request(self, request: Request) -> bool:
        """Add ``request`` to the frontier (buffered until the transaction that completes the
        request it came from), or keep it in memory when it cannot be stored. Returns False
        for a duplicate and for a request the fingerprinter fails on. Never raises."""
        try:
            return self._enqueue(request)
        except Exception:
            logger.exception("scrapy_idempotent: cannot enqueue %s", describe(request))
            self._fail(f"cannot enqueue {describe(request)}")
            return False

    def next_request(self) -> Request | None:
        """The next request under lease, or None when nothing can be claimed now. Never
        raises."""
        if self._failed or self._closing:
            return None
        try:
            while True:
                if self._suspects_inflight:
                    # a suspect runs alone (see below), with its own memory requests (each
                    # holds the suspect's lease)
                    return self._hand_out_memory() if self._memory else None
                if not self._local and not self._refill():
                    return self._hand_out_memory() if self._memory else None
                if self._memory and self._memory_first():
                    return self._hand_out_memory()
                if self._local[0].suspect and self._inflight:
                    # A request that was in flight at two deaths of a worker is a suspect:
                    # it runs with nothing else in flight, so that if it kills the crawl
                    # again, it alone is blamed (IDEMPOTENT_MAX_ATTEMPTS), not its
                    # neighbours. Requests in flight at one death are replayed at full
                    # concurrency: a resume after a kill is not serialised.
                    return None
                if max(self._local[0].leased_until, self._renewed_until) <= time.time():
                    # The batch claimed ahead sat here past its lease (the process was
                    # stopped, or the reactor blocked): another worker may have it now.
                    self._renew()
                    continue
                leased = self._local.popleft()
                request = self._load(leased)
                if request is not None:
                    return request
        except Exception:
            logger.exception("scrapy_idempotent: cannot lease the next request")
            self._fail("cannot lease the next request")
            return None

    def __len__(self) -> int:
        """Pending and leased entries in the frontier (all workers), plus buffered ones."""
        counts = self.store.counts()
        return (counts["pending"] + counts["leased"] + len(self._pending.requests)
                + len(self._memory))

    # -- enqueue ----------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> bool:
        assert self.codec is not None
        self.stats.inc_value("idempotent/requests/enqueued")
        is_start = self._start_requests.pop(id(request), None) is not None
        parent: Entry | None = None
        continuation = self._continuations.pop(id(request), None)
        if continuation is not None:
            parent = continuation[0]
        else:
            owner = self._tracked.pop(id(request), None)
            if owner is not None:
                parent = owner[0]
                if parent is not None:
                    parent.tracked.pop(id(request), None)
        fingerprint = self._fingerprint(request)
        if fingerprint is None:
            self._refuse_unidentified(request, parent, continuation is not None)
            return False
        filtered = self._dupes.enabled and not request.dont_filter
        # A retry continues the same frontier entry: from the downloader (RetryMiddleware, a
        # redirect to the same request) or get_retry_request() yielded by the callback (one
        # more retry_times than its request). Other requests, even dont_filter ones to the
        # page's own URL, are new entries.
        retry_of = parent if parent is not None and fingerprint == parent.fingerprint and (
            continuation is not None or (
                request.dont_filter and parent.continuation is None
                and _retry_times(request) == _retry_times(parent.request) + 1)
        ) else None
        if filtered and retry_of is None:
            # Most enqueued requests are rediscovered links: known ones (in the frontier, or
            # buffered for the next transaction) are refused like Scrapy's dupefilter does,
            # without being encoded or written.
            known = "duplicate" if self._buffered[fingerprint] or \
                fingerprint in self._memory_seen else self.store.known_request(fingerprint)
            if known is not None:
                self.stats.inc_value(f"idempotent/requests/{known}")
                self._dupes.filtered(request)
                self._announce_known(known, request, fingerprint, fingerprint)
                return False
        key: str | None = None
        if parent is None and continuation is None and not filtered:
            # A start request replayed by a restarted start() (Scrapy runs it from the top
            # on every crawl): when its key is known, one read decides, without encoding it
            # or writing a transaction for it (a resume over a long start list that is
            # mostly done starts downloading at once). The commit would count it the same.
            key = self._key(filtered, fingerprint, None, is_start)
            known = self.store.known_request(fingerprint, key=key)
            if known is not None:
                self.stats.inc_value(f"idempotent/requests/{known}")
                self._announce_known(known, request, key, fingerprint)
                return True
        try:
            if retry_of is not None and retry_of.memory:
                raise UnstorableRequest(describe(request), "request",
                                        "a retry of a request fetched from memory")
            data = self.codec.encode(request)
        except UnstorableRequest as exc:
            return self._hold_in_memory(
                request, exc, fingerprint, parent, is_start, key, filtered,
                continues=continuation is not None or retry_of is not None)
        if retry_of is not None:
            retry_of.continuation = (data, request.priority)
            self.stats.inc_value("idempotent/requests/retried")
            return True
        start_queue, fifo = self._order.place(request)
        new = NewRequest(
            key=key if key is not None else self._key(filtered, fingerprint, parent, is_start),
            fingerprint=fingerprint,
            url=request.url,
            priority=request.priority,
            data=data,
            parent_key=parent.key if parent is not None else None,
            is_start=start_queue,
            fifo=fifo,
            filter_fingerprint=filtered,
        )
        if filtered:
            self._buffered[fingerprint] += 1
        if parent is not None:
            parent.children.append(new)
        else:
            self._pending.requests.append(new)
        return True

    def _hold_in_memory(self, request: Request, exc: UnstorableRequest, fingerprint: str,
                        parent: Entry | None, is_start: bool, key: str | None,
                        filtered: bool, continues: bool) -> bool:
        """Keep a request that cannot be stored in memory, to be fetched under the lease of
        the stored entry it came from (its owner): the owner is done only when its memory
        requests are, so a kill before that fetches the owner again, which yields the request
        again. Nothing is kept only in memory past its owner's lease. A memory request of
        ``start()`` (or of no request) has no owner: ``start()`` yields it again on every
        crawl. Counted, and logged once per cause. ``key``: the key already derived for it
        (a start request's), else derived here. Refused (False) when its owner's lease is
        lost: nothing more is fetched under it."""
        owner = parent.owner if parent is not None and parent.memory else parent
        if owner is not None and owner.lost:
            self.stats.inc_value("idempotent/requests/lease_lost_dropped")
            return False
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
        entry = Entry(key=key if key is not None else
                      self._key(False, fingerprint, parent, is_start),
                      fingerprint=fingerprint, priority=request.priority, attempts=1,
                      request=request, memory=True, owner=owner,
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
        start_queue, fifo = self._order.place(request)
        self._memory_seq += 1
        order = self._memory_seq if fifo else -self._memory_seq
        heapq.heappush(self._memory, (-request.priority, int(start_queue), order,
                                      self._memory_seq, entry))
        return True

    def _memory_first(self) -> bool:
        """Whether the head of the memory requests goes before the head of the batch claimed
        ahead: the same rule as the claim (priority, then other requests before start ones,
        then, at equal place, the newer first for a LIFO queue, the older for a FIFO one: a
        memory request is newer than what was claimed before it was yielded). Before a
        suspect, memory requests go first: they hold leases already taken."""
        head = self._local[0]
        if head.suspect:
            return True
        neg_priority, start_queue, order, *_ = self._memory[0]
        mine = (neg_priority, start_queue)
        theirs = (-head.priority, int(head.is_start))
        if mine != theirs:
            return mine < theirs
        return order < 0  # LIFO: the memory request is the newer

    def _hand_out_memory(self) -> Request:
        *_, entry = heapq.heappop(self._memory)
        self._inflight[id(entry.request)] = entry
        self.stats.inc_value("idempotent/requests/from_memory")
        return entry.request

    def _finish_memory(self, entry: Entry) -> None:
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
        completion = entry.completion()
        if owner is None:
            if children:
                self._maybe_claimable = True
            self._commit(UnitOfWork(requests=children, records=records, rejects=rejects))
            return
        owner.children.extend(children)
        owner.records.extend(records)
        owner.rejects.extend(rejects)
        if entry.interrupted:
            owner.interrupted = True
        elif completion.state is RequestState.FAILED and owner.failure is None:
            kind = completion.error_kind or "failed"
            owner.failure = (
                kind if entry.continues_owner else f"unstorable_child/{kind}",
                f"{describe(entry.request)} (fetched from memory: it cannot be stored): "
                f"{completion.error_message or kind}"[:1000])
        owner.waiting -= 1
        self._settle_if_done(owner)

    def _settle_if_done(self, owner: Entry) -> None:
        """Complete ``owner`` once its own request and its memory requests are finished."""
        if owner.waiting == 0 and owner.own_finished:
            del self._waiting[id(owner)]
            self._complete(owner)

    def _fingerprint(self, request: Request) -> str | None:
        """The request's fingerprint (hex), or None when the request fingerprinter raises
        (logged once per exception type, with its traceback)."""
        try:
            return self._fingerprinter.fingerprint(request).hex()
        except Exception as exc:
            cause = type(exc).__name__
            if cause not in self._fingerprint_errors:
                self._fingerprint_errors.add(cause)
                fingerprinter = type(self._fingerprinter)
                logger.error(
                    "scrapy_idempotent: the request fingerprinter %s.%s raised %s for %s: "
                    "such a request has no identity in the frontier and is not fetched "
                    "(further %s errors are counted in idempotent/requests/unidentified)",
                    fingerprinter.__module__, fingerprinter.__qualname__, cause,
                    describe(request), cause, exc_info=True)
            return None

    def _refuse_unidentified(self, request: Request, parent: Entry | None,
                             continuation: bool) -> None:
        """A request whose fingerprint cannot be computed is refused (``request_dropped``);
        the request it came from ends failed, so the loss stays visible and retryable."""
        self.stats.inc_value("idempotent/requests/unidentified")
        message = f"the request fingerprinter failed for {describe(request)}"
        if parent is not None and continuation:
            # its retry or redirect has no identity: it did not get its page
            parent.failure = ("fingerprint_error", message)
            parent.continuation = None
        elif parent is not None and parent.failure is None:
            parent.failure = ("fingerprint_error_child", message)

    def _key(self, filtered: bool, fingerprint: str, parent: Entry | None,
             is_start: bool) -> str:
        if filtered:
            return fingerprint
        if parent is not None:
            scope = parent.key
            parent.dont_filter_counts[fingerprint] += 1
            rank = parent.dont_filter_counts[fingerprint]
        else:
            scope = "start" if is_start else "orphan"
            rank = self._root_counts[f"{scope}|{fingerprint}"] = (
                self._root_counts.get(f"{scope}|{fingerprint}", 0) + 1)
        return hashlib.sha1(f"{scope}|{fingerprint}|{rank}".encode()).hexdigest()

    # -- lease ------------------------------------------------------------------------------

    def _claim_size(self) -> int:
        if self._closing or not self._maybe_claimable:
            return 0
        if len(self._local) >= max(1, self.config.lease_batch // 2):
            return 0
        return self.config.lease_batch - len(self._local)

    def _refill(self) -> bool:
        now = time.time()
        if not self._maybe_claimable and now < self._recheck_at and not self._pending:
            return False
        self._maybe_claimable = True
        claim = self._claim_size()
        result = self._commit(UnitOfWork(claim=claim))
        if result is None:
            return False
        if not result.leased:
            self._maybe_claimable = False
            self._recheck_at = now + 1.0
        return bool(self._local)

    def _load(self, leased: Any) -> Request | None:
        assert self.codec is not None
        try:
            request = self.codec.decode(leased.data)
        except Exception as exc:
            self.stats.inc_value("idempotent/requests/unloadable")
            logger.error("scrapy_idempotent: cannot load stored request %s: %s", leased.key, exc)
            self._pending.completions.append(
                Completion(leased.key, RequestState.FAILED, "unloadable", str(exc)))
            self._announce[leased.key] = (None, leased.fingerprint)
            return None
        entry = Entry(key=leased.key, fingerprint=leased.fingerprint, priority=leased.priority,
                      attempts=leased.attempts, request=request, suspect=leased.suspect,
                      downloads=leased.downloads)
        if leased.suspect:
            self._suspects_inflight += 1
        self._inflight[id(request)] = entry
        self._by_fingerprint[leased.fingerprint] = entry
        # The attempt counts once the request is handed out; written in the next transaction,
        # at the latest at the next turn of the reactor (before its download can finish).
        self._started.append(leased.key)
        self._flush_soon()
        self.stats.inc_value("idempotent/requests/leased")
        if leased.attempts > 1:
            self.stats.inc_value("idempotent/requests/repeated")
        return request

    # -- observing the engine ---------------------------------------------------------------

    def _count_download(self, entry: Entry) -> None:
        """The downloader answered ``entry``: a download, unless the journal answered."""
        if entry.replayed:
            return
        self.stats.inc_value("idempotent/requests/downloaded")
        if entry.downloads:
            self.stats.inc_value("idempotent/requests/downloaded_again")

    def _observe(self, entry: Entry, result: Any) -> None:
        if isinstance(result, Request):  # a redirect or retry from a downloader middleware
            self._continuations[id(result)] = (entry, result)
            if self._fingerprint(result) != entry.fingerprint:
                entry.redirected = True
        elif isinstance(result, Response):
            entry.status = result.status
            entry.http_error = not self._status_handled(result)
        elif isinstance(result, Failure):
            exc = result.value
            kind = "ignored" if isinstance(exc, IgnoreRequest) else "download_error"
            entry.failure = (f"{kind}/{engine_hooks.failure_name(exc)}", str(exc)[:1000])

    def _status_handled(self, response: Response) -> bool:
        """Whether the callback sees this response (HttpErrorMiddleware's rule)."""
        if 200 <= response.status < 300:
            return True
        meta = response.meta
        if meta.get("handle_httpstatus_all", False):
            return True
        if "handle_httpstatus_list" in meta:
            return response.status in meta["handle_httpstatus_list"]
        if self._httperror_allow_all:
            return True
        allowed = getattr(self.spider, "handle_httpstatus_list", self._httperror_allowed)
        return response.status in allowed

    @staticmethod
    def _observe_error(entry: Entry, failure: Failure) -> None:
        exc = failure.value
        if isinstance(exc, CloseSpider):
            # The callback stopped the crawl: its page is not done; it stays due.
            entry.interrupted = True
        elif entry.spider_error is None:
            entry.spider_error = (f"spider_error/{type(exc).__name__}", str(exc)[:1000])

    # -- attribution (used by RecordIdMiddleware and the errback hook) ----------------------

    def entry_for(self, response: Response) -> Entry | None:
        """The in-flight entry ``response`` answers, or None if it is not ours."""
        request = response.request
        if request is None:
            return None
        entry = self._inflight.get(id(request))
        if entry is None:
            fingerprint = self._fingerprint(request)
            entry = self._by_fingerprint.get(fingerprint) if fingerprint is not None else None
        return entry

    def inflight_entry(self, request: Request) -> Entry | None:
        """The entry of a request this scheduler handed out and the engine still works on."""
        return self._inflight.get(id(request))

    def mark_start(self, request: Request) -> None:
        """Remember that ``request`` came from ``Spider.start()`` (keys ``dont_filter`` start
        requests deterministically)."""
        self._start_requests[id(request)] = request

    def track(self, output: Any, entry: Entry | None, page_url: str | None) -> None:
        """Attribute one output of a callback (or errback) to the entry that produced it; for
        an item also compute its record ID and stamp it into the item when the item type has
        room for ``IDEMPOTENT_RECORD_ID_FIELD``."""
        if isinstance(output, Request):
            if entry is not None:
                self._tracked[id(output)] = (entry, output)
                entry.tracked[id(output)] = output
            return
        if output is None or not is_item(output):
            return  # not an item (Scrapy passes such output on as it is): nothing to key
        tag = ItemTag(item=output, entry=entry, record_id=None, key_values=None,
                      page_url=page_url)
        try:
            tag.key_values = self.identity.natural_key(output, page_url)
            tag.record_id = self.identity.record_id(tag.key_values)
        except MissingNaturalKey as exc:
            tag.error = exc
        else:
            if entry is not None and self.identity.key_fields(output) is None:
                position = self._page_position(entry, tag.key_values[0], output)
                if position is not None:
                    tag.key_values = [*tag.key_values, *position]
                    tag.record_id = self.identity.record_id(tag.key_values)
            self._stamp(output, tag.record_id)
        self._items[id(output)] = tag
        if entry is not None:
            entry.tracked[id(output)] = output

    def _track_output(self, result: Any, entry: Entry | None, page_url: str) -> Any:
        """``result`` with each output not tracked yet attributed to ``entry``."""
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
        field = self.config.record_id_field
        if field is None:
            return
        from itemadapter import ItemAdapter

        # An item type without such a field keeps its record ID beside it (in the tag).
        with contextlib.suppress(KeyError, TypeError, AttributeError):
            ItemAdapter(item)[field] = record_id

    def _page_position(self, entry: Entry, key: str, item: Any) -> list[str] | None:
        """What tells ``item`` apart from the other items of ``entry``'s page keyed by the
        page URL: None for the page's first such item (its key is the page URL alone), else
        its type and its rank among such items of its type on the page (``#1`` for the
        first). Several items of a page without a configured key are then several records,
        never one that overwrites the others; their identity is their position, stable while
        the page yields them in the same order."""
        type_name = item_type_name(item)
        first = not entry.page_keys
        entry.page_keys[f"{key}|{type_name}"] += 1
        if first:
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
        return [type_name, f"#{entry.page_keys[f'{key}|{type_name}']}"]

    def take_item(self, item: Any) -> ItemTag:
        """What :meth:`track` learnt about ``item`` (the pipeline's side), or a fresh tag for
        an item no middleware saw (an earlier pipeline replaced it, or it came from
        ``start()``)."""
        tag = self._items.pop(id(item), None)
        if tag is not None:
            if tag.entry is not None:
                tag.entry.tracked.pop(id(item), None)
            return tag
        # An earlier pipeline returned another object: the item the pipelines started with
        # tells which request (and page) it belongs to.
        origin = _ITEM_IN_PIPELINES.get()
        entry = origin.entry if origin is not None else None
        page_url = origin.page_url if origin is not None else None
        if entry is not None and id(entry.request) not in self._inflight:
            entry = None
        tag = ItemTag(item=item, entry=entry, record_id=None, key_values=None,
                      page_url=page_url)
        if self.identity.key_fields(item) is None and origin is not None \
                and origin.record_id is not None:
            # keyed by its page (and rank) or its content: the item the pipelines started
            # with names the record, not the content an earlier pipeline changed
            tag.record_id, tag.key_values = origin.record_id, origin.key_values
            return tag
        if not page_url and self.identity.key_fields(item) is None:
            stamped = _stamped_id(item, self.config.record_id_field)
            if stamped is not None:
                tag.record_id, tag.key_values = stamped, []
                return tag
        try:
            tag.key_values = self.identity.natural_key(item, page_url)
            tag.record_id = self.identity.record_id(tag.key_values)
        except MissingNaturalKey as exc:
            tag.error = exc
        return tag

    def add_record(self, tag: ItemTag, record: Any) -> None:
        """Queue a record for the transaction that completes its request."""
        target = tag.entry if tag.entry is not None and id(tag.entry.request) in self._inflight \
            else None
        key = target.key if target is not None else None
        (target.records if target is not None else self._pending.records).append((record, key))

    def add_reject(self, tag: ItemTag, reject: Any) -> None:
        target = tag.entry if tag.entry is not None and id(tag.entry.request) in self._inflight \
            else None
        (target.rejects if target is not None else self._pending.rejects).append(reject)

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

    def _complete(self, entry: Entry) -> None:
        """Write everything ``entry`` produced with its completion, in one transaction."""
        if entry.suspect:
            # counted until its memory requests are finished too: they run inside it
            self._suspects_inflight -= 1
        completion = entry.completion()
        if entry.lost or completion.state is not RequestState.DONE:
            # a later lease of it fetches it again, which yields its memory requests again
            self._forget_memory_seen(entry)
        if entry.lost:
            # its lease was found lost at a renewal: nothing of its work is written (this
            # process may hold the entry again under a new lease by now, which the store's
            # fence by worker would not tell apart)
            self.stats.inc_value("idempotent/requests/leases_lost")
            return
        work = UnitOfWork(requests=entry.children, records=entry.records,
                          rejects=entry.rejects, completions=[completion])
        if entry.children or completion.state is RequestState.PENDING:
            self._maybe_claimable = True
        if completion.state.terminal:
            self._announce[entry.key] = (entry.request, entry.fingerprint)
        self._commit(work)

    def _commit(self, work: UnitOfWork) -> CommitResult | None:
        """Write ``work`` plus everything buffered in one transaction, claiming new leases
        when the local batch runs low. Retries on a locked or failing database, then closes
        the spider (the uncommitted entries stay leased and are released at close)."""
        if self._failed:
            return None
        self._pending.drain_into(work)
        work.started[:0] = self._started
        self._started = []
        work.replayed[:0] = self._replayed
        self._replayed = []
        if self._journal:
            # only requests still in flight: a completed one needs no journal entry
            inflight = self._inflight
            work.responses = [(e.key, data, body) for e, data, body in self._journal
                              if inflight.get(id(e.request)) is e]
            self._journal = []
        if not work.claim:
            work.claim = self._claim_size()
        if work.requests and self._local and not self._closing:
            # New requests may come before the ones claimed ahead (Scrapy's order: a child
            # is taken before older requests of its priority): give those back and claim
            # again in the same transaction.
            work.give_back = [leased.key for leased in self._local]
            work.claim = max(work.claim, self.config.lease_batch)
        if not work:
            return None
        try:
            result = self._retry("committing", lambda: self.store.commit(work, self.worker))
        except Exception as exc:
            logger.error("scrapy_idempotent: cannot write to the frontier database",
                         exc_info=not isinstance(exc, StoreError))
            self._pending.restore_from(work)
            self._started[:0] = work.started
            self._replayed[:0] = work.replayed
            self._fail(
                f"frontier database error: {exc}; what was committed before is kept: fix "
                "the cause and run the same crawl again to resume"
            )
            return None
        self._record_stats(result, work)
        self._announce_completions(result, work)
        buffered = self._buffered
        for written in work.requests:  # (or dropped by the store: no longer buffered)
            if written.filter_fingerprint:
                buffered[written.fingerprint] -= 1
                if buffered[written.fingerprint] <= 0:
                    del buffered[written.fingerprint]
        if work.give_back:
            self._local.clear()
        self._local.extend(result.leased)
        return result

    def _retry(self, what: str, action: Callable[[], _T]) -> _T:
        """``action()``, tried again with back-off while another process holds the database
        locked (:class:`~.StoreBusy`), at most ``_COMMIT_ATTEMPTS`` times; any other store
        error (disk full, read-only, not our schema, an I/O error) is raised at once, as
        retrying cannot cure it. Blocking: each attempt waits up to
        IDEMPOTENT_BUSY_TIMEOUT_SECONDS for the lock."""
        delay = 0.05
        for attempt in range(1, _COMMIT_ATTEMPTS):
            try:
                return action()
            except StoreBusy as exc:
                logger.warning("scrapy_idempotent: database busy while %s (%s), "
                               "retrying (%d/%d)", what, exc, attempt, _COMMIT_ATTEMPTS)
                time.sleep(delay)
                delay *= 2
        return action()

    def _record_stats(self, result: CommitResult, work: UnitOfWork) -> None:
        self._count_completions(result, work)
        for url in result.quarantined:
            logger.warning(
                "scrapy_idempotent: %s quarantined (failed): it was started %d times without "
                "finishing, as if it killed the crawl each time; `scrapy idempotent retry "
                "--kind quarantined` puts it back", strip_url(url, strip_credentials=True),
                self.config.max_attempts)
        inc = self.stats.inc_value
        inc("idempotent/transactions")
        for name, value in (
            ("requests/added", result.requests_added),
            ("requests/duplicate", result.requests_duplicate),
            ("requests/already_done", result.requests_already_done),
            ("requests/due_again", result.requests_due_again),
            ("records/inserted", result.records_inserted),
            ("records/updated", result.records_updated),
            ("records/unchanged", result.records_unchanged),
            ("records/conflicts", result.records_conflicts),
            ("records/rejected", result.rejects),
            ("requests/leases_lost", result.leases_lost),
            ("requests/quarantined", len(result.quarantined)),
        ):
            if value:
                inc(f"idempotent/{name}", value)

    def _count_completions(self, result: CommitResult, work: UnitOfWork) -> None:
        """Stats of the completions written (a lost lease's completion counts nothing)."""
        lost = set(result.lost)
        for completion in work.completions:
            if completion.key in lost:
                continue  # nothing of it was written: it does not count
            self.stats.inc_value(f"idempotent/requests/{completion.state.value}"
                                 if completion.state is not RequestState.PENDING
                                 else "idempotent/requests/continued")
            if completion.error_kind:
                self.stats.inc_value(f"idempotent/failed/{completion.error_kind}")
        if lost:
            logger.warning(
                "scrapy_idempotent: %d completed request(s) were not this worker's any more "
                "(their lease expired, e.g. the process was stopped, and another worker took "
                "them): nothing of their work was written (idempotent/requests/leases_lost)",
                len(lost))

    def _announce_completions(self, result: CommitResult, work: UnitOfWork) -> None:
        """Send ``request_done`` for each final state ``work`` wrote: called once its
        transaction has committed, never before (a lost lease's completion wrote nothing)."""
        lost = set(result.lost) if result.lost else ()
        for completion in work.completions:
            announced = self._announce.pop(completion.key, None)
            if announced is None or completion.key in lost or not completion.state.terminal:
                continue
            request, fingerprint = announced
            signals.send_request_done(self.crawler, self.spider, request, completion.key,
                                      fingerprint, completion.state.value)

    def _announce_known(self, known: str, request: Request, key: str,
                        fingerprint: str) -> None:
        """``request_done`` with state ``already_done`` for a known request refused because
        it is already finished in this window (its final state was committed earlier)."""
        if known == signals.ALREADY_DONE:
            signals.send_request_done(self.crawler, self.spider, request, key, fingerprint,
                                      signals.ALREADY_DONE)

    def _fail(self, reason: str) -> None:
        if self._failed:
            return
        self._failed = True
        self.stats.set_value("idempotent/error", reason)
        logger.error("scrapy_idempotent: closing the spider: %s", reason)
        engine_hooks.close_spider(self.crawler, STORE_ERROR_REASON)

    def journal_response(self, entry: Entry, data: str, body: bytes) -> None:
        """Keep the raw response of an in-flight request (see :mod:`.journal`): written at
        the next turn of the reactor, with the other writes of that moment. Not for memory
        requests (nothing of theirs is stored)."""
        if entry.memory:
            return
        self._journal.append((entry, data, body))
        self._flush_soon()

    def _flush_soon(self) -> None:
        if self._flush_call is None or not self._flush_call.active():
            from twisted.internet import reactor as installed  # the one Scrapy installed

            clock: Any = installed
            self._flush_call = clock.callLater(0, self._flush)

    def mark_replayed(self, entry: Entry) -> None:
        """``entry``'s response came from the response journal: this attempt is not a
        download (written at the next turn of the reactor, with the other writes)."""
        self._replayed.append(entry.key)
        self._flush_soon()

    def _flush(self) -> None:
        if ((self._started or self._journal or self._replayed)
                and not self._failed and not self._closing):
            self._commit(UnitOfWork())

    # -- periodic work ----------------------------------------------------------------------

    def _tick(self) -> None:
        """Every lease_seconds / 3: renew this worker's leases (one statement for all),
        flush buffered writes, reclaim expired leases."""
        if self._failed or self._closing:
            return
        try:
            self._renew()
            if self._pending:
                self._commit(UnitOfWork())
        except Exception:
            logger.exception("scrapy_idempotent: cannot renew leases")
            return
        self._reclaim_space(everything=False)

    def _reclaim_space(self, *, everything: bool) -> None:
        """Give the space of deleted journal rows back to the file system (every tick when
        there is enough of it, everything at close), so big pages do not leave the file at
        its peak size. A failure here is logged and otherwise ignored: the space stays
        free inside the file and is reused."""
        try:
            freed = self.store.reclaim_space(everything=everything)
        except Exception as exc:
            logger.warning("scrapy_idempotent: could not give free space back: %s", exc)
            return
        if freed:
            self.stats.inc_value("idempotent/bytes_reclaimed", freed)

    def _renew(self) -> None:
        """Renew this worker's live leases (one statement) and forget those that expired:
        the requests claimed ahead are dropped (never handed out), and a request in flight
        whose lease expired is finished without writing anything (the store fences it)."""
        began = time.time()
        held = set(self._retry("renewing leases",
                               lambda: self.store.renew_leases(self.worker)))
        self._renewed_until = began + self.config.lease_seconds
        if held:
            self.stats.inc_value("idempotent/leases/renewals")
        stale = [leased for leased in self._local if leased.key not in held]
        if stale:
            self._local = deque(leased for leased in self._local if leased.key in held)
            self._maybe_claimable = True
        lost = [entry for entry in self._leased_entries()
                if entry.key not in held and not entry.lost]
        expired = len(lost)
        self._lose(lost)
        if stale or expired:
            self.stats.inc_value("idempotent/leases/expired", len(stale) + expired)
            logger.warning(
                "scrapy_idempotent: %d leases of this worker expired before they were "
                "renewed (the process was stopped or too busy for IDEMPOTENT_LEASE_SECONDS); "
                "%d claimed requests are given up without being fetched, and the work of %d "
                "in flight is not written unless the lease is still this worker's",
                len(stale) + expired, len(stale), expired)

    def _lose(self, entries: list[Entry]) -> None:
        """The leases of ``entries`` are lost: their memory requests not handed out yet are
        dropped (a worker that lost its leases stops handing out what it claimed), those in
        flight are finished without writing anything, and their fingerprints are forgotten
        (whoever leases the entry next fetches it and they are yielded again)."""
        for entry in entries:
            entry.lost = True
            self._forget_memory_seen(entry)
        kept = [item for item in self._memory
                if item[-1].owner is None or not item[-1].owner.lost]
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

    def _forget_memory_seen(self, entry: Entry) -> None:
        for fingerprint in entry.memory_seen:
            if self._memory_seen.get(fingerprint) is entry:
                del self._memory_seen[fingerprint]
        entry.memory_seen.clear()

    def _leased_entries(self) -> list[Entry]:
        """Entries this worker started and has not completed: in flight, or waiting for
        their memory requests (not the memory requests: they have no lease)."""
        entries = [entry for entry in self._inflight.values() if not entry.memory]
        entries.extend(self._waiting.values())
        return entries

    def _reclaim_dead_workers(self) -> int:
        dead = [h.worker for h in self.store.lease_holders()
                if h.worker != self.worker and worker_is_dead(h.worker)]
        reclaimed = self.store.release_leases(dead) if dead else 0
        if reclaimed:
            self.stats.inc_value("idempotent/requests/reclaimed", reclaimed)
            self._maybe_claimable = True
            logger.info("scrapy_idempotent: reclaimed %d leases of dead workers %s",
                        reclaimed, ", ".join(dead))
        return reclaimed


def _retry_times(request: Request) -> int:
    """How many times ``request`` is a retry (RetryMiddleware's ``retry_times`` meta key)."""
    value = request.meta.get("retry_times", 0)
    return value if isinstance(value, int) else 0


def _stamped_id(item: Any, field: str | None) -> str | None:
    if field is None:
        return None
    from itemadapter import ItemAdapter

    value = ItemAdapter(item).get(field)
    return value if isinstance(value, str) and len(value) == 32 else None

