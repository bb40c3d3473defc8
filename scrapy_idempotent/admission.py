"""The enqueue decision: whether a request enqueued by Scrapy enters the frontier, and how.

:class:`Admission` is the scheduler's ``enqueue_request`` without the contract around it.
A request the fingerprinter fails on is refused; a known request (rediscovered link, a start
request a restarted ``start()`` yields again) is answered from one read, without encoding it
or writing a transaction for it; a retry continues the frontier entry of the request it
retries; a request that cannot be stored is held in memory by the tracker (see
:mod:`.inflight`); every other one is encoded and buffered for the transaction of the request
it came from (the tracker's unit of work).

:class:`StartIntake` paces ``Spider.start()``. Scrapy's engine takes the next start request
as soon as the previous one is enqueued, without a turn of the reactor in between while the
downloader is full (``ExecutionEngine._start_request_processing``): a ``start()`` that never
awaits is then consumed to its end before anything else runs, no download, no write (the
writer's batches are sent from the reactor), every request buffered in memory. The spider
middleware asks the intake after each start request (:meth:`StartIntake.pause`): every
:data:`START_SLICE_SECONDS` the reactor gets a turn (downloads go on), and once
:data:`START_WINDOW` start requests wait to be written, the intake waits until the writer has
stored them (memory holds a window of the list, taken in at the writer's speed).

A restarted ``start()`` yields every start request again (Scrapy runs it from the top on every
crawl). The ``dont_filter`` ones, Scrapy's default for start requests, are checked against
the frontier in batches before they reach the engine (:meth:`StartIntake.hold`, one read per
:data:`START_CHECK_BATCH`): a known one (pending, leased or done) is counted as the commit
would count it and goes no further, without the engine's work for a request (its scheduling,
a turn of the reactor each, the scheduler's enqueue); only the new ones are handed on. So a
resume over a long start list that is mostly known downloads its pending requests at once and
reaches the new start requests at the speed of that read.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from . import scrapy_compat, signals
from .codec import describe
from .exceptions import StoreBusy, StoreError, UnstorableRequest
from .store.base import NewRequest

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred

    from ._dupes import DuplicateFilter
    from .codec import RequestCodec
    from .commits import CommitOutcomes
    from .inflight import InflightTracker
    from .inflight_entries import InflightRequest, RequestOrigin
    from .keys import RequestFingerprints, RequestKeys
    from .recent_requests import RecentRequests
    from .store.base import FrontierStore
    from .writer import WriterThread

__all__ = ["START_CHECK_BATCH", "START_SLICE_SECONDS", "START_WINDOW", "Admission",
           "KnownRequests", "StartIntake"]

logger = logging.getLogger(__name__)


class KnownRequests(Protocol):
    """The duplicate check of links the admission asks (the store's own methods of these
    names, see :meth:`~.FrontierStore.known_request`)."""

    def known_request(self, fingerprint: str, *, key: str | None = None) -> str | None: ...

    def expect_lookups(self, fingerprints: Collection[str]) -> None: ...

#: Start requests at most buffered for the writer: once as many wait, start() waits for them
#: to be written.
START_WINDOW = 2000
#: start() is taken in for at most this long (seconds) between two turns of the reactor.
START_SLICE_SECONDS = 0.02
#: ``dont_filter`` start requests checked against the frontier in one read.
START_CHECK_BATCH = 500
#: While the frontier holds this many pending requests, start() waits: the reactor's time
#: goes to downloads, not to taking in more of the list.
START_AHEAD = 1000
#: How often (seconds) a waiting start() looks at the frontier again.
START_AHEAD_POLL_SECONDS = 0.05


class StartIntake:
    """How fast ``start()`` is taken in (see the module docstring)."""

    def __init__(self, tracker: InflightTracker, writer: WriterThread,
                 admission: Admission | None = None, *,
                 hand_on: Callable[[Request], object] | None = None,
                 window: int = START_WINDOW, slice_seconds: float = START_SLICE_SECONDS,
                 check_batch: int = START_CHECK_BATCH, ahead: int = START_AHEAD,
                 busy: Callable[[], bool] | None = None) -> None:
        self.tracker = tracker
        self.writer = writer
        self.admission = admission
        #: ``ExecutionEngine.crawl``: where the unknown held start requests go
        self.hand_on = hand_on
        self.window = window
        self.slice_seconds = slice_seconds
        self.check_batch = check_batch
        #: start() waits while the frontier holds this many pending requests (0: never)
        self.ahead = ahead
        #: with the crawl's slot limits: whether this worker has requests enough in flight
        #: or claimed that downloads go on while start() waits (None: always so)
        self.busy = busy
        self._slice_began = time.monotonic()
        self._buffered_before = 0  #: the admission's count of buffered requests at a slice
        self._held: list[Request] = []  #: start requests waiting for their check
        #: start requests are held for a check (see :meth:`hold`): from :meth:`open` (the
        #: engine runs, the frontier knows requests) to :meth:`close`
        self._checking = False

    def hold(self, request: Request) -> bool:
        """Whether ``request`` (a start request, marked as such) is held for the check of
        its batch (see the module docstring) instead of going to the engine now: a
        ``dont_filter`` one (whose key its rank among the start requests makes), while the
        writer runs. The batch is checked once full or when the reactor's turn is due; its
        unknown requests then go to the engine (``ExecutionEngine.crawl``, as the engine
        does with a start request)."""
        if (not self._checking or self.admission is None or self.hand_on is None
                or not self.writer.running or not self.admission.unfiltered(request)):
            return False
        self._held.append(request)
        if len(self._held) >= self.check_batch or (
                time.monotonic() - self._slice_began >= self.slice_seconds):
            self.flush()
        return True

    def flush(self) -> None:
        """Check the held start requests; hand the unknown ones to the engine, in the
        order yielded. Before anything else reaches the scheduler (an item or another
        request of ``start()``, a request put into the scheduler directly), so that Scrapy's
        order holds."""
        if not self._held:
            return
        held, self._held = self._held, []
        assert self.admission is not None and self.hand_on is not None
        for request in self.admission.check_starts(held):
            self.hand_on(request)

    def open(self) -> None:
        """From now on start requests are held for their check (see :meth:`hold`)."""
        self._checking = True

    def close(self) -> None:
        """Nothing is held any more, and the held start requests are forgotten (the crawl
        closes: they are not taken in, as the rest of ``start()``; the next crawl's
        ``start()`` yields them again)."""
        self._checking = False
        self._held = []

    def pause(self) -> Deferred[None] | None:
        """After a start request was enqueued: None to take the next one at once, else a
        Deferred to wait for first (the next reactor turn, or the window's writes)."""
        if not self.writer.running:  # a scheduler driven by hand, or closing
            return None
        waiting: Deferred[None] | None = None
        if len(self.tracker.unattributed.requests) >= self.window:
            seq = self.writer.open_seq  # the batch that takes the buffered requests
            self.writer.commit()
            waiting = self.writer.durable(seq)
        if waiting is None and time.monotonic() - self._slice_began >= self.slice_seconds:
            from twisted.internet import reactor
            from twisted.internet.task import deferLater

            waiting = (self._until_needed() if self._adding() and self._enough_ahead()
                       else deferLater(reactor, 0, lambda: None))
        if waiting is not None:
            waiting.addBoth(self._resumed)
        return waiting

    def _until_needed(self) -> Deferred[None]:
        """A Deferred fired once the frontier holds fewer than :attr:`ahead` pending
        requests (looked at every :data:`START_AHEAD_POLL_SECONDS`)."""
        from twisted.internet import reactor
        from twisted.internet.task import deferLater

        waiting: Deferred[None] = deferLater(reactor, START_AHEAD_POLL_SECONDS, lambda: None)
        waiting.addCallback(lambda _: self._until_needed() if self._enough_ahead() else None)
        return waiting

    def _adding(self) -> bool:
        """Whether start() took requests into the frontier since the last slice."""
        if self.admission is None:
            return False
        before, self._buffered_before = self._buffered_before, self.admission.buffered
        return self.admission.buffered > before

    def _enough_ahead(self) -> bool:
        """Whether start() may wait a moment (while it adds requests to the frontier, not
        only finds known ones as a re-run start() does): the frontier holds
        :attr:`ahead` pending requests, work enough for the downloads meanwhile. Nothing is
        lost by waiting: what start() has not yielded yet is yielded again by the next
        crawl's start()."""
        if self.admission is None or not self.ahead or not self.writer.running:
            return False
        if self.busy is not None and not self.busy():
            # the pending requests may all be of slots that wait (a delay, a pause, a full
            # slot): start() goes on, its other sites' requests with it
            return False
        try:
            return self.admission.store.pending_at_least(self.ahead)
        except StoreError:  # (StoreBusy too: a connection being re-established)
            return False

    def _resumed(self, result: object) -> object:
        self._slice_began = time.monotonic()
        return result


def _retry_times(request: Request) -> int:
    """How many times ``request`` is a retry (RetryMiddleware's ``retry_times`` meta key)."""
    value = request.meta.get("retry_times", 0)
    return value if isinstance(value, int) else 0


def _link(parent: InflightRequest | None, key: str) -> None:
    """Note that ``parent``'s page linked the request of ``key`` (added or known), when its
    page's validators are kept (conditional requests: a later ``304`` stands for every link
    of the page, see :attr:`~.store.base.Completion.links`); nothing otherwise."""
    if parent is not None and parent.answered is not None:
        parent.links.append(key)


class Admission:
    """The enqueue decision of one worker (see the module docstring)."""

    def __init__(self, store: FrontierStore, *, tracker: InflightTracker,
                 fingerprints: RequestFingerprints, keys: RequestKeys, dupes: DuplicateFilter,
                 outcomes: CommitOutcomes, stats: StatsCollector, codec: RequestCodec,
                 slot_of: Callable[[Request], str] | None = None,
                 recent: RecentRequests | None = None,
                 before_enqueue: Callable[[], None] | None = None,
                 known: KnownRequests | None = None) -> None:
        self.store = store
        #: the duplicate check of links (``known_request``, ``expect_lookups``): the store's,
        #: or a fast layer in front of it (:class:`~.redis_dedup.RedisKnownRequests`)
        self.known: KnownRequests = known if known is not None else store
        self.buffered = 0  #: requests taken into the frontier (buffered for a write) so far
        #: a request's download slot, stored with it (see :mod:`.politeness`)
        self.slot_of = slot_of
        self.tracker = tracker
        self.fingerprints = fingerprints
        self.keys = keys
        self.dupes = dupes
        self.outcomes = outcomes
        self.stats = stats
        self._count = scrapy_compat.stat_counter(stats)  # (for every link)
        self.codec = codec
        #: the requests taken into the frontier last, for the hand-out
        self.recent = recent
        #: start requests checked by :meth:`check_starts` and handed on: their key
        self._checked: weakref.WeakKeyDictionary[Request, str] = weakref.WeakKeyDictionary()
        #: called before each enqueue decision (the start intake's flush of held requests)
        #: called before each request is taken in (the start intake's held requests go
        #: first, in Scrapy's order)
        self.before_enqueue = before_enqueue

    def expect(self, request: Request) -> None:
        """A callback yielded ``request``: it is enqueued soon, with the page's other links,
        whose lookups the store may then make in one read (see
        :meth:`~.FrontierStore.expect_lookups`)."""
        if self.dupes.enabled and not request.dont_filter:
            fingerprint = self.fingerprints(request)
            if fingerprint is not None and not self.tracker.is_buffered(fingerprint):
                self.known.expect_lookups((fingerprint,))

    def unfiltered(self, request: Request) -> bool:
        """Whether the duplicate filter leaves ``request`` alone (its key is derived)."""
        return not (self.dupes.enabled and not request.dont_filter)

    def check_starts(self, requests: Sequence[Request]) -> list[Request]:
        """Of ``requests`` (unfiltered start requests, in the order yielded), the unknown
        ones; the known ones are counted (and ``request_done`` sent for those already done)
        as :meth:`enqueue` would. One read for the batch."""
        keyed: list[tuple[Request, str]] = []
        unidentified: list[Request] = []
        for request in requests:
            fingerprint = self.fingerprints(request)
            if fingerprint is None:
                unidentified.append(request)  # refused by enqueue, which logs it
            else:
                keyed.append((request, fingerprint))
        keys = self.keys.root_keys([fingerprint for _, fingerprint in keyed], is_start=True)
        try:
            known = self.store.known_keys(keys)
        except StoreBusy as exc:
            # the commit decides (a known one is counted there and not added twice)
            self.stats.inc_value("idempotent/requests/unchecked", len(keys))
            logger.debug("scrapy_idempotent: start requests' check left to the commit (%s)",
                         exc)
            known = {}
        onward: list[Request] = []
        for (request, fingerprint), key in zip(keyed, keys, strict=True):
            answer = known.get(key)
            if answer is None:
                self._checked[request] = key
                onward.append(request)
                continue
            self.tracker.origin_of(request)  # (forgets it was marked a start request)
            self.stats.inc_value("idempotent/requests/enqueued")
            self.stats.inc_value(f"idempotent/requests/{answer}")
            if answer == signals.ALREADY_DONE:
                self.outcomes.already_done(request, key, fingerprint)
        if unidentified:  # (rare: in the order yielded, among the others)
            order = {id(request): n for n, request in enumerate(requests)}
            onward = sorted([*onward, *unidentified], key=lambda r: order[id(r)])
        return onward

    def enqueue(self, request: Request) -> bool:
        """Whether ``request`` is accepted (False: a duplicate, or unidentifiable)."""
        if self.before_enqueue is not None:
            self.before_enqueue()  # held start requests go first (Scrapy's order)
        self._count("idempotent/requests/enqueued")
        origin = self.tracker.origin_of(request)
        fingerprint = self.fingerprints(request)
        if fingerprint is None:
            self.tracker.refuse_unidentified(request, origin)
            return False
        filtered = self.dupes.enabled and not request.dont_filter
        retry_of = self._retry_of(request, origin, fingerprint)
        if filtered and retry_of is None and self._known_duplicate(request, fingerprint):
            _link(origin.parent, fingerprint)  # (its key: filtered, it is its fingerprint)
            return False
        key: str | None = self._checked.pop(request, None) if origin.is_start else None
        if key is not None:
            pass  # a start request checked with its batch: unknown then, the commit decides
        elif origin.parent is None and not origin.from_downloader and not filtered:
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
            return self.tracker.memory.hold(
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
        self._count(f"idempotent/requests/{known}")
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
            return self.known.known_request(fingerprint, key=key)
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
        self.buffered += 1
        if key is None:
            key = self._key(fingerprint, filtered, origin)
        if self.recent is not None:
            self.recent.keep(key, data, request)
        _link(parent, key)
        self.tracker.buffer_request(NewRequest(
            key=key,
            fingerprint=fingerprint,
            url=request.url,
            priority=request.priority,
            data=data,
            parent_key=parent.key if parent is not None else None,
            is_start=is_start,
            fifo=fifo,
            filter_fingerprint=filtered,
            slot=self.slot_of(request) if self.slot_of is not None else "",
        ), parent)
