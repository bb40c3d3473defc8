"""How the package's components find the collaborators of their crawl.

The scheduler is built by the engine when the spider opens, after the spider and downloader
middlewares, the item pipelines and the extensions; it is handed the crawl's in-flight
tracker and store (``IdempotentScheduler.from_crawler``). The other components find them
here, once the spider is open: :func:`inflight_tracker` (``RecordIdMiddleware``,
``UpsertPipeline``, ``ResponseJournalMiddleware``), :func:`frontier_store` (the journal's
replays, the progress line's counts), :func:`store_call` (robots.txt of the crawl),
:func:`current_run` (the run-wide limits) and
:func:`start_intake` (``RecordIdMiddleware`` paces ``start()`` with it). The feed exporter
gets what it needs of the crawl as a :class:`FeedSession` (:func:`feed_session`), never the
scheduler itself.

They answer None for a crawler without an engine: the component is used outside a crawl
(Scrapy's own tests drive middleware managers on a bare crawler), where there is nothing to
attribute or store and output passes unchanged. They raise :class:`~.IdempotentError` when
the engine's scheduler is another one (the component was wired by hand without it), or when
the crawl has an engine whose scheduler cannot be found (the component would otherwise store
nothing, silently).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from . import scrapy_compat
from ._scheduler_kind import is_idempotent_scheduler
from .exceptions import IdempotentError

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from twisted.internet.defer import Deferred

    from .admission import StartIntake
    from .inflight import InflightTracker
    from .scheduler import IdempotentScheduler
    from .store.base import FrontierStore

__all__ = [
    "FeedSession",
    "current_run",
    "feed_session",
    "frontier_store",
    "idempotent_scheduler",
    "inflight_tracker",
    "read_after_writes",
    "start_intake",
    "store_call",
    "store_refused",
]


_T = TypeVar("_T")


def idempotent_scheduler(crawler: Crawler, component: str) -> IdempotentScheduler | None:
    """The crawl's :class:`~.IdempotentScheduler` (see the module docstring);
    ``component`` names the caller in the error."""
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


def store_refused(crawler: Crawler) -> bool:
    """Whether the crawl's scheduler could not use its frontier database (refused at open,
    or failed since): its cause is logged once, by the scheduler, so a component that would
    open the same database says nothing more."""
    try:
        scheduler = idempotent_scheduler(crawler, "the check for a refused database")
    except IdempotentError:
        return False
    return scheduler is not None and scheduler.health.failed


def inflight_tracker(crawler: Crawler, component: str) -> InflightTracker | None:
    """The crawl's :class:`~.InflightTracker` (see the module docstring)."""
    scheduler = idempotent_scheduler(crawler, component)
    return scheduler.tracker if scheduler is not None else None


def frontier_store(crawler: Crawler, component: str) -> FrontierStore | None:
    """The crawl's store, for reads (see the module docstring)."""
    scheduler = idempotent_scheduler(crawler, component)
    return scheduler.store if scheduler is not None else None


def current_run(crawler: Crawler, component: str) -> int | None:
    """The run the crawl works on now (None outside a crawl, or before its store is open):
    a crawl open across the run boundary goes on in the next run (see the scheduler)."""
    scheduler = idempotent_scheduler(crawler, component)
    return scheduler.run_id if scheduler is not None else None


def read_after_writes(crawler: Crawler, component: str,
                      read: Callable[[FrontierStore], _T]) -> Deferred[_T] | None:
    """``read(store)`` run on the crawl's writer thread after every write submitted before it;
    the Deferred fires on the reactor thread after the callbacks of those writes (they are
    delivered in order), so what the read sees and what their callbacks counted in the stats
    agree. None outside a crawl; a failed Deferred when the store cannot be read."""
    scheduler = idempotent_scheduler(crawler, component)
    if scheduler is None:
        return None
    try:
        return scheduler.writer.call("reading the frontier", read)
    except IdempotentError as exc:  # the writer is not running (yet, or any more)
        from twisted.internet.defer import fail

        return fail(exc)


