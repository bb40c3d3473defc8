"""``IdempotentScheduler``: Scrapy's scheduler on a durable frontier with leases.

Set ``SCHEDULER = "scrapy_idempotent.IdempotentScheduler"`` (the add-on does it). The
scheduler keeps every request in the store, hands them out under a lease, and marks a request
done only when Scrapy has completely finished with it, in the same transaction as the records
and child requests its response produced ("done is the last write").

This module is the scheduler contract (``open``, ``close``, ``enqueue_request``,
``next_request``, ``has_pending_requests``, ``__len__``) and the crawl's lifecycle in the
store. Its collaborators are built by :meth:`IdempotentScheduler.from_crawler` and handed in:

* the store (:class:`~.FrontierStore`): the durable frontier;
* :class:`~.InflightTracker` (:mod:`.inflight`): what each handed-out request produced and
  how it went; the engine hooks report to it, the spider middleware and the pipeline use it;
* :class:`~.WriterThread` (:mod:`.writer`): every write of the crawl, on a thread of its own,
  page commits grouped; :class:`~.CommitOutcomes` (:mod:`.commits`): what follows a durable
  commit (stats, warnings, the ``request_done`` signal);
* :class:`~.ClaimedRequests` (:mod:`.leases`): the requests claimed ahead;
* :class:`~.RequestKeys` and :class:`~.RequestFingerprints` (:mod:`.keys`): request identity.

When is a request finished? Not when a spider middleware's output iterator ends: items are
processed concurrently and child requests reach the scheduler later. The exact moment is the
engine's ``_slot.remove_request(request)``, which fires once per handed-out request after its
items went through the pipelines and its children were enqueued, whatever the outcome. It is
private API: :class:`~.engine_hooks.EngineHooks` wraps it (and the engine's other steps the
tracker observes), checks at open that every hook exists on the running Scrapy, refusing
to run otherwise (:class:`~.UnsupportedScrapy`), and reports to the tracker.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scrapy.core.scheduler import BaseScheduler
from twisted.internet import task

from . import __version__, engine_hooks, scrapy_compat, signals, workers
from ._dupes import DuplicateFilter
from .codec import RequestCodec, describe
from .commits import CommitOutcomes, retry_busy
from .config import IdempotentConfig, config_for
from .exceptions import StoreBusy, StoreError, UnstorableRequest
from .inflight import HttpStatusRule, InflightRequest, InflightTracker, RequestOrigin
from .keys import RequestFingerprints, RequestKeys
from .leases import ClaimedRequests, QueueRank, queue_rank, queue_rank_of_new
from .records import RecordIdentity
from .store.base import (
    Completion,
    CrawlIdentity,
    FrontierStore,
    NewRequest,
    RequestState,
    UnitOfWork,
)
from .store.registry import open_store, redacted
from .writer import LINGER_SECONDS, WriterThread

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure
    from typing_extensions import Self

    from .store.base import CommitResult, LeasedRequest

__all__ = ["STORE_ERROR_REASON", "IdempotentScheduler", "is_idempotent_scheduler"]

logger = logging.getLogger(__name__)

#: Reason the spider closes with when the store keeps failing.
STORE_ERROR_REASON = "idempotent_store_error"

#: Former methods of the scheduler, now the in-flight tracker's (name there).
_MOVED_TO_TRACKER = {
    "take_item": "take_item",
    "add_record": "add_record",
    "add_reject": "add_reject",
    "track": "track",
    "mark_start": "mark_start",
    "entry_for": "for_response",
    "inflight_entry": "for_request",
    "journal_response": "keep_response",
    "mark_replayed": "mark_replayed",
    "item_in_pipelines": "item_in_pipelines",
}
#: Former module attributes, now :mod:`scrapy_idempotent.workers`'.
_MOVED_TO_WORKERS = {"worker_id": "new_worker_id", "worker_is_dead": "worker_is_dead"}


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_WORKERS:
        warnings.warn(f"scrapy_idempotent.scheduler.{name} is deprecated: use "
                      f"scrapy_idempotent.workers.{_MOVED_TO_WORKERS[name]}",
                      DeprecationWarning, stacklevel=2)
        return getattr(workers, _MOVED_TO_WORKERS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _retry_times(request: Request) -> int:
    """How many times ``request`` is a retry (RetryMiddleware's ``retry_times`` meta key)."""
    value = request.meta.get("retry_times", 0)
    return value if isinstance(value, int) else 0


def _build_tracker(crawler: Crawler, config: IdempotentConfig,
                   fingerprints: RequestFingerprints) -> InflightTracker:
    assert crawler.stats is not None
    return InflightTracker(
        stats=crawler.stats,
        identity=RecordIdentity(
            source=config.source,
            natural_keys=config.natural_keys,
            url_ignore_params=config.url_ignore_params,
            record_id_field=config.record_id_field,
            volatile_fields=config.volatile_fields,
        ),
        fingerprints=fingerprints,
        order=config.queue_order,
        http_status=HttpStatusRule(allow_all=config.httperror_allow_all,
                                   allowed=config.httperror_allowed_codes),
    )


class IdempotentScheduler(BaseScheduler):
    """A durable, leased frontier as Scrapy's scheduler.

    Enqueue is idempotent by request key (see :mod:`.keys`). Leasing order: Scrapy's default
    scheduler's (see :mod:`._order`).

    Never raises into Scrapy from :meth:`enqueue_request` or :meth:`next_request`: a raise
    there loses requests or hangs the crawl. A duplicate is refused (False) as Scrapy's
    dupefilter refuses it (see :mod:`._dupes`). A request that cannot be stored is fetched
    from memory under the lease of the request it came from (see :mod:`.inflight`); a
    store that keeps failing closes the spider with reason ``idempotent_store_error``.
    """

    def __init__(self, crawler: Crawler, config: IdempotentConfig,
                 store: FrontierStore | None = None, *,
                 tracker: InflightTracker | None = None, threaded_writes: bool = True) -> None:
        self.crawler = crawler
        self.config = config
        assert crawler.stats is not None
        self.stats = crawler.stats
        self.store: FrontierStore = store or open_store(config.database,
                                                        **config.store_options())
        self.fingerprints = RequestFingerprints(crawler.request_fingerprinter)
        self.tracker = tracker or _build_tracker(crawler, config, self.fingerprints)
        self.tracker.complete = self._write_completed
        self.tracker.flush_soon = self._flush_soon
        #: every write of the crawl (see :mod:`.writer`); ``threaded_writes=False`` writes at
        #: once on the calling thread (a scheduler driven by hand, outside a crawl)
        self.writer = WriterThread(self.store, workers.new_worker_id(),
                                   prepare=self._prepare_batch, committed=self._batch_committed,
                                   failed=self._batch_failed, threaded=threaded_writes)
        #: batch number -> the first place in Scrapy's order among the requests it adds (or
        #: puts back to pending), for the batches not written yet (see _order_wait)
        self._unwritten: dict[int, QueueRank] = {}
        self._renewing = False
        self._asked_in_vain = False  #: next_request answered None since the last wake
        self._gated = 0  #: responses waiting for their writes before their callback
        self.outcomes = CommitOutcomes(crawler, crawler.stats, config.max_attempts)
        self.claimed = ClaimedRequests(config.lease_batch)
        self.keys = RequestKeys()
        self.dupes = DuplicateFilter.from_settings(crawler.settings, crawler.stats)
        self.spider: Spider | None = None
        self.codec: RequestCodec | None = None
        self.run_id: int | None = None
        self._flush_call: Any = None
        self._dead_check_at = 0.0
        self._closing = False
        self._failed = False
        self._hooks: engine_hooks.EngineHooks | None = None
        self._session = False  # a session was begun in the store (open() got that far)
        self._renewal: task.LoopingCall | None = None
        self._before_end: list[Callable[[FrontierStore, int, bool], Any]] = []
        self._last_counts: dict[str, int] = {}  #: the last count read (see __len__)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """Read and validate the ``IDEMPOTENT_*`` settings (a bad one raises
        :class:`~.ConfigError` here, before the first request)."""
        assert crawler.spider is not None
        with scrapy_compat.start_failure_exits_nonzero(crawler):
            return cls(crawler, config_for(crawler))

    @property
    def worker(self) -> str:
        """This scheduler's worker id (see :mod:`.workers`)."""
        return self.writer.worker

    @worker.setter
    def worker(self, worker: str) -> None:
        self.writer.worker = worker

    def __getattr__(self, name: str) -> Any:
        target = _MOVED_TO_TRACKER.get(name)
        if target is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(
            f"IdempotentScheduler.{name} is deprecated: use the in-flight tracker's {target} "
            "(scrapy_idempotent.crawl.inflight_tracker(crawler, ...))",
            DeprecationWarning, stacklevel=2)
        return getattr(self.tracker, target)

    # -- lifecycle --------------------------------------------------------------------------

    def open(self, spider: Spider) -> None:
        """Open the store, join or start a run, reclaim the leases of this host's dead
        workers (of its PID namespace), and hook into the engine. Raises :class:`~.StoreError` or
        :class:`~.UnsupportedScrapy` before anything is fetched (and ``scrapy crawl`` then
        exits non-zero)."""
        with scrapy_compat.start_failure_exits_nonzero(self.crawler):
            self._open(spider)

    def _open(self, spider: Spider) -> None:
        self.spider = self.tracker.spider = self.outcomes.spider = spider
        self.codec = RequestCodec(spider, self.config.request_classes)
        identity = CrawlIdentity(project=str(self.crawler.settings.get("BOT_NAME") or ""),
                                 spider=spider.name, source=self.config.source)
        changed = retry_busy("opening", lambda: self.store.open(
            fingerprinter=self.fingerprints.name, identity=identity))
        run = retry_busy("starting", lambda: self.store.begin_session(
            self.worker, self.config.run_mode))
        workers.declare_live(self.worker)
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
        self._hooks = engine_hooks.EngineHooks(self.crawler.engine, self.tracker)
        self._hooks.install()
        self.tracker.writes_durable = self._writes_durable
        self.writer.start()  # from now on the writer's thread uses the write connection
        if self.writer.threaded:
            # and reconnects after a lost connection: the reads here never wait for it
            self.store.never_wait_here()
        self._renewal = task.LoopingCall(self._tick)
        self._renewal.start(self.config.lease_seconds / 3, now=False)
        self._woken = False
        self.store.watch_for_work(self._work_may_be_claimable)

    def _work_may_be_claimable(self) -> None:
        """The store's signal that another worker may have made requests claimable (any
        thread): wake the engine once (a signal that comes while one is pending joins it)."""
        if self._woken or self._closing:
            return
        self._woken = True
        from twisted.internet import reactor

        reactor.callFromThread(self._wake)

    def _wake(self) -> None:
        self._woken = False
        if self._closing or self._failed:
            return
        self.stats.inc_value("idempotent/wakeups")
        self.claimed.wake()
        engine_hooks.schedule_next_request(self.crawler)

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
        if not self.writer.running:
            return self._close_drained(reason)
        # everything buffered is written, then the writer's thread ends and the rest of the
        # close runs here (the store is this thread's again)
        self.writer.commit()
        drained = self.writer.drain()
        drained.addCallback(lambda _: self._close_drained(reason))
        return drained

    def _close_drained(self, reason: str) -> Deferred[None] | None:
        self.writer.stop()
        self.store.never_wait_here(False)  # the close's writes wait for the database again
        if self._before_end and not self._failed:
            from scrapy.utils.defer import deferred_from_coro

            return deferred_from_coro(self._close_after_hooks(reason))
        self._end_session(reason)
        return None

    async def _close_after_hooks(self, reason: str) -> None:
        hook_failed = False
        try:
            self._commit(UnitOfWork())
            if not self._failed and self.run_id is not None:
                hook_failed = await self._run_before_end_hooks(reason, self.run_id)
        finally:
            self._end_session(reason, finish_run=not hook_failed)

    async def _run_before_end_hooks(self, reason: str, run_id: int) -> bool:
        """Run every :meth:`before_session_end` hook; True when one of them failed."""
        finishing = False
        if reason == "finished":
            counts = self.store.counts()
            finishing = not counts["pending"] and not counts["leased"]
        hook_failed = False
        for hook in self._before_end:
            try:
                await hook(self.store, run_id, finishing)
            except Exception as exc:
                hook_failed = True
                logger.error("scrapy_idempotent: %s", exc,
                             exc_info=not _is_feed_not_stored(exc))
        return hook_failed

    def _end_session(self, reason: str, finish_run: bool = True) -> None:
        try:
            if not self._failed:
                self._commit(UnitOfWork())
            inflight = [entry.key for entry in self.tracker.leased()]
            released = retry_busy("closing", lambda: self.store.end_session(
                self.worker, reason, inflight, finish_run=finish_run))
            if released:
                self.stats.inc_value("idempotent/requests/released", released)
            self._reclaim_space(everything=True)
            self.claimed.clear()
            self._log_close(reason, released)
        except Exception:
            logger.exception("scrapy_idempotent: error while closing the frontier")
        finally:
            workers.forget_live(self.worker)
            self.store.close()

    def _log_close(self, reason: str, released: int) -> None:
        counts = self.store.counts()
        records = counts["records"]
        fetched = self.stats.get_value("idempotent/requests/leased", 0)
        if records:
            self.stats.set_value("idempotent/requests_per_record", round(fetched / records, 3))
        done_filtered = self.stats.get_value("idempotent/requests/already_done", 0)
        logger.info(
            "scrapy_idempotent: closing (%s): %d pending, %d leased, %d done, %d failed, "
            "%d records; %d requests released; %d requests not fetched because already done",
            reason, counts["pending"], counts["leased"],
            counts["done"] + counts["redirected"], counts["failed"], records, released,
            done_filtered,
        )

    # -- the scheduler contract -------------------------------------------------------------

    def has_pending_requests(self) -> bool:
        """True while anything could still be handed out: claimed or buffered requests,
        pending entries, or entries other workers hold (their lease may come back). Never
        raises; on a store error it answers True and lets the close take its course."""
        if self._failed:
            return False
        if (self.claimed or self.tracker.unattributed.requests or self.tracker.memory_requests
                or self.writer.busy):  # (a batch being written may claim requests)
            return True
        try:
            status = self.store.status(self.worker)  # the read connection: never waits
            if status.claimable:
                self.claimed.maybe_claimable = True
                return True
            if status.leased_elsewhere:
                now = time.time()
                if now >= self._dead_check_at:
                    self._dead_check_at = now + 1.0
                    self._reclaim_leases()
                return True
            return False
        except StoreBusy as exc:  # a lost connection being re-established: asked again soon
            logger.warning("scrapy_idempotent: cannot read the frontier yet (%s)", exc)
            return True
        except Exception:
            logger.exception("scrapy_idempotent: cannot read the frontier")
            self._fail("cannot read the frontier")
            return False

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
            request = self._next_request()
            if request is None:
                # the engine asks again when a request finishes or at its heartbeat; a write
                # that brings requests (a claim, the end of an order wait) wakes it sooner
                self._asked_in_vain = True
            return request
        except Exception:
            logger.exception("scrapy_idempotent: cannot lease the next request")
            self._fail("cannot lease the next request")
            return None

    def request_state(self, fingerprint: str) -> str | None:
        """What this crawl knows of requests with ``fingerprint`` (hex), for inputs that
        wait on a request they fed: ``"buffered"`` (accepted by this worker, written with its
        next transaction), ``"duplicate"`` (pending or leased in the frontier),
        ``"already_done"`` (finished in this recrawl window: its ``request_done`` was sent), or
        None (unknown, or due again). A read outside any transaction; raises StoreError."""
        if self.tracker.is_buffered(fingerprint):
            return "buffered"
        return self.store.known_request(fingerprint)

    def __len__(self) -> int:
        """Pending and leased entries in the frontier (all workers), plus buffered ones
        (the frontier's figures of the last count while the store cannot be read at once)."""
        with contextlib.suppress(StoreBusy):
            self._last_counts = self.store.counts()
        counts = self._last_counts
        return (counts.get("pending", 0) + counts.get("leased", 0)
                + len(self.tracker.unattributed.requests) + self.tracker.memory_requests)

    # -- enqueue ----------------------------------------------------------------------------

    def _enqueue(self, request: Request) -> bool:
        assert self.codec is not None
        self.stats.inc_value("idempotent/requests/enqueued")
        origin = self.tracker.origin_of(request)
        fingerprint = self.fingerprints(request)
        if fingerprint is None:
            self.tracker.refuse_unidentified(request, origin)
            return False
        filtered = self.dupes.enabled and not request.dont_filter
        retry_of = self._retry_of(request, origin, fingerprint)
        if filtered and retry_of is None and self._known_duplicate(request, fingerprint):
            return False
        key: str | None = None
        if origin.parent is None and not origin.from_downloader and not filtered:
            # A start request replayed by a restarted start() (Scrapy runs it from the top
            # on every crawl): when its key is known, one read decides, without encoding it
            # or writing a transaction for it (a resume over a long start list that is
            # mostly done starts downloading at once). The commit would count it the same.
            key = self._key(fingerprint, filtered, origin)
            known = self._known(fingerprint, key)
            if known is not None:
                self.stats.inc_value(f"idempotent/requests/{known}")
                if known == signals.ALREADY_DONE:
                    self.outcomes.already_done(request, key, fingerprint)
                return True
        try:
            if retry_of is not None and retry_of.memory:
                raise UnstorableRequest(describe(request), "request",
                                        "a retry of a request fetched from memory")
            data = self.codec.encode(request)
        except UnstorableRequest as exc:
            return self.tracker.hold_in_memory(
                request, exc,
                key=key if key is not None else self._key(fingerprint, False, origin),
                fingerprint=fingerprint, origin=origin, filtered=filtered,
                continues=origin.from_downloader or retry_of is not None)
        if retry_of is not None:
            retry_of.continuation = (data, request.priority)
            self.stats.inc_value("idempotent/requests/retried")
            return True
        self._buffer(request, data, fingerprint, filtered, origin, key)
        return True

    @staticmethod
    def _retry_of(request: Request, origin: RequestOrigin,
                  fingerprint: str) -> InflightRequest | None:
        """The in-flight request ``request`` retries (it continues the same frontier entry),
        or None: from the downloader (RetryMiddleware, a redirect to the same request) or
        ``get_retry_request()`` yielded by the callback (one more ``retry_times`` than its
        request). Other requests, even dont_filter ones to the page's own URL, are new
        entries."""
        parent = origin.parent
        if parent is None or fingerprint != parent.fingerprint:
            return None
        if origin.from_downloader or (
                request.dont_filter and parent.continuation is None
                and _retry_times(request) == _retry_times(parent.request) + 1):
            return parent
        return None

    def _known_duplicate(self, request: Request, fingerprint: str) -> bool:
        """Most enqueued requests are rediscovered links: known ones (in the frontier, or
        buffered for the next transaction) are refused like Scrapy's dupefilter does,
        without being encoded or written."""
        known = "duplicate" if self.tracker.is_buffered(fingerprint) \
            else self._known(fingerprint)
        if known is None:
            return False
        self.stats.inc_value(f"idempotent/requests/{known}")
        self.dupes.filtered(request)
        if known == signals.ALREADY_DONE:
            self.outcomes.already_done(request, fingerprint, fingerprint)
        return True

    def _known(self, fingerprint: str, key: str | None = None) -> str | None:
        """The store's :meth:`~.FrontierStore.known_request`, or None (unknown) while the
        store cannot be read at once (a lost connection being re-established on another
        thread): the request is then buffered, and the commit decides (a duplicate is
        counted there and not added twice)."""
        try:
            return self.store.known_request(fingerprint, key=key)
        except StoreBusy as exc:
            self.stats.inc_value("idempotent/requests/unchecked")
            logger.debug("scrapy_idempotent: duplicate check left to the commit (%s)", exc)
            return None

    def _key(self, fingerprint: str, filtered: bool, origin: RequestOrigin) -> str:
        parent = origin.parent
        return self.keys.key(
            fingerprint, filtered=filtered,
            parent_key=parent.key if parent is not None else None,
            parent_counts=parent.dont_filter_counts if parent is not None else None,
            is_start=origin.is_start)

    def _buffer(self, request: Request, data: str, fingerprint: str, filtered: bool,
                origin: RequestOrigin, key: str | None) -> None:
        """Queue the encoded ``request`` for the transaction of the request it came from."""
        is_start, fifo = self.tracker.order.place(request)
        parent = origin.parent
        self.tracker.buffer_request(NewRequest(
            key=key if key is not None else self._key(fingerprint, filtered, origin),
            fingerprint=fingerprint,
            url=request.url,
            priority=request.priority,
            data=data,
            parent_key=parent.key if parent is not None else None,
            is_start=is_start,
            fifo=fifo,
            filter_fingerprint=filtered,
        ), parent)

    # -- lease ------------------------------------------------------------------------------

    def _next_request(self) -> Request | None:
        tracker, claimed = self.tracker, self.claimed
        if self._renewing and not self.writer.stalled:
            # which leases are still this worker's is being asked: nothing is handed out
            # under a lease that may be lost (asked again when the renewal is back)
            return None
        if self._gated and not self.writer.stalled:
            # A response waits for its writes before its callback runs: in Scrapy the
            # callback would have run, and its requests would be enqueued, before the next
            # request is sent (they may go first). Asked again once it has run.
            return None
        while True:
            if tracker.suspects_in_flight:
                # a suspect runs alone (see below), with its own memory requests (each
                # holds the suspect's lease)
                return tracker.hand_out_memory() if tracker.memory_requests else None
            if not claimed and not self._refill():
                return tracker.hand_out_memory() if tracker.memory_requests else None
            if tracker.memory_requests and tracker.memory_goes_before(claimed.head()):
                return tracker.hand_out_memory()
            if self._order_wait(claimed.head()):
                # requests being written go before the next one claimed here: they are
                # handed out first, once written and claimed (the writer wakes the engine)
                return None
            if claimed.head().suspect and tracker.in_flight:
                # A request that was in flight at two deaths of a worker is a suspect: it
                # runs with nothing else in flight, so that if it kills the crawl again, it
                # alone is blamed (IDEMPOTENT_MAX_ATTEMPTS), not its neighbours. Requests in
                # flight at one death are replayed at full concurrency: a resume after a
                # kill is not serialised.
                return None
            if claimed.head_expired(time.time()):
                # The batch claimed ahead sat here past its lease (the process was stopped,
                # or the reactor blocked): another worker may have it now.
                self._renew()
                if self._renewing:
                    return None  # the renewal wakes the engine when it is back
                continue
            request = self._load(claimed.pop())
            if request is not None:
                return request

    def _refill(self) -> bool:
        """Claim requests, when the store may have some: at once when the writer's thread is
        idle, else with the batch after the one in flight (it wakes the engine)."""
        now = time.time()
        if not self.claimed.may_refill(now, bool(self.tracker.unattributed)):
            return False
        if self.writer.threaded and not self.writer.idle:
            self.writer.commit()  # the batch being filled claims: send it without lingering
            return False
        # Nothing claimed ahead and nothing being written: claim now and wait for it a
        # moment, so that the requests enqueued so far are taken in Scrapy's order (a
        # request enqueued while a claim is on its way would otherwise lose its turn). Never
        # longer than the writer's STALL_SECONDS: a claim that waits for the database (a
        # lock another process holds) goes on without the reactor, and its batch wakes the
        # engine when it is written.
        self._commit(UnitOfWork(claim=self.claimed.claim_size(self._closing)))
        if self.writer.running:
            self.writer.commit_now()
        return bool(self.claimed)

    def _order_wait(self, head: LeasedRequest) -> bool:
        """Whether requests not written yet go before ``head`` in Scrapy's order (a child is
        taken before older requests of its priority): then ``head`` waits until they are
        written and claimed. Not while the writes wait for the database (another process
        holds the lock): then the requests claimed here are handed out in their order, so
        downloads go on."""
        if not self._unwritten:
            return False
        durable = self.writer.durable_seq
        for seq in [seq for seq in self._unwritten if seq <= durable]:
            del self._unwritten[seq]
        if not self._unwritten or self.writer.stalled:
            return False
        return min(self._unwritten.values()) < queue_rank(head)

    def _note_order(self, seq: int, requests: Sequence[NewRequest],
                    completions: Sequence[Completion]) -> None:
        """Remember where the requests batch ``seq`` adds (or puts back to pending: a retry)
        stand in Scrapy's order, until it is written."""
        best = self._unwritten.get(seq)
        for new in requests:
            rank = queue_rank_of_new(new)
            if best is None or rank < best:
                best = rank
        for completion in completions:
            if completion.state is RequestState.PENDING:
                rank = (-(completion.priority or 0), 0, float("-inf"))
                if best is None or rank < best:
                    best = rank
        if best is not None:
            self._unwritten[seq] = best

    def _load(self, leased: LeasedRequest) -> Request | None:
        assert self.codec is not None
        try:
            request = self.codec.decode(leased.data)
        except Exception as exc:
            self.stats.inc_value("idempotent/requests/unloadable")
            logger.error("scrapy_idempotent: cannot load stored request %s: %s", leased.key, exc)
            self.tracker.fail_unloadable(leased.key, str(exc))
            self.outcomes.expect(leased.key, None, leased.fingerprint)
            return None
        self.tracker.handed_out(leased, request)
        self.stats.inc_value("idempotent/requests/leased")
        if leased.attempts > 1:
            self.stats.inc_value("idempotent/requests/repeated")
        return request

    # -- writes -----------------------------------------------------------------------------

    def _write_completed(self, work: UnitOfWork, entry: InflightRequest | None) -> None:
        """The tracker's ``complete``: ``entry`` (with its memory requests) finished, or a
        memory request of no stored request did (``entry`` None)."""
        if work.requests or any(c.state is RequestState.PENDING for c in work.completions):
            self.claimed.maybe_claimable = True
        if entry is not None and any(c.state.terminal for c in work.completions):
            self.outcomes.expect(entry.key, entry.request, entry.fingerprint)
        self._commit(work)

    def _commit(self, work: UnitOfWork) -> int:
        """Write ``work`` plus everything buffered in one transaction, claiming new leases
        when the local batch runs low: with the writer's batch (several pages may share it),
        or at once when the writer is stopped (at close). Returns the batch's number (0: at
        once, or nothing to write). The writer retries on a locked database; when it gives
        up the spider is closed (the uncommitted entries stay leased and are released at
        close)."""
        if self._failed:
            return 0
        if self.writer.running:
            self._note_order(self.writer.open_seq, work.requests, work.completions)
            return self.writer.commit(work)
        self._prepare_batch(work, 0)
        if work:
            try:
                result = retry_busy("committing", lambda: self.store.commit(work, self.worker))
            except Exception as exc:
                self._batch_failed(work, exc)
            else:
                self._batch_committed(work, result)
        return 0

    def _prepare_batch(self, work: UnitOfWork, seq: int) -> None:
        """The writer's ``prepare``: add what is buffered, the claim and the give-back."""
        pages = len(work.requests)
        self.tracker.drain_into(work)  # (the requests of no page go first)
        if work.requests or any(c.state is RequestState.PENDING for c in work.completions):
            self.claimed.maybe_claimable = True
            if seq:  # the pages' requests were noted when they were committed
                self._note_order(seq, work.requests[:len(work.requests) - pages], ())
        self.claimed.prepare(work, self._closing)
        work.outbox_targets = self.config.outbox_targets  # announce its record changes

    def _batch_committed(self, work: UnitOfWork, result: CommitResult) -> None:
        """The writer's ``committed``: count, announce, take the claimed requests."""
        self.outcomes.committed(result, work)
        self.tracker.written(work)
        self.claimed.accept(work, result)
        if work.claim and not result.leased and not work.requests:
            self.claimed.found_none(time.time())
        self._wake_if_asked_in_vain()

    def _batch_failed(self, work: UnitOfWork, exc: BaseException) -> None:
        """The writer's ``failed``: nothing of ``work`` was written, nor will anything more."""
        logger.error("scrapy_idempotent: cannot write to the frontier database",
                     exc_info=(type(exc), exc, exc.__traceback__)
                     if not isinstance(exc, StoreError) else False)
        self.tracker.restore_from(work)
        self._fail(
            f"frontier database error: {exc}; what was committed before is kept: fix "
            "the cause and run the same crawl again to resume"
        )

    def _writes_durable(self, seq: int) -> Deferred[None] | None:
        """The tracker's ``writes_durable``: a response waits for its attempt's writes (they
        are sent with the next page's completion, at the latest after the linger)."""
        if not self.writer.running:
            return None
        waiting = self.writer.durable(seq)
        if waiting is not None:
            self.writer.commit(linger=LINGER_SECONDS)
            self._gated += 1
            waiting.addBoth(self._gate_passed)
            if self.writer.stalled:
                # the writes wait for the database: the download slot is free meanwhile
                engine_hooks.schedule_next_request(self.crawler)
        return waiting

    def _gate_passed(self, result: Any) -> Any:
        self._gated -= 1
        return result

    def _fail(self, reason: str) -> None:
        if self._failed:
            return
        self._failed = True
        self.stats.set_value("idempotent/error", reason)
        logger.error("scrapy_idempotent: closing the spider: %s", reason)
        engine_hooks.close_spider_failed(self.crawler, STORE_ERROR_REASON)

    def _flush_soon(self) -> int:
        """The tracker's ``flush_soon``: what it buffered (an attempt's start, its journaled
        response) goes with the writer's next batch; returns that batch's number. Its
        response waits for it (:meth:`_writes_durable`)."""
        if self.writer.threaded and self.writer.running:
            return self.writer.open_seq
        if self._flush_call is None or not self._flush_call.active():
            from twisted.internet import reactor as installed  # the one Scrapy installed

            clock: Any = installed
            self._flush_call = clock.callLater(0, self._flush)
        return 0

    def _flush(self) -> None:
        if self.tracker.has_attempt_writes and not self._failed and not self._closing:
            self._commit(UnitOfWork())

    # -- periodic work ----------------------------------------------------------------------

    def _tick(self) -> None:
        """Every lease_seconds / 3: renew this worker's leases (one statement for all),
        flush buffered writes, reclaim expired leases."""
        if self._failed or self._closing:
            return
        try:
            self._renew()
            if self.tracker.unattributed or self.claimed.has_give_back:
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
        if self.writer.running:
            reclaiming = self.writer.call(
                "giving free space back", lambda store: store.reclaim_space(everything=everything))
            reclaiming.addCallbacks(self._space_reclaimed, lambda failure: logger.warning(
                "scrapy_idempotent: could not give free space back: %s", failure.value))
            return
        try:
            freed = self.store.reclaim_space(everything=everything)
        except Exception as exc:
            logger.warning("scrapy_idempotent: could not give free space back: %s", exc)
            return
        self._space_reclaimed(freed)

    def _space_reclaimed(self, freed: int) -> None:
        if freed:
            self.stats.inc_value("idempotent/bytes_reclaimed", freed)

    def _renew(self) -> None:
        """Renew this worker's live leases (one statement, on the writer's thread) and, once
        renewed, forget those that expired: the requests claimed ahead are dropped (never
        handed out), and a request in flight whose lease expired is finished without writing
        anything (the store fences it)."""
        if self._renewing:
            return
        self._renewing = True
        began = time.time()
        renewing = self.writer.call("renewing leases",
                                    lambda store: store.renew_leases(self.worker))
        renewing.addCallbacks(self._renewed, self._renew_failed, callbackArgs=(began,))

    def _renew_failed(self, failure: Failure) -> None:
        self._renewing = False
        logger.error("scrapy_idempotent: cannot renew leases: %s", failure.value)

    def _renewed(self, keys: list[str], began: float) -> None:
        self._renewing = False
        held = set(keys)
        self._wake_if_asked_in_vain()
        self.claimed.renewed_until = began + self.config.lease_seconds
        if held:
            self.stats.inc_value("idempotent/leases/renewals")
        stale = self.claimed.keep_held(held)
        expired = self.tracker.lose(held)
        if stale or expired:
            self.stats.inc_value("idempotent/leases/expired", stale + expired)
            logger.warning(
                "scrapy_idempotent: %d leases of this worker expired before they were "
                "renewed (the process was stopped or too busy for IDEMPOTENT_LEASE_SECONDS); "
                "%d claimed requests are given up without being fetched, and the work of %d "
                "in flight is not written unless the lease is still this worker's",
                stale + expired, stale, expired)

    def _reclaim_leases(self) -> None:
        """Put the leases of this host's dead workers (of its PID namespace) and the
        expired leases back to pending (on the writer's thread); the claim that follows may
        take them."""
        dead = [h.worker for h in self.store.lease_holders()
                if h.worker != self.worker and workers.worker_is_dead(h.worker)]

        def reclaim(store: FrontierStore) -> tuple[int, int]:
            return (store.release_leases(dead) if dead else 0), store.reclaim_expired()

        reclaiming = self.writer.call("reclaiming leases", reclaim)
        reclaiming.addCallbacks(lambda counts: self._leases_reclaimed(dead, *counts),
                                lambda failure: logger.warning(
                                    "scrapy_idempotent: could not reclaim leases: %s",
                                    failure.value))

    def _leases_reclaimed(self, dead: list[str], released: int, expired: int) -> None:
        if released:
            self.stats.inc_value("idempotent/requests/reclaimed", released)
            logger.info("scrapy_idempotent: reclaimed %d leases of dead workers %s",
                        released, ", ".join(dead))
        if released or expired:
            self.claimed.maybe_claimable = True
            self._wake_if_asked_in_vain()

    def _wake_if_asked_in_vain(self) -> None:
        """Have the engine ask for requests again at the next reactor turn when the last time
        it asked it got none (only then: an engine woken between a download and its callback
        would send the next request before the callback's children, out of Scrapy's
        order)."""
        if self._asked_in_vain:
            self._asked_in_vain = False
            engine_hooks.schedule_next_request(self.crawler)

    def _reclaim_dead_workers(self) -> int:
        dead = [h.worker for h in self.store.lease_holders()
                if h.worker != self.worker and workers.worker_is_dead(h.worker)]
        reclaimed = self.store.release_leases(dead) if dead else 0
        if reclaimed:
            self.stats.inc_value("idempotent/requests/reclaimed", reclaimed)
            self.claimed.maybe_claimable = True
            logger.info("scrapy_idempotent: reclaimed %d leases of dead workers %s",
                        reclaimed, ", ".join(dead))
        return reclaimed
