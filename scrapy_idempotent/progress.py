"""``IdempotentLogStats``: a progress line in the crawl log, like Scrapy's ``LogStats``.

Every ``IDEMPOTENT_LOG_INTERVAL_SECONDS`` (default 60; 0 disables it) one INFO line::

    Frontier: 310 pending, 16 leased, 190 done, 3 failed; records this crawl: 172 inserted,
    0 updated, 0 unchanged (172 stored); run: 193 pages, 172 items; 1140 pages/min,
    1032 records/min

The frontier counts are the whole frontier's (every worker), read with the store's
``counts()`` (its partial indexes of the states); done includes redirected entries. Where a
count is slow (a frontier of millions of requests), the workers share it
(:meth:`~.FrontierStore.shared_counts`): a line counts again only when the count another
worker kept is older than half the interval, and a line showing it says how old it is
(``Frontier, counted 12 s ago: ...``); a worker whose own count took a second or more
counts again only once twenty times as long has passed. Records and rates
are this crawl's, from the ``idempotent/...`` stats: pages are requests completed (done,
failed or redirected), records are items upserted (inserted, updated or unchanged), both per
minute over the last interval. The run's pages and items are every crawl's and worker's of
the run, as committed (:meth:`~.FrontierStore.run_totals`: what the run-wide
``CLOSESPIDER_*`` limits count). The add-on enables it; with manual wiring add
``EXTENSIONS = {"scrapy_idempotent.progress.IdempotentLogStats": 0}``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from scrapy import signals
from scrapy.exceptions import NotConfigured
from twisted.internet import task

from . import scrapy_compat
from ._scheduler_kind import is_idempotent_scheduler
from .config import log_interval_seconds
from .crawl import current_run, frontier_store, read_after_writes

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred
    from twisted.python.failure import Failure
    from typing_extensions import Self

    from .store.base import FrontierStore
    from .store.reads import RunTotals

__all__ = ["IdempotentLogStats"]

logger = logging.getLogger(__name__)

#: A count of the frontier that took this worker at least this long (seconds) is made again
#: only once :data:`COUNT_SHARE` times as long has passed; the lines in between show it with
#: its age. The count runs on the writer's thread, whose commits wait meanwhile: at most a
#: twentieth of the worker's time goes to it (a lone worker on a frontier of millions).
SLOW_COUNT_SECONDS = 1.0
COUNT_SHARE = 20

_PAGE_STATS = ("idempotent/requests/done", "idempotent/requests/failed",
               "idempotent/requests/redirected")
_RECORD_STATS = ("idempotent/records/inserted", "idempotent/records/updated",
                 "idempotent/records/unchanged")


class IdempotentLogStats:
    """Logs the progress line every ``interval_seconds`` while the spider runs.

    Does nothing when the crawl's scheduler is not :class:`~.IdempotentScheduler`. Never
    raises into the crawl: a frontier that cannot be read skips one line (logged at DEBUG).
    """

    def __init__(self, crawler: Crawler, interval_seconds: float) -> None:
        self.crawler = crawler
        self.interval_seconds = interval_seconds
        self.store: FrontierStore | None = None
        self.task: task.LoopingCall | None = None
        self._previous = (0.0, 0, 0)  # (monotonic time, pages, records) at the last line
        #: this worker's last slow count: (its counts, when it started, how long it took);
        #: read and written on the writer's thread only
        self._slow_count: tuple[dict[str, int], float, float] | None = None
        self._clock = time.monotonic

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        """Raises :class:`~scrapy.exceptions.NotConfigured` when the interval is 0, and
        :class:`~.ConfigError` when it is not a number >= 0."""
        with scrapy_compat.start_failure_exits_nonzero(crawler):
            interval = log_interval_seconds(crawler.settings)
        if not interval:
            raise NotConfigured("IDEMPOTENT_LOG_INTERVAL_SECONDS is 0")
        extension = cls(crawler, interval)
        crawler.signals.connect(extension.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(extension.spider_closed, signal=signals.spider_closed)
        return extension

    def spider_opened(self, spider: Spider) -> None:
        scheduler = scrapy_compat.engine_scheduler(self.crawler)
        if not is_idempotent_scheduler(scheduler):
            logger.debug("scrapy_idempotent: no progress line, the scheduler is %r", scheduler)
            return
        self.store = frontier_store(self.crawler, type(self).__name__)
        self._previous = (time.monotonic(), *self._totals())
        self.task = task.LoopingCall(self.log)
        self.task.start(self.interval_seconds, now=False)

    def spider_closed(self, spider: Spider, reason: str) -> None:
        if self.task is not None and self.task.running:
            self.task.stop()
        self.task = None
        self.store = None

    def _totals(self) -> tuple[int, int]:
        stats = self.crawler.stats
        assert stats is not None
        return (sum(stats.get_value(name, 0) for name in _PAGE_STATS),
                sum(stats.get_value(name, 0) for name in _RECORD_STATS))

    def log(self) -> Deferred[None] | None:
        """Log one progress line. The frontier is counted on the writer's thread after the
        writes submitted before (:func:`~.crawl.read_after_writes`) and the line logged once
        their results are in the stats: on a fresh database ``N inserted (N stored)``, never
        more stored than inserted by commits whose results were on their way."""
        if self.store is None:
            return None
        run_id = current_run(self.crawler, type(self).__name__)
        if run_id is None:
            return None

        def read(store: FrontierStore) -> tuple[tuple[dict[str, int], float], RunTotals]:
            return self._count(store), store.run_totals(run_id)

        counting = read_after_writes(self.crawler, type(self).__name__, read)
        if counting is None:
            return None
        return counting.addCallbacks(self._log_counts, self._no_line)

    def _count(self, store: FrontierStore) -> tuple[dict[str, int], float]:
        """The frontier's counts for a line and their age (on the writer's thread): this
        worker's last slow count while :data:`COUNT_SHARE` times its time has not passed,
        else the store's (a count another worker kept, or one now)."""
        now = self._clock()
        if self._slow_count is not None:
            counts, started, took = self._slow_count
            if now - started < COUNT_SHARE * took:
                return counts, now - started
        counts, age = store.shared_counts(self.interval_seconds / 2)
        took = self._clock() - now
        self._slow_count = (counts, now, took) if not age and took >= SLOW_COUNT_SECONDS else None
        return counts, age

    def _no_line(self, failure: Failure) -> None:
        logger.debug("scrapy_idempotent: no progress line: cannot read the frontier: %s",
                     failure.value)

    def _log_counts(self, read: tuple[tuple[dict[str, int], float], RunTotals]) -> None:
        (counts, age), run = read
        if self.store is None:  # the spider closed meanwhile
            return
        stats = self.crawler.stats
        assert stats is not None
        now = time.monotonic()
        pages, records = self._totals()
        then, pages_before, records_before = self._previous
        minutes = max(now - then, 1e-6) / 60
        self._previous = (now, pages, records)
        logger.info(
            "Frontier%s: %d pending, %d leased, %d done, %d failed; records this crawl: "
            "%d inserted, %d updated, %d unchanged (%d stored); run: %d pages, %d items; "
            "%d pages/min, %d records/min",
            f", counted {age:.0f} s ago" if age else "",
            counts["pending"], counts["leased"], counts["done"] + counts["redirected"],
            counts["failed"], stats.get_value("idempotent/records/inserted", 0),
            stats.get_value("idempotent/records/updated", 0),
            stats.get_value("idempotent/records/unchanged", 0), counts["records"],
            run.pages, run.items,
            round((pages - pages_before) / minutes), round((records - records_before) / minutes),
            extra={"spider": self.crawler.spider},
        )
