"""The commit path: units of work written to the store through the writer, then, once
durable, counted and announced.

:class:`CommitPath` is the way every write of the crawl goes: the tracker's completed pages
(:meth:`CommitPath.completed`), its buffered writes (:meth:`CommitPath.flush_soon`), claims
(:meth:`CommitPath.refill`). It owns the :class:`~.writer.WriterThread` and is its three
callbacks for each batch: before it is sent (what is buffered, the claim and the give-back),
once it is durable, and when it could not be written. It remembers where the requests of the
batches not written yet stand in Scrapy's order (:meth:`CommitPath.order_wait`).

:class:`CommitOutcomes` is what follows a commit, on the reactor thread: the stats of what
it wrote, the warnings about quarantined requests and lost leases, and the
:data:`~.signals.request_done` signal of each final state it wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from scrapy.utils.url import strip_url

from . import signals
from .exceptions import StoreError
from .leases import QueueRank, queue_rank, queue_rank_of_new, report_dead_worker_pauses
from .scrapy_compat import stat_counter
from .store.base import RequestState, UnitOfWork
from .writer import COMMIT_ATTEMPTS, LINGER_SECONDS, WriterThread, retry_busy

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred

    from .cookies import CookieKeeper
    from .engine_hooks import EngineWakeup
    from .health import CrawlHealth
    from .inflight import InflightTracker
    from .inflight_entries import InflightRequest
    from .leases import ClaimedRequests
    from .store.base import CommitResult, Completion, FrontierStore, LeasedRequest, NewRequest

__all__ = [
    "COMMIT_ATTEMPTS",
    "CommitOutcomes",
    "CommitPath",
    "retry_busy",
]

logger = logging.getLogger(__name__)

#: How long a write nothing waits for (a download's count) may wait for a page's completion
#: to go with, before it is sent in a transaction of its own.
COUNT_LINGER_SECONDS = 0.05


def _adds_pending(work: UnitOfWork) -> bool:
    # (a page answered 304 enqueues the requests of its last fetch again)
    return bool(work.requests) or any(c.state is RequestState.PENDING or c.not_modified
                                      for c in work.completions)


class CommitPath:
    """Every write of one worker (see the module docstring)."""

    def __init__(self, store: FrontierStore, worker: str, *, tracker: InflightTracker,
                 claimed: ClaimedRequests, outcomes: CommitOutcomes, health: CrawlHealth,
                 wakeup: EngineWakeup, outbox_targets: Any, threaded: bool = True,
                 cookies: CookieKeeper | None = None,
                 slots_wait: Callable[[float], None] | None = None) -> None:
        self.store = store
        self.tracker = tracker
        self.claimed = claimed
        self.outcomes = outcomes
        self.health = health
        self.wakeup = wakeup
        self.outbox_targets = outbox_targets
        #: the cookie jars written with the transactions (None: not kept)
        self.cookies = cookies
        #: every write of the crawl (see :mod:`.writer`); ``threaded=False`` writes at once
        #: on the calling thread (a scheduler driven by hand, outside a crawl)
        self.writer = WriterThread(store, worker, prepare=self._prepare,
                                   committed=self._committed, failed=self._failed,
                                   threaded=threaded)
        #: batch number -> the first place in Scrapy's order among the requests it adds (or
        #: puts back to pending), for the batches not written yet (see order_wait)
        self._unwritten: dict[int, QueueRank] = {}
        self._gated = 0  #: responses waiting for their writes before their callback
        self._flush_call: Any = None
        #: told the seconds until a download slot that waits may send (see .politeness);
        #: None without the crawl's slot limits
        self.slots_wait = slots_wait

    def start(self) -> None:
        """From now on the writer's thread uses the write connection, and responses wait
        for their attempt's writes (:meth:`writes_durable`)."""
        self.writer.start()
        if self.writer.threaded:
            # and reconnects after a lost connection: the reads here never wait for it
            self.store.never_wait_here()

    def drain(self) -> Deferred[None] | None:
        """Send everything buffered; a Deferred fired once it is all written (None: the
        writer is not running)."""
        if not self.writer.running:
            return None
        self.writer.commit()
        return self.writer.drain()

    def stop(self) -> None:
        """End the writer's thread: the store is the caller's again, and its writes wait
        for the database."""
        self.writer.stop()
        self.store.never_wait_here(False)

    @property
    def gated(self) -> bool:
        """Whether a response waits for its writes before its callback runs."""
        return self._gated > 0

    def completed(self, work: UnitOfWork, entry: InflightRequest | None) -> None:
        """The tracker's ``complete``: ``entry`` (with its memory requests) finished, or a
        memory request of no stored request did (``entry`` None)."""
        if _adds_pending(work):
            self.claimed.claimable_again()
        elif self.slots_wait is not None and work.completions and not work.claim:
            # with the crawl's slot limits a completion frees a place in its slot: its own
            # transaction claims, even after a claim found the slots full (no claim of its
            # own for that: it would find them full again)
            work.claim = self.claimed.claim_size(self.health.closing, after_completion=True)
        if entry is not None and any(c.state.terminal for c in work.completions):
            self.outcomes.expect(entry.key, entry.request, entry.fingerprint)
        self.commit(work)

    def commit(self, work: UnitOfWork) -> int:
        """Write ``work`` plus everything buffered in one transaction, claiming new leases
        when the local batch runs low: with the writer's batch (several pages may share it),
        or at once when the writer is stopped (at close). Returns the batch's number (0: at
        once, or nothing to write). The writer retries on a locked database; when it gives
        up the spider is closed (the uncommitted entries stay leased and are released at
        close)."""
        if self.health.failed:
            return 0
        if self.writer.running:
            self._note_order(self.writer.open_seq, work.requests, work.completions)
            return self.writer.commit(work)
        self._prepare(work, 0)
        if work:
            try:
                result = retry_busy("committing",
                                    lambda: self.store.commit(work, self.writer.worker))
            except Exception as exc:
                self._failed(work, exc)
            else:
                self._committed(work, result)
        return 0

    def flush_buffered(self) -> None:
        """Write what waits without a page: requests of no page, claimed ones to give back."""
        if self.tracker.unattributed or self.claimed.has_give_back:
            self.commit(UnitOfWork())

    def refill(self) -> bool:
        """Claim requests, when the store may have some: at once when the writer's thread is
        idle, else with the batch after the one in flight (it wakes the engine)."""
        if not self.claimed.may_refill(time.monotonic(), bool(self.tracker.unattributed)):
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
        self.commit(UnitOfWork(claim=self.claimed.claim_size(self.health.closing, asked=True)))
        if self.writer.running:
            self.writer.commit_now()
        return bool(self.claimed)

    def order_wait(self, head: LeasedRequest) -> bool:
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

    # -- the writer's callbacks -----------------------------------------------------------

    def _prepare(self, work: UnitOfWork, seq: int) -> None:
        """The writer's ``prepare``: add what is buffered, the claim and the give-back."""
        pages = len(work.requests)
        self.tracker.drain_into(work)  # (the requests of no page go first)
        if _adds_pending(work):
            self.claimed.claimable_again()
            if seq:  # the pages' requests were noted when they were committed
                self._note_order(seq, work.requests[:len(work.requests) - pages], ())
        self.claimed.prepare(work, self.health.closing)
        work.outbox_targets = self.outbox_targets  # announce its record changes
        if self.cookies is not None:
            jars = self.cookies.changed(force=self.health.closing)
            if jars is not None:
                work.meta["cookies"] = jars

    def _committed(self, work: UnitOfWork, result: CommitResult) -> None:
        """The writer's ``committed``: count, announce, take the claimed requests."""
        self.outcomes.committed(result, work)
        self.tracker.written(work)
        self.claimed.accept(work, result)
        if work.claim and not result.leased and not work.requests:
            self.claimed.found_none(time.monotonic())
        if result.claim_again_in is not None and self.slots_wait is not None:
            self.slots_wait(result.claim_again_in)
        self.wakeup.if_asked_in_vain()

    def _failed(self, work: UnitOfWork, exc: BaseException) -> None:
        """The writer's ``failed``: nothing of ``work`` was written, nor will anything more."""
        logger.error("scrapy_idempotent: cannot write to the frontier database",
                     exc_info=(type(exc), exc, exc.__traceback__)
                     if not isinstance(exc, StoreError) else False)
        self.tracker.restore_from(work)
        self.health.fail(
            f"frontier database error: {exc}; what was committed before is kept: fix "
            "the cause and run the same crawl again to resume"
        )

    # -- the tracker's buffered writes ----------------------------------------------------

    def writes_durable(self, seq: int) -> Deferred[None] | None:
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
                self.wakeup.now()
        return waiting

    def _gate_passed(self, result: Any) -> Any:
        self._gated -= 1
        return result

    def flush_soon(self) -> int:
        """The tracker's ``flush_soon``: what it buffered (an attempt's start, its journaled
        response) goes with the writer's next batch; returns that batch's number. Its
        response waits for it (:meth:`writes_durable`)."""
        if self.writer.threaded and self.writer.running:
            return self.writer.open_seq
        if self._flush_call is None or not self._flush_call.active():
            from twisted.internet import reactor as installed  # the one Scrapy installed

            clock: Any = installed
            self._flush_call = clock.callLater(0, self._flush)
        return 0

    def write_soon(self) -> None:
        """The tracker's ``write_soon``: what it buffered goes with the writer's next batch,
        sent within :data:`COUNT_LINGER_SECONDS` even when no page completes meanwhile."""
        if self.writer.threaded and self.writer.running:
            self.writer.commit(linger=COUNT_LINGER_SECONDS)
        else:
            self.flush_soon()

    def _flush(self) -> None:
        if self.tracker.has_attempt_writes and not self.health.stopped:
            self.commit(UnitOfWork())


