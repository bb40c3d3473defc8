"""Hand-out: which request the scheduler gives the engine next.

:class:`HandOut` takes the head of the requests claimed ahead (:class:`~.ClaimedRequests`),
or a request kept in memory (:class:`~.InflightTracker`), and decides whether it may go now:
not while a lease renewal is out, not while a response waits for its writes, not before the
requests being written that Scrapy would send first, a suspect only alone. It decodes the
stored request and tells the tracker and the politeness what was handed out.

A request this process took into the frontier is usually handed out soon after (Scrapy's
order is last in, first out): :class:`RecentRequests` keeps the latest ones, so that the
request object the callback yielded goes to the engine, as in Scrapy, instead of a copy
decoded from its stored text (the claim still reads that text: only an entry whose stored
text is the one this process wrote is taken from memory).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import scrapy_compat
from .recent_requests import RecentRequests

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.statscollectors import StatsCollector

    from .codec import RequestCodec
    from .commits import CommitOutcomes, CommitPath
    from .inflight import InflightTracker
    from .leases import ClaimedRequests, LeaseKeeper
    from .politeness import Politeness
    from .store.base import LeasedRequest

__all__ = ["HandOut"]

logger = logging.getLogger(__name__)

class HandOut:
    """The scheduler's ``next_request`` below the contract."""

    def __init__(self, *, tracker: InflightTracker, claimed: ClaimedRequests,
                 commits: CommitPath, leases: LeaseKeeper, outcomes: CommitOutcomes,
                 politeness: Politeness, stats: StatsCollector, codec: RequestCodec,
                 recent: RecentRequests | None = None) -> None:
        self.tracker, self.claimed, self.commits = tracker, claimed, commits
        self.recent = recent if recent is not None else RecentRequests()
        self.leases, self.outcomes, self.politeness = leases, outcomes, politeness
        self.writer = commits.writer
        self.stats = stats
        self._count = scrapy_compat.stat_counter(stats)  # (for every page)
        self.codec = codec
        #: ``gate(in_flight)``: False holds the hand-out (see :meth:`add_gate`)
        self._gates: list[Callable[[int], bool]] = []

    def add_gate(self, gate: Callable[[int], bool]) -> None:
        """Hand nothing out while ``gate(requests in flight)`` is False (the run's
        ``CLOSESPIDER_*`` limits: no more pages than the limit leaves room for). The engine
        asks again when a request in flight finishes."""
        self._gates.append(gate)

    def next(self) -> Request | None:
        """The next request to send, or None when none may go now."""
        tracker, claimed, commits = self.tracker, self.claimed, self.commits
        if self._gates and not all(gate(tracker.in_flight_count) for gate in self._gates):
            return None
        if self.leases.renewing and not self.writer.stalled:
            # which leases are still this worker's is being asked: nothing is handed out
            # under a lease that may be lost (asked again when the renewal is back)
            return None
        if commits.gated and not self.writer.stalled:
            # A response waits for its writes before its callback runs: in Scrapy the
            # callback would have run, and its requests would be enqueued, before the next
            # request is sent (they may go first). Asked again once it has run.
            return None
        while True:
            if tracker.suspects_in_flight:
                # a suspect runs alone (see below), with its own memory requests (each
                # holds the suspect's lease)
                return tracker.hand_out_memory() if len(tracker.memory) else None
            if not claimed and not commits.refill():
                if len(tracker.memory):
                    return tracker.hand_out_memory()
                # nothing claimable: a dead worker's leases may hold the places of the
                # slots that have pending requests (a read at most once a second)
                self.leases.reclaim_soon(dead_only=True)
                return None
            if len(tracker.memory) and tracker.memory.goes_before(claimed.head()):
                return tracker.hand_out_memory()
            if commits.order_wait(claimed.head()):
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
            if claimed.head_expired(time.monotonic()):
                # The batch claimed ahead sat here past its lease (the process was stopped,
                # or the reactor blocked): another worker may have it now.
                self.leases.renew()
                if self.leases.renewing:
                    return None  # the renewal wakes the engine when it is back
                continue
            if claimed.give_back_head_if_late(time.monotonic()):
                # of a slot with a delay, too late to be sent: another claim of its slot
                # may already count on it being gone (given back with the next transaction)
                self.stats.inc_value("idempotent/requests/given_back_late")
                continue
            if self.politeness.holding(claimed.head().slot):
                # of a slot its site paused a moment ago (a 429): not sent, whether the
                # pause is written yet or not; given back with a transaction after the
                # pause's, so no claim takes it before the pause holds
                claimed.give_back_head()
                self.stats.inc_value("idempotent/requests/given_back_paused")
                continue
            request = self._load(claimed.pop())
            if request is not None:
                return request

    def _load(self, leased: LeasedRequest) -> Request | None:
        if leased.unreadable:  # its row is damaged: nothing to load
            self._unloadable(leased, leased.unreadable)
            return None
        request = self.recent.take(leased.key, leased.data)
        if request is not None and self.tracker.for_request(request) is not None:
            request = None  # the same object yielded twice (dont_filter): a copy for this one
        try:
            if request is None:
                request = self.codec.decode(leased.data)
        except Exception as exc:
            self._unloadable(leased, str(exc))
            return None
        self.tracker.handed_out(leased, request)
        self.politeness.handing_out(request)
        self._count("idempotent/requests/leased")
        if leased.attempts > 1:
            self._count("idempotent/requests/repeated")
        return request

    def _unloadable(self, leased: LeasedRequest, why: str) -> None:
        """A leased request that cannot be loaded ends failed as ``unloadable``."""
        self.stats.inc_value("idempotent/requests/unloadable")
        logger.error("scrapy_idempotent: cannot load stored request %s: %s", leased.key, why)
        self.tracker.fail_unloadable(leased.key, why)
        self.outcomes.expect(leased.key, None, leased.fingerprint)
