"""How the package's components find the collaborators of their crawl.

The scheduler is built by the engine when the spider opens, after the spider and downloader
middlewares, the item pipelines and the extensions; it is handed the crawl's in-flight
tracker and store (``IdempotentScheduler.from_crawler``). The other components find them
here, once the spider is open: :func:`inflight_tracker` (``RecordIdMiddleware``,
``UpsertPipeline``, ``ResponseJournalMiddleware``) and :func:`frontier_store` (the journal's
replays, the progress line's counts).

Both answer None for a crawler without an engine: the component is used outside a crawl
(Scrapy's own tests drive middleware managers on a bare crawler), where there is nothing to
attribute or store and output passes unchanged. Both raise :class:`~.IdempotentError` when
the engine's scheduler is another one (the component was wired by hand without it), or when
the crawl has an engine whose scheduler cannot be found (the component would otherwise store
nothing, silently).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from . import scrapy_compat
from .exceptions import IdempotentError

if TYPE_CHECKING:
    from scrapy.crawler import Crawler

    from .inflight import InflightTracker
    from .scheduler import IdempotentScheduler
    from .store.base import FrontierStore

__all__ = [
    "frontier_store",
    "idempotent_scheduler",
    "inflight_tracker",
]


def idempotent_scheduler(crawler: Crawler, component: str) -> IdempotentScheduler | None:
    """The crawl's :class:`~.IdempotentScheduler` (see the module docstring);
    ``component`` names the caller in the error."""
    from .scheduler import is_idempotent_scheduler

    try:
        if crawler.engine is None:
            return None
        scheduler = scrapy_compat.engine_scheduler(crawler)
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


def inflight_tracker(crawler: Crawler, component: str) -> InflightTracker | None:
    """The crawl's :class:`~.InflightTracker` (see the module docstring)."""
    scheduler = idempotent_scheduler(crawler, component)
    return scheduler.tracker if scheduler is not None else None


def frontier_store(crawler: Crawler, component: str) -> FrontierStore | None:
    """The crawl's store, for reads (see the module docstring)."""
    scheduler = idempotent_scheduler(crawler, component)
    return scheduler.store if scheduler is not None else None

