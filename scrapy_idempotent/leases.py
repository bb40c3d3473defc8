"""The requests a worker claimed ahead: leased in the store, not handed to the engine yet.

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

from collections import deque
from typing import TYPE_CHECKING

from .store.base import RequestState

if TYPE_CHECKING:
    from .store.base import CommitResult, LeasedRequest, NewRequest, UnitOfWork

__all__ = ["ClaimedRequests", "QueueRank", "queue_rank", "queue_rank_of_new"]

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

    def __init__(self, batch: int) -> None:
        self.batch = batch  #: IDEMPOTENT_LEASE_BATCH
        self._claimed: deque[LeasedRequest] = deque()  #: in Scrapy's order
        #: claimed requests to give back with the next transaction (never handed out)
        self._give_back: list[str] = []
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
            claim = max(claim, min(added, self.batch))
        work.claim = claim

    def accept(self, work: UnitOfWork, result: CommitResult) -> None:
        """``work`` was committed: what it claimed joins the requests here, in order. When
        it added more requests than it claimed and its claim was full, a pending request may
        still go before some here: those are given back (with the next transaction)."""
        leased = result.leased
        if not leased:
            return
        merged = sorted([*self._claimed, *leased], key=queue_rank)
        added = len(work.requests) + sum(
            1 for c in work.completions if c.state is RequestState.PENDING)
        if self._claimed and added > work.claim and len(leased) >= work.claim:
            last = max(queue_rank(r) for r in leased)
            keep = [r for r in merged if queue_rank(r) <= last]
            self._give_back.extend(r.key for r in merged if queue_rank(r) > last)
            merged = keep
        self._claimed = deque(merged)

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
        self._give_back.clear()

    @property
    def has_give_back(self) -> bool:
        """Whether claimed requests wait to be given back with the next transaction."""
        return bool(self._give_back)
