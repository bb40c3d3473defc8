"""``RunCloseSpider``: Scrapy's ``CLOSESPIDER_*`` limits, with the counts for the run.

Scrapy's ``CloseSpider`` extension counts items, pages and errors from zero in every process:
a crawl capped at 40 items and killed three times stores up to four times 40. The add-on puts
:class:`RunCloseSpider` in its place (at its priority). It is Scrapy's extension, with three
of its limits counted over the whole run, every crawl and every worker of it
(:class:`~.run_totals.RunCount`: the store's run counters as of the last read, plus what this
process committed since):

* ``CLOSESPIDER_ITEMCOUNT``: items stored (records inserted, updated, unchanged or refused as
  stale: the items that went through every pipeline);
* ``CLOSESPIDER_PAGECOUNT``: requests completed (done, failed or redirected);
* ``CLOSESPIDER_ERRORCOUNT``: requests failed because their callback or errback raised
  (``spider_error/...``).

A page counts once its commit is durable, so a page a kill interrupted counts nothing (it is
fetched again and counted then). The check runs after every committed final state
(:data:`~.signals.request_done`); other workers' commits are read every
:data:`REFRESH_SECONDS`, every :data:`NEAR_REFRESH_SECONDS` near an item or page limit. The
spider closes with Scrapy's reason (``closespider_itemcount``, ...) once a count reaches its
limit; what is in flight then still completes. So that little is in flight then, the
scheduler hands out no page while the count plus the pages in flight reach an item or page
limit (:meth:`RunCloseSpider.room_for`). A run that reached a limit before is closed when the
crawl opens, before anything is fetched.

``CLOSESPIDER_TIMEOUT``, ``CLOSESPIDER_TIMEOUT_NO_ITEM`` and ``CLOSESPIDER_PAGECOUNT_NO_ITEM``
keep Scrapy's meaning: they count within this process, from its start.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.extensions.closespider import CloseSpider
from twisted.internet import task

from . import scrapy_compat
from . import signals as idempotent_signals
from ._scheduler_kind import is_idempotent_scheduler
from .crawl import current_run, read_after_writes
from .exceptions import IdempotentError
from .run_totals import LocalCounts, RunCount

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure

    from .store.reads import RunTotals

__all__ = ["NEAR", "NEAR_REFRESH_SECONDS", "REFRESH_SECONDS", "RUN_LIMITS", "RunCloseSpider"]

logger = logging.getLogger(__name__)

#: How often (seconds) the run's counters are read again while a limit is set: other
#: workers' commits count from their next read
REFRESH_SECONDS = 1.0
#: ... and this often (seconds) once the run is within :data:`NEAR` items or pages of an
#: item or page limit: other workers' last pages count sooner, where they decide the stop
NEAR_REFRESH_SECONDS = 0.1
NEAR = 64

#: (Scrapy's ``close_on`` key, the setting, the :class:`~.run_totals.LocalCounts` figure, the
#: close reason) of the limits counted for the run
RUN_LIMITS = (
    ("itemcount", "CLOSESPIDER_ITEMCOUNT", "items", "closespider_itemcount"),
    ("pagecount", "CLOSESPIDER_PAGECOUNT", "pages", "closespider_pagecount"),
    ("errorcount", "CLOSESPIDER_ERRORCOUNT", "spider_errors", "closespider_errorcount"),
)


class RunCloseSpider(CloseSpider):
    """Scrapy's ``CloseSpider`` with the item, page and error counts of the run (see the
    module docstring). With a scheduler other than :class:`~.IdempotentScheduler` it is
    Scrapy's own."""

    def __init__(self, crawler: Crawler) -> None:
        super().__init__(crawler)  # NotConfigured when no CLOSESPIDER_* is set
        close_on = getattr(self, "close_on", None)
        if not isinstance(close_on, dict):
            raise IdempotentError(
                "scrapy_idempotent.RunCloseSpider needs Scrapy's CloseSpider.close_on (Scrapy "
                "2.0 to 2.19 keep the limits there): this Scrapy has no such attribute")
        self.close_on: dict[str, Any] = close_on
        #: Scrapy's ``close_on`` key -> limit, for the limits counted for the run
        self.run_limits: dict[str, int] = {
            key: int(close_on[key]) for key, _, _, _ in RUN_LIMITS if close_on.get(key)}
        for key in self.run_limits:
            # Scrapy's own per-process check (``count == limit``) never matches 0
            close_on[key] = 0
        assert crawler.stats is not None
        self.count = RunCount(crawler.stats, spider_errors="errorcount" in self.run_limits)
        self._refresh_task: task.LoopingCall | None = None
        self._reading = False
        self._read_at = float("-inf")  #: time.monotonic() of the last refresh
        self._closing = False
        if self.run_limits:
            connect = crawler.signals.connect
            connect(self.open_run_limits, signal=signals.spider_opened)
            connect(self.run_request_done, signal=idempotent_signals.request_done)
            connect(self.close_run_limits, signal=signals.spider_closed)
            if "itemcount" in self.run_limits:
                connect(self.run_item_scraped, signal=signals.item_scraped)
            if "pagecount" in self.run_limits:
                connect(self.run_response_received, signal=signals.response_received)
            if "errorcount" in self.run_limits:
                connect(self.run_spider_error, signal=signals.spider_error)

    async def open_run_limits(self, spider: Spider) -> None:
        """Read the run's counters before the crawl starts: a run that reached a limit
        already closes now (``CloseSpider`` raised from ``spider_opened``: Scrapy closes the
        spider with its reason before anything is fetched)."""
        from scrapy.utils.defer import maybe_deferred_to_future

        scheduler = scrapy_compat.engine_scheduler(self.crawler)
        if not is_idempotent_scheduler(scheduler):
            self.close_on.update(self.run_limits)  # Scrapy's own counting, per process
            self.run_limits = {}
            return
        reading = self._read()
        if reading is None:
            return
        await maybe_deferred_to_future(reading)
        reached = self._reached()
        if reached is not None:
            self._closing = True
            assert self.count.base is not None
            logger.warning(
                "scrapy_idempotent: run %d reached its %s limit before this crawl: it closes "
                "without fetching anything; raise or remove the limit to go on with the run, "
                "or start a new one with -s IDEMPOTENT_RUN_MODE=fresh",
                self.count.base.run_id, reached.removeprefix("closespider_"),
                extra={"spider": self.crawler.spider})
            # (a CloseSpider raised from spider_opened closes it on Scrapy 2.14 and later
            # only)
            scheduler.close_before_fetching(reached)
            return
        scheduler.add_hand_out_gate(self.room_for)
        self._refresh_task = task.LoopingCall(self._refresh)
        self._refresh_task.start(NEAR_REFRESH_SECONDS, now=False)

    def room_for(self, in_flight: int) -> bool:
        """Whether one more page may be handed out: the run's items, pages and callback
        errors so far plus the ``in_flight`` pages (each counted as one more page, at most
        one more item and at most one more error) stay below their limits. Near a limit
        fewer pages are sent at once, so the run stops at it rather than at the limit plus
        everything in flight (a page of several items can still pass an item limit by its
        other items)."""
        if self.count.base is None:
            return True
        counts = self.count.now()
        for key, figure in (("itemcount", counts.items), ("pagecount", counts.pages),
                            ("errorcount", counts.spider_errors)):
            limit = self.run_limits.get(key)
            if limit and figure + in_flight >= limit:
                return False
        return True

    def run_item_scraped(self) -> None:
        self.count.saw(items=1)
        self._close_if_reached()

    def run_response_received(self) -> None:
        self.count.saw(pages=1)
        self._close_if_reached()

    def run_spider_error(self) -> None:
        self.count.saw(spider_errors=1)
        self._close_if_reached()

    def run_request_done(self, state: str) -> None:
        """A final state was committed (this process's counts grew): check the limits."""
        if state != idempotent_signals.ALREADY_DONE:
            self._close_if_reached()

    def close_run_limits(self, spider: Spider) -> None:
        if self._refresh_task is not None and self._refresh_task.running:
            self._refresh_task.stop()
        self._refresh_task = None

    def _refresh(self) -> None:
        if self._reading or self._closing:
            return
        now = time.monotonic()
        if now - self._read_at < REFRESH_SECONDS and not self._near():
            return
        self._read_at = now
        reading = self._read()
        if reading is not None:
            reading.addCallback(lambda _: self._close_if_reached())

    def _near(self) -> bool:
        """Whether the run is within :data:`NEAR` of its item or page limit."""
        if self.count.base is None:
            return False
        counts = self.count.now()
        return any(limit and limit - figure <= NEAR for limit, figure in (
            (self.run_limits.get("itemcount"), counts.items),
            (self.run_limits.get("pagecount"), counts.pages)))

    def _read(self) -> Deferred[None] | None:
        """Read the run's counters (after this process's writes); the Deferred fires once
        :attr:`count` holds them (an unreadable store is logged at DEBUG: the counts wait
        for the next read)."""
        run_id = current_run(self.crawler, type(self).__name__)
        if run_id is None:
            return None
        spider_errors = self.count.spider_errors

        def read(store: Any) -> RunTotals:
            totals: RunTotals = store.run_totals(run_id, spider_errors=spider_errors)
            return totals

        reading = read_after_writes(self.crawler, type(self).__name__, read)
        if reading is None:
            return None
        self._reading = True
        return reading.addCallbacks(self._read_done, self._read_failed)

    def _read_done(self, totals: RunTotals) -> None:
        self._reading = False
        self.count.read(totals)

    def _read_failed(self, failure: Failure) -> None:
        self._reading = False
        logger.debug("scrapy_idempotent: cannot read the run's counters: %s", failure.value)

    def _reached(self) -> str | None:
        """The close reason of the first limit the run's counts reached (logged), if any."""
        if self.count.base is None:
            return None
        counts: LocalCounts = self.count.now()
        for key, setting, figure, reason in RUN_LIMITS:
            limit = self.run_limits.get(key)
            value: int = getattr(counts, figure)
            if limit and value >= limit:
                logger.info("scrapy_idempotent: closing the spider: the run reached %s = %d "
                            "(%d %s in run %d, every crawl of it)", setting, limit, value,
                            figure.replace("_", " "), self.count.base.run_id,
                            extra={"spider": self.crawler.spider})
                return reason
        return None

    def _close_if_reached(self) -> None:
        if self._closing:
            return
        reason = self._reached()
        if reason is not None:
            self._closing = True
            scrapy_compat.close_spider(self.crawler, reason)
