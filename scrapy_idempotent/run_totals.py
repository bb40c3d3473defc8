"""The run's totals as this process sees them: the store's counters of the run (every worker,
every crawl of it, as committed) as of the last read, plus what this process committed since.

:class:`RunCount` adds the two up. The store is read (:meth:`~.FrontierStore.run_totals`) on
the crawl's writer thread after the writes submitted before the read
(:func:`~.crawl.read_after_writes`), and the read's answer reaches the reactor thread after
those writes' results are in this process's ``idempotent/...`` stats: the stats at that
moment are exactly this process's part of what was read, so what it commits later is what
the stats grew by since. Other workers' commits are seen at the next read.

:data:`RUN_STATS` names the ``idempotent/run/...`` stats that report a :class:`RunTotals`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scrapy.statscollectors import StatsCollector

    from .store.reads import RunTotals

__all__ = ["RUN_STATS", "LocalCounts", "RunCount", "local_counts", "set_run_stats"]

#: stat -> its value in a :class:`RunTotals` (None: not read)
RUN_STATS: tuple[tuple[str, Callable[[RunTotals], int | None]], ...] = (
    ("idempotent/run/items", lambda t: t.items),
    ("idempotent/run/pages", lambda t: t.pages),
    ("idempotent/run/errors", lambda t: t.spider_errors),
    ("idempotent/run/requests/done", lambda t: t.done),
    ("idempotent/run/requests/failed", lambda t: t.failed),
    ("idempotent/run/requests/redirected", lambda t: t.redirected),
    ("idempotent/run/records/inserted", lambda t: t.records_inserted),
    ("idempotent/run/records/updated", lambda t: t.records_updated),
    ("idempotent/run/records/unchanged", lambda t: t.records_unchanged),
    ("idempotent/run/records/stale", lambda t: t.records_stale),
)

#: This process's stats that add up to a :class:`RunTotals` figure (the run counters count a
#: quarantined request as failed)
_ITEM_STATS = ("idempotent/records/inserted", "idempotent/records/updated",
               "idempotent/records/unchanged", "idempotent/records/stale")
_PAGE_STATS = ("idempotent/requests/done", "idempotent/requests/failed",
               "idempotent/requests/redirected", "idempotent/requests/quarantined")
#: the ``idempotent/failed/<kind>`` stats of callback errors start so
_SPIDER_ERROR_STATS = "/".join(("idempotent", "failed", "spider_error", ""))


def set_run_stats(stats: StatsCollector, totals: RunTotals) -> None:
    """Set the ``idempotent/run/...`` stats from ``totals`` (those not read are left out)."""
    for name, value_of in RUN_STATS:
        value = value_of(totals)
        if value is not None:
            stats.set_value(name, value)


@dataclass(frozen=True)
class LocalCounts:
    """What this process has committed: items, pages, spider errors (from its stats)."""

    items: int = 0
    pages: int = 0
    spider_errors: int = 0


def local_counts(stats: StatsCollector, *, spider_errors: bool = False) -> LocalCounts:
    """This process's committed items and pages (and, with ``spider_errors``, its requests
    failed by their callback), from the stats its commits counted."""
    errors = 0
    if spider_errors:
        errors = sum(int(value) for name, value in stats.get_stats().items()
                     if name.startswith(_SPIDER_ERROR_STATS))
    return LocalCounts(items=sum(int(stats.get_value(name, 0)) for name in _ITEM_STATS),
                       pages=sum(int(stats.get_value(name, 0)) for name in _PAGE_STATS),
                       spider_errors=errors)


class RunCount:
    """The run's items, pages and spider errors as this process sees them (see the module
    docstring): ``read`` (a store read's answer) as the base, plus what this process did
    since, the more of two counts: its commits (from ``stats``), and what Scrapy saw
    happen (:meth:`saw`: items scraped, responses received, spider errors) before their
    pages' commits, so that the count is as prompt as Scrapy's own in one process."""

    def __init__(self, stats: StatsCollector, *, spider_errors: bool = False) -> None:
        self.stats = stats
        self.spider_errors = spider_errors  #: count them (a read over the failed entries)
        self.base: RunTotals | None = None
        self._committed_at_base = LocalCounts()
        self._seen = LocalCounts()
        self._seen_at_base = LocalCounts()

    def saw(self, *, items: int = 0, pages: int = 0, spider_errors: int = 0) -> None:
        """Scrapy saw ``items`` scraped, ``pages`` received, ``spider_errors`` raised."""
        seen = self._seen
        self._seen = LocalCounts(seen.items + items, seen.pages + pages,
                                 seen.spider_errors + spider_errors)

    def read(self, totals: RunTotals) -> None:
        """``totals`` were read after every write whose result is in the stats now."""
        self.base = totals
        self._committed_at_base = local_counts(self.stats, spider_errors=self.spider_errors)
        self._seen_at_base = self._seen

    def now(self) -> LocalCounts:
        """The run's figures: the last read, plus this process's work since (zeros before
        the first read)."""
        base = self.base
        if base is None:
            return LocalCounts()
        committed = local_counts(self.stats, spider_errors=self.spider_errors)
        since, seen, seen_since = self._committed_at_base, self._seen, self._seen_at_base
        return LocalCounts(
            items=base.items + max(committed.items - since.items,
                                   seen.items - seen_since.items),
            pages=base.pages + max(committed.pages - since.pages,
                                   seen.pages - seen_since.pages),
            spider_errors=(base.spider_errors or 0) + max(
                committed.spider_errors - since.spider_errors,
                seen.spider_errors - seen_since.spider_errors))
