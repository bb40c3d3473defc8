"""``OutboxDelivery``: the Scrapy extension that runs the outbox's :class:`~.Deliverer`
while the crawl runs and drains it at close."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.exceptions import NotConfigured

from ._serial_thread import SerialThread
from .config import config_for
from .crawl import store_refused
from .exceptions import StoreError
from .outbox import POLL_SECONDS, Deliverer, build_targets, open_outbox_store
from .store.base import CrawlIdentity, OutboxState

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from .config import IdempotentConfig
    from .store.base import OutboxOutcome

__all__ = ["OutboxDelivery"]

logger = logging.getLogger("scrapy_idempotent.outbox")  # the outbox speaks as one


class OutboxDelivery:
    """Extension: delivers the outbox while the crawl runs and drains it at close.

    Enabled by the add-on; raises ``NotConfigured`` (off) when ``IDEMPOTENT_OUTBOX_TARGETS``
    is empty. Starts when the spider opens (the scheduler has opened the database); at
    ``spider_closed`` (after the scheduler's last commit) it delivers what is due for at most
    ``IDEMPOTENT_OUTBOX_DRAIN_SECONDS``, then stops; what is left is delivered by the next
    crawl or ``scrapy idempotent deliver``.
    """

    def __init__(self, crawler: Crawler, config: IdempotentConfig) -> None:
        self.crawler = crawler
        self.config = config
        self.targets = build_targets(config, crawler)
        self.deliverer: Deliverer | None = None
        self._loop: Any = None
        self._thread: SerialThread | None = None
        crawler.signals.connect(self.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(self.spider_closed, signal=signals.spider_closed)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        config = config_for(crawler)
        if not config.outbox_targets:
            raise NotConfigured("IDEMPOTENT_OUTBOX_TARGETS is empty")
        return cls(crawler, config)

    async def spider_opened(self) -> None:
        from scrapy.utils.defer import maybe_deferred_to_future
        from twisted.internet import task

        assert self.crawler.spider is not None
        if store_refused(self.crawler):
            return  # the same database, refused: the scheduler said why, once
        identity = CrawlIdentity(project=str(self.crawler.settings.get("BOT_NAME") or ""),
                                 spider=self.crawler.spider.name, source=self.config.source)
        # every store call of the deliverer runs there, one after the other (a SQLite
        # connection stays on the thread that opened it), so the reactor never waits on the
        # database (a write lock held by the crawl's writer)
        thread = self._thread = SerialThread("scrapy_idempotent-outbox")
        try:
            store = await maybe_deferred_to_future(
                thread(lambda: open_outbox_store(self.config, identity)))
        except StoreError as exc:
            logger.error("scrapy_idempotent: outbox delivery is off for this crawl: %s "
                         "(`scrapy idempotent deliver` sends what is pending)", exc)
            thread.shutdown()
            return
        self.deliverer = Deliverer(
            store, self.targets, concurrency=self.config.outbox_concurrency,
            timeout_seconds=self.config.outbox_timeout_seconds,
            retry_seconds=self.config.outbox_retry_seconds,
            retry_max_seconds=self.config.outbox_retry_max_seconds,
            on_outcome=self._count, run_store=thread)
        self._loop = task.LoopingCall(self.deliverer.pump)
        self._loop.start(POLL_SECONDS, now=True)

    def _count(self, outcome: OutboxOutcome) -> None:
        stats = self.crawler.stats
        if stats is None:
            return
        name = {OutboxState.DELIVERED: "delivered", OutboxState.FAILED: "failed",
                OutboxState.PENDING: "retried"}[outcome.state]
        stats.inc_value(f"idempotent/outbox/{name}")

    async def spider_closed(self) -> None:
        deliverer = self.deliverer
        if deliverer is None:
            return
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        try:
            left = await deliverer.drain(self.config.outbox_drain_seconds)
            if self.crawler.stats is not None:
                self.crawler.stats.set_value("idempotent/outbox/pending", left)
            if left:
                logger.warning(
                    "scrapy_idempotent: outbox: %d announcement(s) not delivered yet "
                    "(IDEMPOTENT_OUTBOX_DRAIN_SECONDS=%g); the next crawl or `scrapy "
                    "idempotent deliver` sends them", left, self.config.outbox_drain_seconds)
        finally:
            from scrapy.utils.defer import maybe_deferred_to_future

            await deliverer.close()
            await maybe_deferred_to_future(deliverer.run_store(deliverer.store.close))
            if self._thread is not None:
                self._thread.shutdown()