def store_call(crawler: Crawler, component: str, what: str,
               action: Callable[[FrontierStore], _T]) -> Deferred[_T] | None:
    """``action(store)`` (a read or a write: ``what`` says which, for the log) on the crawl's
    writer thread, in order with its writes; the Deferred fires on the reactor thread. None
    outside a crawl (or before the spider is open); a failed Deferred when the store cannot
    be used."""
    scheduler = idempotent_scheduler(crawler, component)
    if scheduler is None or scheduler.run_id is None:
        return None
    try:
        return scheduler.writer.call(what, action)
    except IdempotentError as exc:  # the writer is not running (yet, or any more)
        from twisted.internet.defer import fail

        return fail(exc)


def start_intake(crawler: Crawler, component: str) -> StartIntake | None:
    """The crawl's :class:`~.StartIntake`: how fast ``start()`` is taken in."""
    scheduler = idempotent_scheduler(crawler, component)
    return scheduler.start_intake if scheduler is not None else None

@dataclass(frozen=True)
class FeedSession:
    """What the feed exporter needs of its crawl (see :func:`feed_session`)."""

    #: the crawl's open store (the run's records are read from it)
    store: FrontierStore
    #: the run this process works on
    run_id: int
    #: this process's worker id (see :mod:`.workers`): the owner of its temporary files
    worker: str
    #: IDEMPOTENT_RECORD_ID_FIELD (None: the record ID is not stamped into items)
    record_id_field: str | None
    #: ``before_session_end(hook)``: ``await hook(store, run_id, finishing)`` at the close,
    #: once every write of the crawl is committed and before the run can be marked finished
    #: (an exception it raises leaves the run unfinished)
    before_session_end: Callable[[Callable[[FrontierStore, int, bool], Any]], None]
    #: ``call(what, action)``: ``action(store)`` on the crawl's writer thread, in order with
    #: its writes (a Deferred of the result; the streamed feeds are written there)
    call: Callable[[str, Callable[[FrontierStore], Any]], Deferred[Any]]
    #: the run this process works on now (a crawl open across the run boundary goes on in
    #: the next run: see the scheduler)
    current_run: Callable[[], int | None]
    #: ``follow_commits(hook)``: ``hook(store)`` on the writer thread after each commit that
    #: stored records, before its result reaches the reactor
    follow_commits: Callable[[Callable[[FrontierStore], None]], None]
    #: IDEMPOTENT_LEASE_SECONDS: how long a worker's claim on a streamed feed lasts
    lease_seconds: float
    #: IDEMPOTENT_FEED_STREAMING (local feeds written while the crawl runs, where the store
    #: can)
    streaming: bool
    #: ``close_before_fetching(reason, failed=...)``: close the spider before anything is
    #: handed out (a feed that could never be written)
    close_before_fetching: Callable[..., None]


def feed_session(crawler: Crawler) -> FeedSession | None:
    """The crawl's :class:`FeedSession` once the spider is open; None when the crawl's
    scheduler is not the package's (or there is no engine): the feed exporter then behaves
    as Scrapy's own."""
    try:
        scheduler = scrapy_compat.engine_scheduler(crawler) if crawler.engine else None
    except RuntimeError:  # Scrapy 2.19's Crawler.engine before the crawl built it
        return None
    if scheduler is None or not is_idempotent_scheduler(scheduler):
        return None
    scheduler = cast("IdempotentScheduler", scheduler)
    if scheduler.run_id is None:
        return None
    return FeedSession(store=scheduler.store, run_id=scheduler.run_id,
                       worker=scheduler.worker,
                       record_id_field=scheduler.config.record_id_field,
                       before_session_end=scheduler.before_session_end,
                       call=scheduler.writer.call,
                       current_run=lambda: scheduler.run_id,
                       follow_commits=scheduler.writer.follow_commits,
                       lease_seconds=scheduler.config.lease_seconds,
                       streaming=scheduler.config.feed_streaming,
                       close_before_fetching=scheduler.close_before_fetching)
