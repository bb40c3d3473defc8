"""``RecordIdMiddleware``: the spider middleware that ties output to the request it came from.

It must be the last spider middleware to see the output (a priority number below
``StartSpiderMiddleware``'s 25; the add-on uses 10), so the items and requests it sees are the
final ones. For every item it computes the record ID from the item's data (see
:mod:`scrapy_idempotent.records`) and stamps it into the item's ``IDEMPOTENT_RECORD_ID_FIELD``
when the item type has room for it; for every item and child request it notes which leased
request produced it, so their writes commit with that request's completion.

Errback output bypasses spider middlewares (``scrapy/core/scraper.py``); the scheduler
attributes it through the same code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

from scrapy import Request, signals
from scrapy.utils.misc import load_object

from . import engine_hooks
from ._dupes import DuplicateFilter
from .config import config_for
from .exceptions import ConfigError, IdempotentError

if TYPE_CHECKING:
    from scrapy import Spider
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .scheduler import IdempotentScheduler

__all__ = ["RecordIdMiddleware"]


def _scheduler_of(crawler: Crawler, component: str) -> IdempotentScheduler | None:
    """The crawl's :class:`~.IdempotentScheduler`, or None when the crawler has no engine:
    the component is used outside a crawl (Scrapy's own tests drive middleware managers on a
    bare crawler), where there is nothing to attribute or store and output passes unchanged.
    Raises :class:`~.IdempotentError` when the engine's scheduler is another one (the
    component was wired by hand without it), or when the crawl has an engine whose scheduler
    cannot be found (the component would otherwise store nothing, silently)."""
    from .scheduler import is_idempotent_scheduler

    try:
        if crawler.engine is None:
            return None
        scheduler = engine_hooks.engine_scheduler(crawler)
    except RuntimeError:  # Scrapy 2.19's Crawler.engine before the crawl built it
        return None
    if scheduler is None:
        raise IdempotentError(
            f"{component} found the crawl's engine but no scheduler in it (the spider is not "
            "open, or this Scrapy's engine keeps it elsewhere): nothing would be stored; "
            "use it in a crawl with ADDONS = {'scrapy_idempotent.Addon': 0}"
        )
    if not is_idempotent_scheduler(scheduler):
        raise IdempotentError(
            f"{component} needs SCHEDULER = 'scrapy_idempotent.IdempotentScheduler' (found "
            f"{type(scheduler).__module__}.{type(scheduler).__qualname__}); add "
            "ADDONS = {'scrapy_idempotent.Addon': 0} to the settings"
        )
    return cast("IdempotentScheduler", scheduler)


class RecordIdMiddleware:
    """Spider middleware: record IDs on items, and output attributed to its request."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self._scheduler: IdempotentScheduler | None = None
        crawler.signals.connect(self._spider_opened, signals.spider_opened)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        # Spider middlewares are built with the engine, before the spider opens: checking the
        # settings here stops a misconfigured crawl before anything starts (the scheduler
        # reads them again when it is built, at spider open).
        with engine_hooks.start_failure_exits_nonzero(crawler):
            if crawler.spider is not None:
                config_for(crawler)
            DuplicateFilter.check(crawler.settings)  # DUPEFILTER_CLASS
            from .scheduler import is_idempotent_scheduler

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
        self.scheduler  # noqa: B018 - fail at start when wired without the scheduler

    @property
    def scheduler(self) -> IdempotentScheduler | None:
        """None outside a crawl (see :func:`_scheduler_of`)."""
        if self._scheduler is None:
            self._scheduler = _scheduler_of(self.crawler, type(self).__name__)
        return self._scheduler

    async def process_start(self, start: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Start requests are marked so ``dont_filter`` ones get stable keys; start items
        get their record IDs."""
        async for output in start:
            scheduler = self.scheduler
            if scheduler is not None:
                if isinstance(output, Request):
                    scheduler.mark_start(output)
                else:
                    scheduler.track(output, None, None)
            yield output

    # ``spider``: Scrapy 2.13 passes it; later releases do not (see :mod:`.engine_hooks`).
    async def process_spider_output(
        self, response: Response, result: AsyncIterator[Any], spider: Spider | None = None
    ) -> AsyncIterator[Any]:
        scheduler = self.scheduler
        if scheduler is None:
            async for output in result:
                yield output
            return
        entry = scheduler.entry_for(response)
        async for output in result:
            scheduler.track(output, entry, response.url)
            yield output
