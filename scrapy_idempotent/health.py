"""``CrawlHealth``: whether the crawl's writes may go on (closing, or failed: the spider is
closed with reason :data:`STORE_ERROR_REASON`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import engine_hooks

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector

__all__ = ["STORE_ERROR_REASON", "CrawlHealth"]

logger = logging.getLogger(__name__)

#: Reason the spider closes with when the store keeps failing.
STORE_ERROR_REASON = "idempotent_store_error"


class CrawlHealth:
    """Whether the crawl's writes may go on: not once the scheduler is ``closing``, nor once
    the store kept failing (``failed``: :meth:`fail` closes the spider, once)."""

    def __init__(self, crawler: Crawler, stats: StatsCollector) -> None:
        self._crawler = crawler
        self._stats = stats
        self.closing = False
        self.failed = False
        self._refused = False  #: the store was refused at open; the spider not closed yet

    @property
    def stopped(self) -> bool:
        return self.failed or self.closing

    def fail(self, reason: str) -> None:
        """Close the spider with :data:`STORE_ERROR_REASON` (``reason`` goes to the log and to
        the ``idempotent/error`` stat)."""
        if self.failed:
            return
        self.failed = True
        self._stats.set_value("idempotent/error", reason)
        logger.error("scrapy_idempotent: closing the spider: %s", reason)
        engine_hooks.close_spider_failed(self._crawler, STORE_ERROR_REASON)

    def fail_at_open(self, reason: str) -> None:
        """:meth:`fail` for a store refused while the spider opens: from now on nothing is
        taken or handed out, and the spider is closed with :data:`STORE_ERROR_REASON` when
        the running engine first asks for a request (:meth:`close_if_refused`): closing it
        while the engine still opens it would leave Scrapy's scraper and stats half open
        (four tracebacks, reason ``shutdown``)."""
        if self.failed:
            return
        self.failed = True
        self._refused = True
        self._stats.set_value("idempotent/error", reason)
        logger.error("scrapy_idempotent: closing the spider: %s", reason)

    def close_if_refused(self) -> None:
        """Close the spider (once) after :meth:`fail_at_open`; nothing otherwise."""
        if self._refused:
            self._refused = False
            engine_hooks.close_spider_failed(self._crawler, STORE_ERROR_REASON)
