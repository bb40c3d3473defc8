"""``MemoryRequests``: the requests that cannot be stored (a lambda callback, a Request in
meta), fetched from memory under the lease of the stored request that yielded them (their
owner; see :mod:`.inflight`).

They wait here in Scrapy's order until the hand-out takes them; the owner is complete only
once its own request and every memory request under its lease are finished, so a kill
before that fetches the owner again, which yields them again. Nothing lives only in memory
past its owner's lease: a lost lease drops the memory requests under it.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._order import QueueOrder, queue_position
from .codec import describe
from .inflight_entries import InflightRequest
from .store.base import RequestState, UnitOfWork

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.statscollectors import StatsCollector

    from .exceptions import UnstorableRequest
    from .inflight_entries import RequestOrigin
    from .store.base import LeasedRequest

__all__ = ["MemoryRequests"]

logger = logging.getLogger("scrapy_idempotent.inflight")  # (the tracker's part)

#: a memory request waiting to be handed out: (*queue_position, sequence, entry)
_Waiting = tuple[int, int, int, int, InflightRequest]


class MemoryRequests:
    """The memory requests of one worker (see the module docstring): those waiting to be
    handed out, in Scrapy's order, and the owners that wait for theirs."""

    def __init__(self, stats: StatsCollector, order: QueueOrder) -> None:
        self.stats = stats
        self.order = order
        self._queue: list[_Waiting] = []
        self._sequence = 0
        #: fingerprint of a filtered memory request -> the entry it lives under (None: of
        #: start(), for the whole crawl); forgotten when that entry is lost, or completed
        #: other than done (a later lease of it yields the request again)
        self._seen: dict[str, InflightRequest | None] = {}
        self._unstorable_causes: set[str] = set()  # logged
        #: id(entry) -> entry whose own request is finished, waiting for its memory requests
        self._waiting: dict[int, InflightRequest] = {}

    def __len__(self) -> int:
        """Memory requests waiting to be handed out."""
        return len(self._queue)

    def seen(self, fingerprint: str) -> bool:
        """Whether a filtered memory request of ``fingerprint`` lives under a lease held (a
        duplicate of it is refused)."""
        return fingerprint in self._seen

    def hold(self, request: Request, exc: UnstorableRequest, *, key: str, fingerprint: str,
             origin: RequestOrigin, filtered: bool, continues: bool) -> bool:
        """Keep a request that cannot be stored, to be fetched under the lease of the stored
        entry it came from (its owner). A memory request of ``start()`` (or of no request)
        has no owner: ``start()`` yields it again on every crawl. Counted, and logged once
        per cause. Refused (False) when its owner's lease is lost: nothing more is fetched
        under it."""
        parent = origin.parent
        owner = parent.owner if parent is not None and parent.memory else parent
        if owner is not None and owner.lost:
            self.stats.inc_value("idempotent/requests/lease_lost_dropped")
            return False
        self._count_unstorable(exc)
        entry = InflightRequest(key=key, fingerprint=fingerprint, priority=request.priority,
                                attempts=1, request=request, memory=True, owner=owner,
                                continues_owner=continues and parent is not None and (
                                    parent is owner or parent.continues_owner))
        if continues and parent is not None:
            # the retry or redirect supersedes what its request's attempt observed
            parent.failure = parent.spider_error = None
            parent.http_error = False
        if owner is not None:
            owner.waiting += 1
        if filtered:
            self._seen[fingerprint] = owner
            if owner is not None:
                owner.memory_seen.add(fingerprint)
        is_start, fifo = self.order.place(request)
        self._sequence += 1
        heapq.heappush(self._queue, (
            *queue_position(request.priority, is_start, fifo, self._sequence),
            self._sequence, entry))
        return True

    def _count_unstorable(self, exc: UnstorableRequest) -> None:
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

    def goes_before(self, head: LeasedRequest) -> bool:
        """Whether the next memory request goes before ``head``, the next request claimed
        ahead: the claim's rule (:func:`~._order.queue_position`: priority, then other
        requests before start ones), and at an equal place the newer first for a LIFO
        queue, the older for a FIFO one (a memory request is newer than what was claimed
        before it was yielded). Before a suspect, memory requests go first: they hold
        leases already taken."""
        if head.suspect:
            return True
        neg_priority, start_queue, order, *_ = self._queue[0]
        mine = (neg_priority, start_queue)
        theirs = queue_position(head.priority, head.is_start, True, 0)[:2]
        if mine != theirs:
            return mine < theirs
        return order < 0  # LIFO: the memory request is the newer

    def pop(self) -> InflightRequest:
        """The next memory request (there must be one), handed out."""
        *_, entry = heapq.heappop(self._queue)
        self.stats.inc_value("idempotent/requests/from_memory")
        return entry

    def wait_for(self, owner: InflightRequest) -> None:
        """``owner``'s own request is finished; it is done once its memory requests are."""
        self._waiting[id(owner)] = owner

    def waiting(self) -> Iterable[InflightRequest]:
        """The owners waiting for their memory requests (their leases are held)."""
        return self._waiting.values()

    def finished(self, entry: InflightRequest) -> tuple[UnitOfWork | None,
                                                        InflightRequest | None]:
        """A memory request is finished: what it produced goes to its owner's transaction
        (or, without an owner, is to be written now: the unit of work returned); its failure
        fails its owner. Returns that unit of work, and the owner when it is now done (its
        own request and its memory requests finished)."""
        owner = entry.owner
        if owner is not None and owner.lost:
            # its lease is gone: nothing it produced can be written under it
            owner.waiting -= 1
            return None, self._settled(owner)
        key = owner.key if owner is not None else None
        children = [dataclasses.replace(c, parent_key=key) for c in entry.children]
        records = [(record, key) for record, _ in entry.records]
        rejects = [dataclasses.replace(r, request_key=key) for r in entry.rejects]
        if owner is None:
            return UnitOfWork(requests=children, records=records, rejects=rejects,
                              state_changes=[(c, None) for c in entry.state_changes]), None
        owner.children.extend(children)
        owner.records.extend(records)
        owner.rejects.extend(rejects)
        owner.state_changes.extend(entry.state_changes)
        self._pass_outcome(entry, owner)
        owner.waiting -= 1
        return None, self._settled(owner)

    @staticmethod
    def _pass_outcome(entry: InflightRequest, owner: InflightRequest) -> None:
        """A memory request's interruption or failure is its owner's."""
        completion = entry.completion()
        if entry.interrupted:
            owner.interrupted = True
        elif completion.state is RequestState.FAILED and owner.failure is None:
            kind = completion.error_kind or "failed"
            owner.failure = (
                kind if entry.continues_owner else f"unstorable_child/{kind}",
                f"{describe(entry.request)} (fetched from memory: it cannot be stored): "
                f"{completion.error_message or kind}"[:1000])

    def _settled(self, owner: InflightRequest) -> InflightRequest | None:
        """``owner`` when its own request and its memory requests are finished (it waits
        no more), else None."""
        if owner.waiting == 0 and owner.own_finished:
            del self._waiting[id(owner)]
            return owner
        return None

    def forget_seen(self, entry: InflightRequest) -> None:
        """``entry``'s lease is lost, or it completed other than done: the filtered memory
        requests under it are forgotten (a later lease of it yields them again)."""
        for fingerprint in entry.memory_seen:
            if self._seen.get(fingerprint) is entry:
                del self._seen[fingerprint]
        entry.memory_seen.clear()

    def drop_of_lost(self) -> list[InflightRequest]:
        """Drop the memory requests not handed out yet whose owner's lease is lost; returns
        the owners now done (nothing of theirs is written)."""
        kept = [m for m in self._queue if m[-1].owner is None or not m[-1].owner.lost]
        dropped = len(self._queue) - len(kept)
        if not dropped:
            return []
        owners = []
        for *_, memory in self._queue:
            if memory.owner is not None and memory.owner.lost:
                memory.owner.waiting -= 1
                owners.append(memory.owner)
        heapq.heapify(kept)
        self._queue = kept
        self.stats.inc_value("idempotent/requests/lease_lost_dropped", dropped)
        settled = (self._settled(owner) for owner in {id(o): o for o in owners}.values())
        return [owner for owner in settled if owner is not None]
