"""``RecordIdMiddleware``: the spider middleware that ties output to the request it came from.

It must be the last spider middleware to see the output (a priority number below
``StartSpiderMiddleware``'s 25; the add-on uses 10), so the items and requests it sees are the
final ones. For every item it computes the record ID from the item's data (see
:mod:`scrapy_idempotent.records`) and stamps it into the item's ``IDEMPOTENT_RECORD_ID_FIELD``
when the item type has room for it; for every item and child request it notes which leased
request produced it, so their writes commit with that request's completion.

The attribution itself is the crawl's in-flight tracker's (:mod:`.inflight`), found with
:func:`~.crawl.inflight_tracker` once the spider is open. Errback output bypasses spider
middlewares (``scrapy/core/scraper.py``); the engine hooks attribute it through the same
tracker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from scrapy import Request, signals
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.misc import load_object

from . import scrapy_compat
from ._dupes import DuplicateFilter
from ._scheduler_kind import is_idempotent_scheduler
from .config import config_for
from .crawl import inflight_tracker, start_intake
from .exceptions import ConfigError

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .inflight import InflightTracker

__all__ = ["RecordIdMiddleware"]


class RecordIdMiddleware:
    """Spider middleware: record IDs on items, and output attributed to its request."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self._tracker: InflightTracker | None = None
        crawler.signals.connect(self._spider_opened, signals.spider_opened)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        # Spider middlewares are built with the engine, before the spider opens: checking the
        # settings here stops a misconfigured crawl before anything starts (the scheduler
        # reads them again when it is built, at spider open).
        with scrapy_compat.start_failure_exits_nonzero(crawler):
            if crawler.spider is not None:
                config_for(crawler)
            DuplicateFilter.check(crawler.settings)  # DUPEFILTER_CLASS
            scheduler = crawler.settings["SCHEDULER"]
            scheduler_cls = load_object(scheduler) if isinstance(scheduler, str) else scheduler
            if not (isinstance(scheduler_cls, type) and is_idempotent_scheduler(scheduler_cls)):
                raise ConfigError(
                    "SCHEDULER", scheduler,
                    "scrapy_idempotent.IdempotentScheduler (or a subclass): the "
                    "RecordIdMiddleware works with it; a project or command-line SCHEDULER "
                    "overrides the add-on's",
                )
        return cls(crawler)

    def _spider_opened(self) -> None:
        self.tracker  # noqa: B018 - fail at start when wired without the scheduler

    @property
    def tracker(self) -> InflightTracker | None:
        """The crawl's in-flight tracker; None outside a crawl (see :mod:`.crawl`)."""
        if self._tracker is None:
            self._tracker = inflight_tracker(self.crawler, type(self).__name__)
        return self._tracker

    async def process_start(self, start: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Start requests are marked so ``dont_filter`` ones get stable keys, checked against
        the frontier in batches (the known ones of a restarted ``start()`` go no further) and
        taken in at the pace of the crawl's :class:`~.StartIntake`; start items get their
        record IDs."""
        intake = start_intake(self.crawler, type(self).__name__)
        try:
            async for output in start:
                tracker = self.tracker
                held = False
                if tracker is not None:
                    if isinstance(output, Request):
                        tracker.mark_start(output)
                        # (the intake hands a held request to the engine if it is unknown)
                        held = intake is not None and intake.hold(output)
                    else:
                        tracker.track(output, None, None)
                    tracker.state_boundary(None)
                if not held:
                    if intake is not None:
                        intake.flush()  # (held start requests first: the order yielded)
                    yield output  # (the engine has enqueued it when the next one is asked)
                waiting = intake.pause() if intake is not None else None
                if waiting is not None:
                    await maybe_deferred_to_future(waiting)
        finally:
            if intake is not None:
                intake.flush()  # what start() yielded before it ended or raised

    # ``spider``: Scrapy 2.13 passes it; later releases do not (see :mod:`.scrapy_compat`).
    async def process_spider_output(
        self, response: Response, result: AsyncIterator[Any], spider: Spider | None = None
    ) -> AsyncIterator[Any]:
        tracker = self.tracker
        if tracker is None:
            async for output in result:
                yield output
            return
        entry = tracker.for_response(response)
        tracker.state_boundary(entry)  # what the callback did before it returned
        try:
            async for output in result:
                tracker.state_boundary(entry)  # what its step until this output did
                tracker.track(output, entry, response.url)
                yield output
        finally:
            tracker.state_boundary(entry)

    def process_spider_input(self, response: Response, spider: Spider | None = None) -> None:
        """Before the callback runs (this middleware's input hook runs first): what the
        spider's state changed since the last step was no callback's."""
        tracker = self.tracker
        if tracker is not None:
            tracker.state_boundary(None)
