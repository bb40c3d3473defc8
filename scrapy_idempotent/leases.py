"""The requests a worker claimed ahead: leased in the store, not handed to the engine yet.

A claim takes up to ``IDEMPOTENT_LEASE_BATCH`` requests in one transaction (usually the
transaction of a page's completion), so ``next_request`` is served from here most of the
time. A claimed request is given back (in the same transaction as a new claim) when new
requests arrive that may go before it in Scrapy's order, dropped when its lease was found
lost, and released at close.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store.base import CommitResult, LeasedRequest, UnitOfWork

__all__ = ["ClaimedRequests"]


class ClaimedRequests:
    """The lease buffer of one worker, in claim order."""

    def __init__(self, batch: int) -> None:
        self.batch = batch  #: IDEMPOTENT_LEASE_BATCH
        self._claimed: deque[LeasedRequest] = deque()
        #: the store may hold claimable requests (False after a claim found none, until
        #: something may have changed that: new requests, a pending completion, a reclaim)
        self.maybe_claimable = True
        self._recheck_at = 0.0  #: ask the store again from then on, even without a change
        #: the leases held at the last renewal last until then (unix seconds)
        self.renewed_until = 0.0

    def __len__(self) -> int:
        return len(self._claimed)

    def __bool__(self) -> bool:
        return bool(self._claimed)

    def head(self) -> LeasedRequest:
        """The next request to hand out (there must be one)."""
        return self._claimed[0]

    def pop(self) -> LeasedRequest:
        return self._claimed.popleft()

    def head_expired(self, now: float) -> bool:
        """Whether the next request sat here past its lease (the process was stopped, or the
        reactor blocked): another worker may have it now."""
        return max(self._claimed[0].leased_until, self.renewed_until) <= now

    def claim_size(self, closing: bool) -> int:
        """How many requests to claim with the next transaction: none while closing, while
        the store is known to have none, or while at least half a batch is claimed ahead."""
        if closing or not self.maybe_claimable:
            return 0
        if len(self._claimed) >= max(1, self.batch // 2):
            return 0
        return self.batch - len(self._claimed)

    def prepare(self, work: UnitOfWork, closing: bool) -> None:
        """Set ``work``'s claim. New requests may come before the ones claimed ahead
        (Scrapy's order: a child is taken before older requests of its priority): then those
        are given back and claimed again in the same transaction."""
        if not work.claim:
            work.claim = self.claim_size(closing)
        if work.requests and self._claimed and not closing:
            work.give_back = [leased.key for leased in self._claimed]
            work.claim = max(work.claim, self.batch)

    def accept(self, work: UnitOfWork, result: CommitResult) -> None:
        """``work`` was committed: what it gave back is gone, what it claimed is here."""
        if work.give_back:
            self._claimed.clear()
        self._claimed.extend(result.leased)

    def may_refill(self, now: float, buffered_writes: bool) -> bool:
        """Whether a claim is worth a transaction now (after one found nothing, only once a
        second has passed or writes are buffered that may make requests claimable)."""
        if not self.maybe_claimable and now < self._recheck_at and not buffered_writes:
            return False
        self.maybe_claimable = True
        return True

    def found_none(self, now: float) -> None:
        """A claim returned nothing: do not ask again for a second unless something
        changes."""
        self.maybe_claimable = False
        self._recheck_at = now + 1.0

    def wake(self) -> None:
        """Another worker may have made requests claimable (the store said so): ask the
        store at the next chance, without waiting for the recheck."""
        self.maybe_claimable = True
        self._recheck_at = 0.0

    def keep_held(self, held: set[str]) -> int:
        """Drop the requests whose lease is not in ``held`` (found lost at a renewal; never
        handed out). Returns how many were dropped."""
        stale = sum(1 for leased in self._claimed if leased.key not in held)
        if stale:
            self._claimed = deque(leased for leased in self._claimed if leased.key in held)
            self.maybe_claimable = True
        return stale

    def clear(self) -> None:
        self._claimed.clear()
