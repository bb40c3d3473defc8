"""Hand-out: which request the scheduler gives the engine next.

:class:`HandOut` takes the head of the requests claimed ahead (:class:`~.ClaimedRequests`),
or a request kept in memory (:class:`~.InflightTracker`), and decides whether it may go now:
not while a lease renewal is out, not while a response waits for its writes, not before the
requests being written that Scrapy would send first, a suspect only alone. It decodes the
stored request and tells the tracker and the politeness what was handed out.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

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
    """The scheduler's ``next_request`` below the contract (the codec is set at open)."""

    def __init__(self, *, tracker: InflightTracker, claimed: ClaimedRequests,
                 commits: CommitPath, leases: LeaseKeeper, outcomes: CommitOutcomes,
                 politeness: Politeness, stats: StatsCollector) -> None:
        self.tracker, self.claimed, self.commits = tracker, claimed, commits
        self.leases, self.outcomes, self.politeness = leases, outcomes, politeness
        self.writer = commits.writer
        self.stats = stats
        self.codec: RequestCodec | None = None

    def next(self) -> Request | None:
        """The next request to send, or None when none may go now."""
        tracker, claimed, commits = self.tracker, self.claimed, self.commits
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
                return tracker.hand_out_memory() if tracker.memory_requests else None
            if not claimed and not commits.refill():
                return tracker.hand_out_memory() if tracker.memory_requests else None
            if tracker.memory_requests and tracker.memory_goes_before(claimed.head()):
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
            if claimed.head_expired(time.time()):
                # The batch claimed ahead sat here past its lease (the process was stopped,
                # or the reactor blocked): another worker may have it now.
                self.leases.renew()
                if self.leases.renewing:
                    return None  # the renewal wakes the engine when it is back
                continue
            if claimed.give_back_head_if_late(time.time()):
                # of a slot with a delay, too late to be sent: another claim of its slot
                # may already count on it being gone (given back with the next transaction)
                self.stats.inc_value("idempotent/requests/given_back_late")
                continue
            request = self._load(claimed.pop())
            if request is not None:
                return request

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
        self.politeness.handing_out(request)
        self.stats.inc_value("idempotent/requests/leased")
        if leased.attempts > 1:
            self.stats.inc_value("idempotent/requests/repeated")
        return request
