"""A worker's leases: the requests it claimed ahead, and the periodic lease work.

:class:`LeaseKeeper` is the periodic work (every ``IDEMPOTENT_LEASE_SECONDS / 3``): renew
this worker's leases in one statement and forget those found lost, flush what waits without a
page, give the space of deleted journal rows back; it also puts the leases of this host's
dead workers and the expired leases back to pending (at open, and while the frontier is held
elsewhere), and wakes the engine when the store says another worker made work claimable.

:class:`ClaimedRequests` are the requests claimed ahead: leased in the store, not handed to
the engine yet.

A claim takes up to ``IDEMPOTENT_LEASE_BATCH`` requests in one transaction (usually the
transaction of a page's completion), so ``next_request`` is served from here. The requests
here are kept in Scrapy's order (:func:`queue_rank`), and always go before every pending
request of the frontier: a transaction that adds requests (which may go before some claimed
here: a child is taken before older requests of its priority) also claims the first of the
pending requests, as many as it added, and those are sorted in among the ones here. When
more were added than a claim takes, a request here that the claim did not show to go first
is given back (with the next transaction). A claimed request is dropped when its lease was
found lost, and released at close.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from twisted.internet import task

from . import workers
from .exceptions import StoreBusy
from .store.base import RequestState

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector
    from twisted.python.failure import Failure

    from .engine_hooks import EngineWakeup
    from .health import CrawlHealth
    from .inflight import InflightTracker
    from .store.base import (
        CommitResult,
        FrontierStore,
        LeasedRequest,
        NewRequest,
        Reclaimed,
        UnitOfWork,
    )
    from .writer import WriterThread

__all__ = ["ClaimedRequests", "LeaseKeeper", "QueueRank", "queue_rank", "queue_rank_of_new",
           "report_dead_worker_pauses"]

logger = logging.getLogger(__name__)

#: ``(-priority, is_start, rank)``: smaller is taken first (the store's claim order).
QueueRank = tuple[int, int, float]


def queue_rank(leased: LeasedRequest) -> QueueRank:
    """Where a claimed request stands in Scrapy's order (see :mod:`._order`)."""
    return (-leased.priority, int(leased.is_start), leased.rank)


_LAST = float("inf")
_FIRST = float("-inf")


def queue_rank_of_new(new: NewRequest) -> QueueRank:
    """Where a request not written yet will stand: after every entry of its queue when taken
    first-in-first-out, before every one when last-in-first-out (it is the newest)."""
    return (-new.priority, int(new.is_start), _LAST if new.fifo else _FIRST)