class CommitOutcomes:
    """What follows a commit (see the module docstring)."""

    def __init__(self, crawler: Crawler, stats: StatsCollector, max_attempts: int, *,
                 spider: Spider | None, next_run: Callable[[int], None]) -> None:
        self.crawler = crawler
        self.stats = stats
        self._count = stat_counter(stats)  # (for every page)
        self.max_attempts = max_attempts  #: IDEMPOTENT_MAX_ATTEMPTS, for the log
        self.spider = spider
        #: ``next_run(run_id)``: this worker moved to a newer run (see CommitResult.run_id)
        self.next_run = next_run
        #: key -> (request, fingerprint) of final states on their way to the database: the
        #: request_done signal is sent for each once the transaction writing it committed
        self._announce: dict[str, tuple[Request | None, str]] = {}

    def expect(self, key: str, request: Request | None, fingerprint: str) -> None:
        """A final state of ``key`` goes to the database: announce it once committed.
        ``request`` is None for a stored request that could not be loaded."""
        self._announce[key] = (request, fingerprint)

    def committed(self, result: CommitResult, work: UnitOfWork) -> None:
        """``work`` is durable: count it and announce its final states."""
        if result.run_id is not None:
            self.stats.set_value("idempotent/run_id", result.run_id)
            logger.info("scrapy_idempotent: the run this crawl joined was finished by another "
                        "crawl and run %d started since: this crawl goes on in run %d",
                        result.run_id, result.run_id)
            self.next_run(result.run_id)
        self._record_stats(result, work)
        self._announce_completions(result, work)

    def already_done(self, request: Request, key: str, fingerprint: str) -> None:
        """``request_done`` with state ``already_done`` for a known request refused because
        it is already finished in this window (its final state was committed earlier)."""
        signals.send_request_done(self.crawler, self.spider, request, key, fingerprint,
                                  signals.ALREADY_DONE)

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

    def _record_stats(self, result: CommitResult, work: UnitOfWork) -> None:
        self._count_completions(result, work)
        for url in result.quarantined:
            logger.warning(
                "scrapy_idempotent: %s quarantined (failed): it was started %d times without "
                "finishing, as if it killed the crawl each time; `scrapy idempotent retry "
                "--kind quarantined` puts it back", strip_url(url, strip_credentials=True),
                self.max_attempts)
        if result.reclaimed is not None:
            report_dead_worker_pauses(self.stats, result.reclaimed)
        inc = self._count
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
            ("records/stale", result.records_stale),
            ("records/rejected", result.rejects),
            ("requests/leases_lost", result.leases_lost),
            ("requests/quarantined", len(result.quarantined)),
            ("outbox/written", result.outbox_entries),
            ("conditional/relinked", result.requests_relinked),
        ):
            if value:
                inc(f"idempotent/{name}", value)

    def _count_completions(self, result: CommitResult, work: UnitOfWork) -> None:
        """Stats of the completions written (a lost lease's completion counts nothing)."""
        lost = set(result.lost)
        for completion in work.completions:
            if completion.key in lost:
                continue  # nothing of it was written: it does not count
            self._count(f"idempotent/requests/{completion.state.value}"
                        if completion.state is not RequestState.PENDING
                        else "idempotent/requests/continued")
            if completion.error_kind:
                self._count(f"idempotent/failed/{completion.error_kind}")
        if lost:
            logger.warning(
                "scrapy_idempotent: %d completed request(s) were not this worker's any more "
                "(their lease expired, e.g. the process was stopped, and another worker took "
                "them): nothing of their work was written (idempotent/requests/leases_lost)",
                len(lost))
