"""Politeness for the whole crawl: Scrapy's per-slot limits kept where requests are claimed.

Scrapy keeps its politeness (``CONCURRENT_REQUESTS_PER_DOMAIN`` or ``_PER_IP``,
``DOWNLOAD_DELAY``, ``DOWNLOAD_SLOTS``) in each process's downloader: with several workers on
one crawl, a site would see every limit multiplied by the number of workers, and a restarted
worker would forget that a site asked it to slow down. With ``IDEMPOTENT_POLITENESS =
"crawl"`` (the default) the limits belong to the crawl:

* every request is stored with its download slot (Scrapy's slot key, from the downloader's
  ``get_slot_key``: the ``download_slot`` meta key, else the host name, or its IP with
  ``CONCURRENT_REQUESTS_PER_IP``);
* a claim takes requests only from slots that may send now: fewer leased requests (all
  workers together) than the slot's concurrency, its delay waited out since the slot's last
  claim (one request per claim then), not paused; the slots that waited longest first
  (see :meth:`~.SqlStore._claim_by_slot`). So nothing waits in one worker's downloader that
  another could send, and a paused or slow site does not fill the downloaders;
* the delay is the store's, so the worker's downloader does not add its own again (its slot
  delay is set to 0 as the request is handed out, unless AutoThrottle drives it);
* a 429 (or a 503 with ``Retry-After``) pauses the slot in the store for every worker,
  durable before the request is retried (:class:`~.SlotBackoffMiddleware`): for the site's
  ``Retry-After`` (seconds or an HTTP date), else ``IDEMPOTENT_BACKOFF_SECONDS`` doubled
  with every such answer in a row, up to ``IDEMPOTENT_BACKOFF_MAX_SECONDS``, with jitter.
  The request is retried without counting against ``RETRY_TIMES`` (up to
  :data:`~.slot_backoff.THROTTLED_RETRIES` times in a row; not with ``RETRY_ENABLED = False`` or
  ``dont_retry``, where the pause alone holds);
* a worker that dies before it has written a pause takes the answer with it: the
  transaction that takes a dead worker's leases back pauses every slot it held one of, as
  if it had answered 429 (:meth:`~.FrontierStore.reclaim_leases`;
  :func:`.leases.report_dead_worker_pauses` counts and logs them);
* with ``ROBOTSTXT_OBEY``, robots.txt's ``Crawl-delay`` for the crawl's user agent is the
  slot's delay when it is longer.

``IDEMPOTENT_POLITENESS = "worker"`` keeps Scrapy's own limits in each worker and claims the
frontier's head whatever its slots.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .scrapy_compat import downloader_slots, slot_key_of

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred

    from .config import IdempotentConfig
    from .engine_hooks import EngineWakeup
    from .leases import ClaimedRequests
    from .store.base import FrontierStore
    from .writer import WriterThread

__all__ = ["Politeness"]

logger = logging.getLogger(__name__)

#: A pause is lengthened by a random share of itself up to this (without Retry-After).
BACKOFF_JITTER = 0.25


class Politeness:
    """One worker's part in the crawl's politeness (see the module docstring): the slot of
    each request enqueued, the downloader's own delay out of the way, the pauses sites ask
    for, and a wake-up of the engine when a waiting slot may send."""

    def __init__(self, config: IdempotentConfig, *, stats: StatsCollector,
                 claimed: ClaimedRequests, wakeup: EngineWakeup, writer: WriterThread,
                 autothrottle: bool) -> None:
        self.crawl_wide = config.politeness == "crawl"
        self.limits = config.slot_limits if self.crawl_wide else None
        self.first_backoff_seconds = config.backoff_seconds
        self.max_backoff_seconds = config.backoff_max_seconds
        self.stats = stats
        self.claimed = claimed
        self.wakeup = wakeup
        self.writer = writer
        self.autothrottle = autothrottle
        self._downloader: Any = None
        self._wake_call: Any = None
        self._backing_off: set[str] = set()  #: slots this worker paused (backoff to reset)
        #: slot -> until when (``time.monotonic()``) this worker sends none of its requests:
        #: a site's pause binds here from the answer on, before it is written
        self._holds: dict[str, float] = {}
        self._crawl_delays: dict[str, float] = {}  #: robots.txt Crawl-delay kept, per slot

    def open(self, downloader: Any, store: FrontierStore) -> None:
        """At the spider's open, on the calling thread: claims keep the limits from now on
        (written into the store: the crawl's limits are those of the last worker started)."""
        self._downloader = downloader
        store.keep_slot_limits(self.limits)

    def close(self) -> None:
        if self._wake_call is not None and self._wake_call.active():
            self._wake_call.cancel()
        self._wake_call = None

    def slot_of(self, request: Request) -> str:
        """The download slot ``request`` is stored with ("" when limits are per worker)."""
        if not self.crawl_wide or self._downloader is None:
            return ""
        return slot_key_of(self._downloader, request)

    def handing_out(self, request: Request) -> None:
        """``request`` goes to the downloader: the crawl's claim kept the slot's delay, so
        the worker's downloader slot has none of its own (AutoThrottle's delay stays)."""
        if not self.crawl_wide or self.autothrottle or self._downloader is None:
            return
        slots = downloader_slots(self._downloader)
        if slots is None:
            # Scrapy's throttler keeps this worker's delay: it holds a request only until
            # the delay has passed since this worker's previous one of the slot, which the
            # crawl's claims have already waited out (their delay is the crawl's)
            return
        key = slot_key_of(self._downloader, request)
        slot = slots.get(key)
        if slot is None:
            from scrapy.core.downloader import Slot

            slots[key] = Slot(self._concurrency_of(key), 0.0, 0)
        elif slot.delay:
            slot.delay = 0.0

    def _concurrency_of(self, slot: str) -> int:
        limits = self.limits
        assert limits is not None
        for name, concurrency, _ in limits.per_slot:
            if name == slot and concurrency is not None:
                return concurrency
        return limits.concurrency

    def claim_again_in(self, seconds: float) -> None:
        """A claim left requests of slots that wait (a delay, a pause): ask the store again
        when the first of them may send."""
        from twisted.internet import reactor as installed  # the one Scrapy installed

        clock: Any = installed
        call = self._wake_call
        if call is not None and call.active():
            if call.getTime() <= clock.seconds() + seconds:
                return
            call.cancel()
        self.claimed.slots_wait_until(time.monotonic() + seconds)
        self._wake_call = clock.callLater(max(seconds, 0.0), self._slot_ready)

    def _slot_ready(self) -> None:
        self._wake_call = None
        self.claimed.wake()
        self.wakeup.now()

    # -- what sites say -------------------------------------------------------------------

    def holding(self, slot: str) -> bool:
        """Whether this worker holds back requests of ``slot``: its site paused it (a 429)
        and the pause is not over."""
        if not self._holds or not slot:
            return False
        until = self._holds.get(slot)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._holds[slot]
        return False

    def throttled(self, slot: str, retry_after: float | None) -> Deferred[float]:
        """A site answered ``slot``'s request with 429 (or 503): pause the slot for every
        worker; the Deferred fires with the seconds paused once the pause is durable. The
        pause binds this worker at once (:meth:`holding`): for the shortest it can be
        until it is written, then for the pause written."""
        self.stats.inc_value("idempotent/requests/throttled")
        self._holds[slot] = time.monotonic() + min(
            retry_after if retry_after is not None else self.first_backoff_seconds,
            self.max_backoff_seconds)
        self._backing_off.add(slot)
        first, most = self.first_backoff_seconds, self.max_backoff_seconds
        pausing = self.writer.call("pausing a download slot", lambda store: store.pause_slot(
            slot, retry_after=retry_after, first_seconds=first, max_seconds=most,
            jitter=BACKOFF_JITTER))
        pausing.addCallback(self._paused, slot)
        return pausing

    def _paused(self, seconds: float, slot: str) -> float:
        self._holds[slot] = max(self._holds.get(slot, 0.0), time.monotonic() + seconds)
        self.stats.inc_value("idempotent/slots/paused")
        logger.info("scrapy_idempotent: download slot %s paused for %.1f s for every worker "
                    "(the site answered 429 or 503)", slot, seconds)
        return seconds

    def answered(self, slot: str) -> None:
        """``slot`` answered normally: a slot this worker backed off starts from the first
        pause again at its next 429 or 503."""
        if slot in self._backing_off:
            self._backing_off.discard(slot)
            self.writer.call("ending a download slot's backoff",
                             lambda store: store.slot_answered(slot))

    def crawl_delay(self, slot: str, delay: float) -> None:
        """robots.txt asks for ``delay`` seconds between requests to ``slot``'s site."""
        if self._crawl_delays.get(slot) == delay:
            return
        self._crawl_delays[slot] = delay
        self.stats.inc_value("idempotent/slots/crawl_delay")
        self.writer.call("keeping a download slot's crawl delay",
                         lambda store: store.set_slot_delay(slot, delay))

