"""``IdempotentScheduler``: Scrapy's scheduler on a durable frontier with leases.

Set ``SCHEDULER = "scrapy_idempotent.IdempotentScheduler"`` (the add-on does it). The
scheduler keeps every request in the store, hands them out under a lease, and marks a request
done only when Scrapy has completely finished with it, in the same transaction as the records
and child requests its response produced ("done is the last write").

This module is the scheduler contract (``open``, ``close``, ``enqueue_request``,
``next_request``, ``has_pending_requests``, ``__len__``) and the crawl's session in the
store. Its collaborators are built in one place, the scheduler's constructor, and each is
handed the others it uses at construction (nothing is wired into one afterwards):

* the store (:class:`~.FrontierStore`): the durable frontier;
* :class:`~.InflightTracker` (:mod:`.inflight`): what each handed-out request produced and
  how it went; the engine hooks report to it, the spider middleware and the pipeline use it;
* :class:`~.Admission` (:mod:`.admission`): the enqueue decision; :class:`~.StartIntake`:
  how fast ``start()`` is taken in;
* :class:`~.CommitPath` (:mod:`.commits`): every write, through the
  :class:`~.WriterThread` (:mod:`.writer`), and what follows a durable commit
  (:class:`~.CommitOutcomes`: stats, warnings, the ``request_done`` signal);
* :class:`~.ClaimedRequests` and :class:`~.LeaseKeeper` (:mod:`.leases`): the requests
  claimed ahead, and the periodic lease work (renewals, reclaims, space);
  :class:`~.HandOut` (:mod:`.handout`): which of them, or of the tracker's memory requests,
  goes to the engine next;
* :class:`~.RequestKeys` and :class:`~.RequestFingerprints` (:mod:`.keys`): request identity;
* :class:`~.Politeness` (:mod:`.politeness`): each request's download slot, and the crawl's
  per-slot limits the claims keep;
* :class:`~.CrawlHealth` (:mod:`.health`): whether writes may go on (closing, or failed).

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scrapy.core.scheduler import BaseScheduler

from . import engine_hooks, gc_freeze, rekey, scrapy_compat, workers
from ._dupes import DuplicateFilter
from ._scheduler_kind import IdempotentSchedulerMark, is_idempotent_scheduler
from ._version import __version__
from .admission import START_AHEAD, Admission, StartIntake
from .codec import RequestCodec, describe
from .commits import CommitOutcomes, CommitPath, retry_busy
from .config import IdempotentConfig, config_for
from .cookies import CookieKeeper
from .exceptions import IdempotentError, StoreBusy
from .handout import HandOut
from .health import STORE_ERROR_REASON, CrawlHealth
from .inflight import TrackerOutlets, tracker_for
from .keys import RequestFingerprints, RequestKeys
from .leases import ClaimedRequests, LeaseKeeper
from .outbox import target_name
from .politeness import Politeness
from .recent_requests import RecentRequests
from .records import RECORD_ID_SCHEME
from .redis_dedup import RedisKnownRequests, redis_client
from .run_totals import set_run_stats
from .store.base import CrawlIdentity, FrontierStore, UnitOfWork
from .store.registry import open_store, redacted

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

__all__ = ["STORE_ERROR_REASON", "IdempotentScheduler", "is_idempotent_scheduler"]

logger = logging.getLogger(__name__)


class IdempotentScheduler(BaseScheduler, IdempotentSchedulerMark):
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
                 store: FrontierStore | None = None, *, threaded_writes: bool = True) -> None:
        """The one place where the crawl's collaborators are built and handed each other.
        The tracker, the commit path, the admission and the politeness use each other's
        methods: each is given the others' at construction, as a call of the one built
        later (``self.commits``, ``self.admission``, ``self.politeness``), never assigned
        into it afterwards."""
        self.crawler = crawler
        self.config = config
        assert crawler.stats is not None
        self.stats = stats = crawler.stats
        spider = crawler.spider  # (Scrapy builds the scheduler once the spider is created)
        assert spider is not None
        self.store: FrontierStore = store or open_store(config.database,
                                                        **config.store_options())
        self.fingerprints = RequestFingerprints(crawler.request_fingerprinter)
        self.codec = RequestCodec(spider, config.request_classes)
        self.tracker = tracker = tracker_for(config, stats, self.fingerprints, spider=spider,
                                             outlets=TrackerOutlets(
            complete=lambda work, entry: self.commits.completed(work, entry),
            flush_soon=lambda: self.commits.flush_soon(),
            write_soon=lambda: self.commits.write_soon(),
            writes_durable=lambda seq: self.commits.writes_durable(seq),
            child_request=lambda request: self.admission.expect(request)))
        self.health = CrawlHealth(crawler, stats)
        self.wakeup = engine_hooks.EngineWakeup(crawler)
        self.outcomes = CommitOutcomes(crawler, stats, config.max_attempts, spider=spider,
                                       next_run=self._next_run)
        crawl_wide = config.politeness == "crawl"
        # with the crawl's limits, claims ahead take the places of the slots this worker
        # can send in soon only (the downloader's room: CONCURRENT_REQUESTS less the
        # requests it works on)
        concurrent = crawler.settings.getint("CONCURRENT_REQUESTS")
        self.claimed = ClaimedRequests(
            config.lease_batch,
            sendable=(lambda: concurrent - self._downloading()) if crawl_wide else None)
        #: the cookie jars kept across a resume (None: IDEMPOTENT_KEEP_COOKIES is off)
        self.cookies = CookieKeeper(crawler) if config.keep_cookies else None
        self.commits = CommitPath(
            self.store, workers.new_worker_id(), tracker=tracker, claimed=self.claimed,
            outcomes=self.outcomes, health=self.health, wakeup=self.wakeup,
            outbox_targets=tuple(target_name(spec) for spec in config.outbox_targets),
            threaded=threaded_writes, cookies=self.cookies,
            slots_wait=(lambda seconds: self.politeness.claim_again_in(seconds))
            if crawl_wide else None)
        self.writer = self.commits.writer
        self.leases = LeaseKeeper(
            self.store, self.writer, tracker=tracker, claimed=self.claimed, stats=stats,
            health=self.health, wakeup=self.wakeup, lease_seconds=config.lease_seconds,
            flush=self.commits.flush_buffered, sample_seconds=config.sample_seconds)
        self.politeness = Politeness(
            config, stats=stats, claimed=self.claimed, wakeup=self.wakeup, writer=self.writer,
            autothrottle=crawler.settings.getbool("AUTOTHROTTLE_ENABLED"))
        recent = RecentRequests()  # (what the admission took in, for the hand-out)
        #: the fast layer of the duplicate check (IDEMPOTENT_DEDUP_REDIS_URL), told of each
        #: commit on the writer's thread once it is durable; None: off
        self.dedup = RedisKnownRequests(
            self.store, redis_client(config.dedup_redis_url), url=config.dedup_redis_url,
            recrawl_seconds=config.recrawl_seconds, count=scrapy_compat.stat_counter(stats),
        ) if config.dedup_redis_url else None
        if self.dedup is not None:
            self.writer.follow_durable(self.dedup.committed)
        self.admission = Admission(
            self.store, tracker=tracker, fingerprints=self.fingerprints,
            keys=RequestKeys(), dupes=DuplicateFilter.from_settings(crawler.settings, stats),
            outcomes=self.outcomes, stats=stats, codec=self.codec,
            slot_of=self.politeness.slot_of, recent=recent,
            before_enqueue=lambda: self.start_intake.flush(), known=self.dedup)
        # with the crawl's slot limits the pending requests may all be of slots that wait:
        # start() waits for downloads only while this worker has half its downloader's
        # requests in flight or claimed; else it goes on, its other sites' requests with it
        self.start_intake = StartIntake(
            tracker, self.writer, self.admission, hand_on=self._crawl_start_request,
            ahead=START_AHEAD, busy=(lambda: tracker.in_flight_count + len(self.claimed)
                  >= max(1, concurrent // 2)) if crawl_wide else None)
        self.hand_out = HandOut(
            tracker=tracker, claimed=self.claimed, commits=self.commits,
            leases=self.leases, outcomes=self.outcomes, politeness=self.politeness, stats=stats,
            codec=self.codec, recent=recent)
        self.spider: Spider | None = None
        self.run_id: int | None = None
        self._hooks: engine_hooks.EngineHooks | None = None
        self._session = False  # a session was begun in the store (open() got that far)
        self._gc_frozen = False  # gc_freeze.freeze() was called at open
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

    # -- lifecycle --------------------------------------------------------------------------

    def open(self, spider: Spider) -> None:
        """Open the store, join or start a run, reclaim the leases of this host's dead
        workers (of its PID namespace), and hook into the engine. A store refused at open
        (:class:`~.StoreError`) closes the spider with ``idempotent_store_error`` once the
        engine has started, before anything is fetched (one ERROR line); an unsupported Scrapy
        raises :class:`~.UnsupportedScrapy`. Either way ``scrapy crawl`` exits non-zero."""
        with scrapy_compat.start_failure_exits_nonzero(self.crawler):
            self._open(spider)

    def _open(self, spider: Spider) -> None:
        self.spider = spider
        identity = CrawlIdentity(project=str(self.crawler.settings.get("BOT_NAME") or ""),
                                 spider=spider.name, source=self.config.source)
        # claims load the validators of pages done before (ConditionalRequestMiddleware)
        self.store.load_validators_with_claims(self.config.conditional_requests,
                                               revisit=self.config.revisit)
        try:
            changed = retry_busy("opening", lambda: self.store.open(
                fingerprinter=self.fingerprints.name, identity=identity,
                record_id_scheme=RECORD_ID_SCHEME))
            rekeyed = retry_busy("checking the record identity", lambda: rekey.open_identity(
                self.store, self.tracker.identity,
                rekey.FileStores.from_settings(self.crawler.settings),
                redacted(self.config.database)))
            run = retry_busy("starting", lambda: self.store.begin_session(
                self.worker, self.config.run_mode))
            downloader = getattr(self.crawler.engine, "downloader", None)
            retry_busy("setting the download slots' limits",
                       lambda: self.politeness.open(downloader, self.store))
            if self.dedup is not None:  # its hashes are named by the frontier's id
                retry_busy("reading the frontier's id", self.dedup.open)
            stored_state = retry_busy("reading the spider's state", self.store.spider_state)
            stored_cookies = (retry_busy("reading the cookies", self.store.meta).get("cookies")
                              if self.cookies is not None else None)
        except IdempotentError as exc:
            # the database was refused (not ours, another crawl's, disk full, a path that
            # cannot be created...): one ERROR line, nothing fetched, the spider closed as
            # idempotent_store_error (exit code 1)
            self.health.fail_at_open(f"cannot open the frontier database: {exc}")
            return
        workers.declare_live(self.worker)
        self._session = True
        self.tracker.state.restore(spider, stored_state)
        if self.cookies is not None:
            restored = self.cookies.restore(stored_cookies)
            if restored:
                logger.info("scrapy_idempotent: %d cookies restored into the cookie jars",
                            restored)
        if self.crawler.settings.get("JOBDIR"):
            logger.warning(
                "scrapy_idempotent: JOBDIR is set and not used: the frontier, the records and "
                "spider.state live in %s (Scrapy's JOBDIR queues and spider.state file are "
                "left alone)", redacted(self.config.database))
        if changed is not None:
            logger.warning(
                "The frontier in %s was built with request fingerprinter %s; this crawl uses "
                "another one, so known requests may be fetched again.",
                redacted(self.config.database), changed,
            )
        if rekeyed is not None:
            logger.info(
                "scrapy_idempotent: re-identified %d records of %s by record ID scheme %s "
                "(the item type is part of the record ID): %d given a new ID",
                rekeyed.records, redacted(self.config.database), RECORD_ID_SCHEME,
                rekeyed.moved)
        reclaimed = self.leases.reclaim_dead_workers()
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
        if self.dedup is not None:
            logger.info("scrapy_idempotent: duplicate links are checked in the Redis at %s "
                        "first (hash %s)", self.dedup.url, self.dedup.key(run.run_id))
        self._hooks = engine_hooks.EngineHooks(self.crawler.engine, self.tracker)
        self._hooks.install()
        if any(counts[state] for state in ("pending", "leased", "done", "redirected",
                                            "failed")):
            # start requests are checked in batches only where the frontier may know them: on
            # an empty one each goes to the engine at once, as in Scrapy (the first is sent
            # before start() goes on)
            self.start_intake.open()
        scrapy_compat.forced_stop_exits_nonzero()  # a second Ctrl+C: exit code 1
        if self.config.gc_freeze:
            gc_freeze.freeze()
            self._gc_frozen = True
        self.commits.start()
        self.leases.start()

    def _downloading(self) -> int:
        """The requests this worker's downloader works on (Scrapy's ``Downloader.active``,
        what its ``CONCURRENT_REQUESTS`` counts); without a downloader, those in flight."""
        active = getattr(getattr(self.crawler.engine, "downloader", None), "active", None)
        return len(active) if active is not None else self.tracker.in_flight_count

    def _crawl_start_request(self, request: Request) -> None:
        """A held start request found unknown goes to the engine as the engine sends its
        start requests (``ExecutionEngine.crawl``)."""
        engine = self.crawler.engine
        if engine is not None and engine.spider is not None and not self.health.closing:
            engine.crawl(request)

    def before_session_end(self, hook: Callable[[FrontierStore, int, bool], Any]) -> None:
        """Call ``hook(store, run_id, finishing)`` (a coroutine function) at close, once every
        write of this crawl is committed and before the run can be marked finished; a kill
        during the hook, or an exception it raises, leaves the run unfinished, so the next
        crawl calls it again. ``finishing``: this close ends the run. The feed exporter writes
        the feeds here."""
        self._before_end.append(hook)

    def _next_run(self, run_id: int) -> None:
        """The run this worker joined was finished by another and it goes on in ``run_id``
        (its close, feeds included, is that run's)."""
        self.run_id = run_id

    def close(self, reason: str) -> Deferred[None] | None:
        """Flush what is buffered, run the :meth:`before_session_end` hooks, release this
        worker's remaining leases (a graceful stop frees them at once), and record the end of
        this session; on ``finished`` with an empty frontier the run is marked finished."""
        self.health.closing = True
        if self._gc_frozen:
            self._gc_frozen = False
            gc_freeze.thaw()
        self.start_intake.close()
        self.hand_out.recent.clear()
        self.leases.stop()
        self.politeness.close()
        if self._hooks is not None:
            self._hooks.remove()
        if not self._session:  # open() failed before the store was usable: nothing to close
            self.admission.keys.close()
            if self.dedup is not None:
                self.dedup.close()
            self.store.close()
            return None
        # everything buffered is written, then the writer's thread ends and the rest of the
        # close runs here (the store is this thread's again)
        drained = self.commits.drain()
        if drained is None:
            return self._close_drained(reason)
        drained.addCallback(lambda _: self._close_drained(reason))
        return drained

    def _close_drained(self, reason: str) -> Deferred[None] | None:
        self.commits.stop()
        if self._before_end and not self.health.failed:
            from scrapy.utils.defer import deferred_from_coro

            return deferred_from_coro(self._close_after_hooks(reason))
        self._end_session(reason)
        return None

    async def _close_after_hooks(self, reason: str) -> None:
        failed: str | None = None
        try:
            self.commits.commit(UnitOfWork())
            if not self.health.failed and self.run_id is not None:
                failed = await self._run_before_end_hooks(reason, self.run_id)
        finally:
            # the session ends with the reason the crawl reports (a feed not stored is not
            # ``finished``), and the run stays open
            self._end_session(reason if failed is None else failed,
                              finish_run=failed is None)

    async def _run_before_end_hooks(self, reason: str, run_id: int) -> str | None:
        """Run every :meth:`before_session_end` hook; None when none failed, else the reason
        the close now has (``idempotent_feed_error`` when the feeds were not stored and the
        crawl had ``finished``)."""
        # (whether anything is left, not how much: a count of a large frontier takes
        # seconds, and the closing line counts it once more)
        finishing = reason == "finished" and not self.store.unfinished()
        hook_failed = False
        failed_reason = None
        for hook in self._before_end:
            try:
                await hook(self.store, run_id, finishing)
            except Exception as exc:
                hook_failed = True
                failed_reason = failed_reason or getattr(exc, "close_reason", None)
                # an error already reported (feeds not stored) is one line, not a traceback
                logger.error("scrapy_idempotent: %s", exc,
                             exc_info=not getattr(exc, "reported", False))
        if not hook_failed:
            return None
        # what the run needed at its close was not done: not a success
        engine_hooks.exit_nonzero(self.crawler)
        if failed_reason is not None and reason == "finished":
            engine_hooks.report_close_reason(self.crawler, failed_reason)
            return str(failed_reason)
        return reason

    def _end_session(self, reason: str, finish_run: bool = True) -> None:
        try:
            if not self.health.failed:
                self.commits.commit(UnitOfWork())
            inflight = [entry.key for entry in self.tracker.leased()]
            released = retry_busy("closing", lambda: self.store.end_session(
                self.worker, reason, inflight, finish_run=finish_run))
            if released:
                self.stats.inc_value("idempotent/requests/released", released)
            if not self.health.failed:
                self.leases.final_sample()
                if self.run_id is not None:  # every crawl's commits in, this one's included
                    set_run_stats(self.stats, self.store.run_totals(self.run_id,
                                                                     spider_errors=True))
            self.leases.reclaim_space(everything=True)
            self.claimed.clear()
            self._log_close(reason, released)
        except Exception as exc:
            # a store error is its message (what failed the crawl was logged with its
            # cause); anything else its traceback. Either way the crawl did not close as it
            # says: scrapy crawl exits with 1
            logger.error("scrapy_idempotent: error while closing the frontier: %s", exc,
                         exc_info=not isinstance(exc, IdempotentError))
            engine_hooks.exit_nonzero(self.crawler)
        finally:
            workers.forget_live(self.worker)
            self.admission.keys.close()
            if self.dedup is not None:
                self.dedup.close()
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
        """True while anything could still be handed out: claimed or buffered requests
        (claimed ones waiting to be given back included), pending entries, or entries other
        workers hold (their lease may come back). Never raises; on a store error it answers
        True and lets the close take its course."""
        if self.health.failed:
            self.health.close_if_refused()
            return False
        if (self.claimed or self.claimed.has_give_back or self.tracker.unattributed.requests
                or len(self.tracker.memory)
                or self.writer.busy):  # (a batch being written may claim requests)
            return True
        try:
            status = self.store.status(self.worker)  # the read connection: never waits
            if status.claimable:
                self.claimed.pending_seen(time.monotonic())
                if status.leased_elsewhere:
                    # a dead worker's leases hold their slots' places (a site's limit
                    # counts them): back to pending without waiting for other work to end
                    self.leases.reclaim_soon(dead_only=True)
                return True
            if status.leased_elsewhere:
                self.leases.reclaim_soon()
                return True
            return False
        except StoreBusy as exc:  # a lost connection being re-established: asked again soon
            logger.warning("scrapy_idempotent: cannot read the frontier yet (%s)", exc)
            return True
        except Exception:
            logger.exception("scrapy_idempotent: cannot read the frontier")
            self.health.fail("cannot read the frontier")
            return False

    def enqueue_request(self, request: Request) -> bool:
        """Add ``request`` to the frontier (buffered until the transaction that completes the
        request it came from), or keep it in memory when it cannot be stored. Returns False
        for a duplicate and for a request the fingerprinter fails on. Never raises."""
        if self.health.failed:  # nothing is taken once the store failed (or was refused)
            return False
        try:
            return self.admission.enqueue(request)
        except Exception:
            logger.exception("scrapy_idempotent: cannot enqueue %s", describe(request))
            self.health.fail(f"cannot enqueue {describe(request)}")
            return False

    def next_request(self) -> Request | None:
        """The next request under lease, or None when nothing can be claimed now. Never
        raises."""
        if self.health.stopped:
            self.health.close_if_refused()
            return None
        try:
            request = self.hand_out.next()
            if request is None:
                # the engine asks again when a request finishes or at its heartbeat; a write
                # that brings requests (a claim, the end of an order wait) wakes it sooner
                self.wakeup.asked_in_vain = True
            return request
        except Exception:
            logger.exception("scrapy_idempotent: cannot lease the next request")
            self.health.fail("cannot lease the next request")
            return None

    def add_hand_out_gate(self, gate: Callable[[int], bool]) -> None:
        """Hand nothing out while ``gate(requests in flight)`` is False: the run's
        ``CLOSESPIDER_*`` limits keep the pages in flight within what the limit leaves
        (:class:`~.run_limits.RunCloseSpider`)."""
        self.hand_out.add_gate(gate)

    def close_before_fetching(self, reason: str, *, failed: bool = False) -> None:
        """Close the spider with ``reason`` before anything is handed out (``failed``: as a
        failed crawl, ``scrapy crawl`` exits with 1). Called while the engine opens the
        spider (from ``spider_opened``), where closing at once would leave it half open on
        Scrapy 2.13: the spider is closed in the reactor turn after the engine first asks
        for a request, and nothing is handed out."""
        closing: list[bool] = []

        def close_at_once(in_flight: int) -> bool:
            if not closing:
                closing.append(True)
                from twisted.internet import reactor as installed

                reactor: Any = installed
                close = engine_hooks.close_spider_failed if failed else \
                    scrapy_compat.close_spider
                reactor.callLater(0, close, self.crawler, reason)
            return False

        self.add_hand_out_gate(close_at_once)

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
        if self._session:  # (not when the store was refused at open)
            with contextlib.suppress(StoreBusy):
                self._last_counts = self.store.counts()
        counts = self._last_counts
        return (counts.get("pending", 0) + counts.get("leased", 0)
                + len(self.tracker.unattributed.requests) + len(self.tracker.memory))