class ClaimedRequests:
    """The lease buffer of one worker, in claim order."""

    def __init__(self, batch: int, *, sendable: Callable[[], int] | None = None) -> None:
        self.batch = batch  #: IDEMPOTENT_LEASE_BATCH
        #: with the crawl's slot limits, how many more requests the worker's downloader
        #: takes now (``CONCURRENT_REQUESTS`` less those it works on): a claim takes no more
        #: than that, so that a slot's places claimed ahead are places this worker fills
        #: soon, not places other workers could send in (None: a full batch)
        self.sendable = sendable
        self._claimed: deque[LeasedRequest] = deque()  #: in Scrapy's order
        #: claimed requests to give back with the next transaction (never handed out)
        self._give_back: list[str] = []
        #: the store may hold claimable requests (False after a claim found none, until
        #: something may have changed that: new requests, a pending completion, a reclaim)
        self._maybe_claimable = True
        self._recheck_at = 0.0  #: ask the store again from then on, even without a change
        #: the leases held at the last renewal last until then (``time.monotonic()``)
        self.renewed_until = 0.0
        #: the last claim left requests of download slots that wait (a delay, a pause)
        #: until then (``time.monotonic()``): a frontier read showing pending requests does
        #: not make a claim worth a transaction before
        self.slots_ready_at = 0.0
        #: claimed key -> what turns its store times into ``time.monotonic()`` (added):
        #: every time compared here is on this process's monotonic clock, so neither a
        #: skew from the database server's clock nor a step of the wall clock makes a
        #: claimed request look late or live when it is not
        self._to_local: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._claimed)

    def __bool__(self) -> bool:
        return bool(self._claimed)

    def head(self) -> LeasedRequest:
        """The next request to hand out (there must be one)."""
        return self._claimed[0]

    def pop(self) -> LeasedRequest:
        leased = self._claimed.popleft()
        self._to_local.pop(leased.key, None)
        return leased

    def give_back_head_if_late(self, now: float) -> bool:
        """Give the next request back (unsent, with the next transaction) when it is of a
        download slot with a delay and its time to be sent has passed (see
        :attr:`.LeasedRequest.send_by`; ``now``: ``time.monotonic()``); True when it was."""
        head = self._claimed[0]
        if not head.send_by or now <= head.send_by + self._to_local.get(head.key, 0.0):
            return False
        self.give_back_head()
        return True

    def give_back_head(self) -> None:
        """Give the next request back unsent (with the next transaction)."""
        head = self.pop()
        self._give_back.append(head.key)
        self._maybe_claimable = True

    def head_expired(self, now: float) -> bool:
        """Whether the next request sat here past its lease (the process was stopped, or the
        reactor blocked; ``now``: ``time.monotonic()``): another worker may have it now."""
        head = self._claimed[0]
        return max(head.leased_until + self._to_local.get(head.key, 0.0),
                   self.renewed_until) <= now

    def claim_size(self, closing: bool, *, after_completion: bool = False,
                   asked: bool = False) -> int:
        """How many requests to claim with the next transaction: none while closing, while
        the store is known to have none (unless ``after_completion``: a completion freed a
        place in a download slot), or while at least half a
        batch is claimed ahead; with :attr:`sendable`, no more than the downloader takes
        now (at least one when ``asked``: the engine asks for a request, so its downloader
        has room)."""
        if closing or not (self._maybe_claimable or after_completion):
            return 0
        if len(self._claimed) >= max(1, self.batch // 2):
            return 0
        room = self._room()
        if asked:
            room = max(room, 1)
        return max(0, min(self.batch, room) - len(self._claimed))

    def _room(self) -> int:
        """How many requests may be claimed ahead at most (see :attr:`sendable`)."""
        if self.sendable is None:
            return self.batch
        return max(0, self.sendable())

    def prepare(self, work: UnitOfWork, closing: bool) -> None:
        """Set ``work``'s claim and give-back. Requests the transaction adds, and requests it
        puts back to pending (a retry), may go before those claimed here: it claims as many
        of the first pending ones as those (a batch at most)."""
        if self._give_back:
            work.give_back.extend(self._give_back)
            self._give_back = []
        if closing:
            work.claim = 0
            return
        claim = work.claim or self.claim_size(closing)
        added = len(work.requests) + sum(
            1 for c in work.completions if c.state is RequestState.PENDING)
        if added and self._claimed:
            claim = max(claim, min(added, self.batch, self._room()))
        work.claim = claim

    def accept(self, work: UnitOfWork, result: CommitResult) -> None:
        """``work`` was committed: what it claimed joins the requests here, in order. When
        it added more requests than it claimed and its claim was full, a pending request may
        still go before some here: those are given back (with the next transaction)."""
        leased = result.leased
        if not leased:
            return
        store_now, local_now = result.claimed_at
        to_local = local_now - store_now
        self._to_local.update((r.key, to_local) for r in leased)
        merged = sorted([*self._claimed, *leased], key=queue_rank)
        added = len(work.requests) + sum(
            1 for c in work.completions if c.state is RequestState.PENDING)
        if self._claimed and added > work.claim and len(leased) >= work.claim:
            last = max(queue_rank(r) for r in leased)
            keep = [r for r in merged if queue_rank(r) <= last]
            for r in merged:
                if queue_rank(r) > last:
                    self._give_back.append(r.key)
                    self._to_local.pop(r.key, None)
            merged = keep
        if self.sendable is not None:
            # no more held than the downloader takes now (or than were held before): two
            # claims may be on their way at once, each sized by the same room; requests
            # added by the transaction and claimed with it may rank after those held (start
            # requests go first in, first out); and a place of a slot held here is one no
            # other worker can send in
            most = max(self._room(), len(self._claimed))
            for r in merged[most:]:
                self._give_back.append(r.key)
                self._to_local.pop(r.key, None)
            merged = merged[:most]
        self._claimed = deque(merged)

    @property
    def maybe_claimable(self) -> bool:
        """Whether the store may hold claimable requests (see :meth:`claimable_again`)."""
        return self._maybe_claimable

    def claimable_again(self) -> None:
        """Requests may be claimable again (new or pending requests on their way to the
        store, leases reclaimed): the next claim asks the store."""
        self._maybe_claimable = True

    def may_refill(self, now: float, buffered_writes: bool) -> bool:
        """Whether a claim is worth a transaction now (after one found nothing, only once a
        second has passed or writes are buffered that may make requests claimable)."""
        if not self._maybe_claimable and now < self._recheck_at and not buffered_writes:
            return False
        self._maybe_claimable = True
        return True

    def found_none(self, now: float) -> None:
        """A claim returned nothing: do not ask again for a second unless something
        changes."""
        self._maybe_claimable = False
        self._recheck_at = now + 1.0

    def pending_seen(self, now: float) -> None:
        """A read of the frontier (``now``: ``time.monotonic()``) shows pending requests:
        worth a claim once the slots the last claim left wait no more and the bound after a
        claim that found none has passed. Not at once: with the crawl's limits, pending
        requests are often not claimable (their slot full or paused), and an idle worker
        would commit claims in a loop (the engine asks for the next request after each).
        A completion of this worker's, a notification of another's, or the end of a
        slot's wait asks the store sooner."""
        if now >= self.slots_ready_at and now >= self._recheck_at:
            self._maybe_claimable = True

    def slots_wait_until(self, when: float) -> None:
        """The requests left pending wait for their slots until ``when`` (unix seconds)."""
        self.slots_ready_at = when

    def wake(self) -> None:
        """Another worker may have made requests claimable (the store said so): ask the
        store at the next chance, without waiting for the recheck."""
        self._maybe_claimable = True
        self._recheck_at = 0.0

    def keep_held(self, held: set[str]) -> int:
        """Drop the requests whose lease is not in ``held`` (found lost at a renewal; never
        handed out). Returns how many were dropped."""
        stale = sum(1 for leased in self._claimed if leased.key not in held)
        if stale:
            self._claimed = deque(leased for leased in self._claimed if leased.key in held)
            self._to_local = {leased.key: self._to_local[leased.key]
                              for leased in self._claimed if leased.key in self._to_local}
            self._maybe_claimable = True
        return stale

    def clear(self) -> None:
        self._claimed.clear()
        self._give_back.clear()
        self._to_local.clear()

    @property
    def has_give_back(self) -> bool:
        """Whether claimed requests wait to be given back with the next transaction."""
        return bool(self._give_back)


class LeaseKeeper:
    """The periodic lease work of one worker (see the module docstring). ``flush`` writes
    what waits without a page; ``health`` stops the work once the crawl closes or failed."""

    def __init__(self, store: FrontierStore, writer: WriterThread, *,
                 tracker: InflightTracker, claimed: ClaimedRequests, stats: StatsCollector,
                 health: CrawlHealth, wakeup: EngineWakeup, lease_seconds: float,
                 flush: Callable[[], None], sample_seconds: float = 0.0) -> None:
        self.store = store
        self.writer = writer
        self.tracker = tracker
        self.claimed = claimed
        self.stats = stats
        self.health = health
        self.wakeup = wakeup
        self.lease_seconds = lease_seconds
        self.flush = flush
        self.sample_seconds = sample_seconds
        self._sampling: task.LoopingCall | None = None
        #: which leases are still this worker's is being asked (nothing is handed out)
        self.renewing = False
        self._loop: task.LoopingCall | None = None
        self._dead_check_at = 0.0
        self._reclaiming = False  #: a reclaim is on the writer's thread
        self._woken = False

    def start(self) -> None:
        """Begin the periodic work, and listen for the store's signal of new work."""
        self._loop = task.LoopingCall(self._tick)
        self._loop.start(self.lease_seconds / 3, now=False)
        if self.sample_seconds > 0:
            self._sampling = task.LoopingCall(self.sample)
            # the first after one interval: a sample at the open would hold the writer from
            # the first claim (and change the order of the first requests sent)
            self._sampling.start(self.sample_seconds, now=False)
        self.store.watch_for_work(self._work_may_be_claimable)

    def stop(self) -> None:
        for loop in (self._loop, self._sampling):
            if loop is not None and loop.running:
                loop.stop()

    # -- progress samples -------------------------------------------------------------------

    def sample(self) -> None:
        """Every IDEMPOTENT_SAMPLE_SECONDS: store the run's counters as the sample of this
        slot, unless another worker did (one statement, on the writer's thread)."""
        if self.health.stopped:
            return
        interval = self.sample_seconds
        sampling = self.writer.call("storing a progress sample",
                                    lambda store: store.record_sample(interval))
        sampling.addErrback(lambda failure: logger.warning(
            "scrapy_idempotent: cannot store a progress sample: %s", failure.value))

    def final_sample(self) -> None:
        """At close, on the calling thread: the run's figures as this worker leaves them."""
        if self.sample_seconds <= 0:
            return
        try:
            self.store.record_sample(self.sample_seconds, final=True)
        except Exception as exc:  # a picture of the run, not its work: never fails a close
            logger.warning("scrapy_idempotent: cannot store a progress sample: %s", exc)

    def _tick(self) -> None:
        """Every lease_seconds / 3: renew this worker's leases (one statement for all),
        flush buffered writes, reclaim space."""
        if self.health.stopped:
            return
        try:
            self.renew()
            self.flush()
        except Exception:
            logger.exception("scrapy_idempotent: cannot renew leases")
            return
        self.reclaim_space(everything=False)

    # -- renewal ----------------------------------------------------------------------------

    def renew(self) -> None:
        """Renew this worker's live leases (one statement, on the writer's thread) and, once
        renewed, forget those that expired: the requests claimed ahead are dropped (never
        handed out), and a request in flight whose lease expired is finished without writing
        anything (the store fences it)."""
        if self.renewing:
            return
        self.renewing = True
        began = time.monotonic()  # (the store writes its clock's now + lease_seconds)
        worker = self.writer.worker
        renewing = self.writer.call("renewing leases",
                                    lambda store: store.renew_leases(worker))
        renewing.addCallbacks(self._renewed, self._renew_failed, callbackArgs=(began,))

    def _renew_failed(self, failure: Failure) -> None:
        self.renewing = False
        logger.error("scrapy_idempotent: cannot renew leases: %s", failure.value)

    def _renewed(self, keys: list[str], began: float) -> None:
        self.renewing = False
        held = set(keys)
        self.wakeup.if_asked_in_vain()
        self.claimed.renewed_until = began + self.lease_seconds
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

    # -- reclaims ---------------------------------------------------------------------------

    def _is_dead(self, worker: str) -> bool:
        """Whether ``worker``, holding leases, is another worker of this host (of its PID
        namespace) whose process is gone."""
        return worker != self.writer.worker and workers.worker_is_dead(worker)

    def reclaim_dead_workers(self) -> int:
        """At open, on the calling thread: put the dead workers' leases back to pending (a
        restart's own predecessor's included), their slots paused with the crawl's limits
        unless no other worker of the crawl is alive (:meth:`.FrontierStore.reclaim_leases`
        with ``starting``); returns how many."""
        reclaimed = self.store.reclaim_leases(expired=False, is_dead=self._is_dead,
                                              starting=True)
        self._leases_reclaimed(reclaimed, wake=False)
        return reclaimed.released

    def reclaim_soon(self, *, dead_only: bool = False) -> None:
        """Other workers hold leases: put those of dead workers of this host and (unless
        ``dead_only``) the expired ones back to pending, their slots paused with the
        crawl's limits; the claim that follows may take them. On the writer's thread (the
        read of who holds leases included), one check at a time, at most once a second;
        with ``dead_only``, a read and no write unless a dead worker holds some (the worker
        has other work, and expired leases wait for it)."""
        now = time.monotonic()
        if self._reclaiming or now < self._dead_check_at:
            return
        self._dead_check_at = now + 1.0
        is_dead, expired = self._is_dead, not dead_only
        self._reclaiming = True
        try:
            reclaiming = self.writer.call("reclaiming leases", lambda store: (
                store.reclaim_leases(expired=expired, is_dead=is_dead)))
        except BaseException:
            self._reclaiming = False
            raise
        reclaiming.addCallbacks(self._leases_reclaimed, self._reclaim_failed)
        reclaiming.addBoth(self._reclaim_done)

    def _reclaim_failed(self, failure: Failure) -> None:
        if isinstance(failure.value, StoreBusy):  # the server away: asked again later
            return
        logger.warning("scrapy_idempotent: could not reclaim leases: %s", failure.value)

    def _reclaim_done(self, _: object) -> None:
        self._reclaiming = False

    def _leases_reclaimed(self, reclaimed: Reclaimed, *, wake: bool = True) -> None:
        if reclaimed.released:
            self.stats.inc_value("idempotent/requests/reclaimed", reclaimed.released)
            logger.info("scrapy_idempotent: reclaimed %d leases of dead workers %s",
                        reclaimed.released, ", ".join(reclaimed.dead))
        report_dead_worker_pauses(self.stats, reclaimed)
        if reclaimed.released or reclaimed.expired:
            self.claimed.claimable_again()
            if wake:
                self.wakeup.if_asked_in_vain()

    def reclaim_space(self, *, everything: bool) -> None:
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

    # -- the store's signal -----------------------------------------------------------------

    def _work_may_be_claimable(self) -> None:
        """The store's signal that another worker may have made requests claimable (any
        thread): wake the engine once (a signal that comes while one is pending joins it)."""
        if self._woken or self.health.closing:
            return
        self._woken = True
        from twisted.internet import reactor

        reactor.callFromThread(self._wake)

    def _wake(self) -> None:
        self._woken = False
        if self.health.stopped:
            return
        self.stats.inc_value("idempotent/wakeups")
        self.claimed.wake()
        self.wakeup.now()


def report_dead_worker_pauses(stats: StatsCollector, reclaimed: Reclaimed) -> None:
    """The download slots paused because a worker that died (or whose leases ran out) held
    requests of them when its leases were taken back (:meth:`.FrontierStore.reclaim_leases`):
    counted as ``idempotent/slots/paused_after_dead_worker``, one INFO line per worker."""
    for worker, slots in reclaimed.paused.items():
        stats.inc_value("idempotent/slots/paused_after_dead_worker", len(slots))
        logger.info("scrapy_idempotent: download slots %s paused for %.1f s for every worker: "
                    "worker %s held requests of them when its leases were taken back (dead "
                    "or stopped, it may have got a 429 it could not write)",
                    ", ".join(slots), reclaimed.paused_seconds, worker)
