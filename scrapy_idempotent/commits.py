"""The commit path: units of work written to the store, retried while the database is busy,
then, once durable, counted and announced.

The writes themselves run on the writer's thread (:class:`~.writer.WriterThread`: page
commits grouped, lease renewals, every other write), each retried there with
:func:`retry_busy` while the database is busy; the reactor thread gets the results back.

:class:`CommitOutcomes` is what follows a commit, on the reactor thread: the stats of what
it wrote, the warnings about quarantined requests and lost leases, and the
:data:`~.signals.request_done` signal of each final state it wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from scrapy.utils.url import strip_url

from . import signals
from .exceptions import StoreBusy
from .store.base import RequestState

if TYPE_CHECKING:
    from scrapy import Request, Spider
    from scrapy.crawler import Crawler
    from scrapy.statscollectors import StatsCollector

    from .store.base import CommitResult, UnitOfWork

__all__ = ["COMMIT_ATTEMPTS", "CommitOutcomes", "retry_busy"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Attempts at a write transaction before the crawl is closed (database locked by another
#: process).
COMMIT_ATTEMPTS = 5


def retry_busy(what: str, action: Callable[[], _T], *, attempts: int = COMMIT_ATTEMPTS,
               sleep: Callable[[float], object] = time.sleep) -> _T:
    """``action()``, tried again with back-off while another process holds the database
    locked (:class:`~.StoreBusy`), at most ``attempts`` times (back-off 0.05 s, doubling,
    through ``sleep``); any other store error (disk full, read-only, not our schema, an I/O
    error) is raised at once, as retrying cannot cure it. Blocks the calling thread: each
    attempt waits up to IDEMPOTENT_BUSY_TIMEOUT_SECONDS for the lock (the writer's thread
    while a crawl runs; the reactor's only when the store is opened and closed). ``what``:
    the action, for the log (``"committing"``)."""
    delay = 0.05
    for attempt in range(1, attempts):
        try:
            return action()
        except StoreBusy as exc:
            logger.warning("scrapy_idempotent: database busy while %s (%s), "
                           "retrying (%d/%d)", what, exc, attempt, attempts)
            sleep(delay)
            delay *= 2
    return action()


class CommitOutcomes:
    """What follows a commit (see the module docstring)."""

    def __init__(self, crawler: Crawler, stats: StatsCollector, max_attempts: int) -> None:
        self.crawler = crawler
        self.stats = stats
        self.max_attempts = max_attempts  #: IDEMPOTENT_MAX_ATTEMPTS, for the log
        self.spider: Spider | None = None
        #: key -> (request, fingerprint) of final states on their way to the database: the
        #: request_done signal is sent for each once the transaction writing it committed
        self._announce: dict[str, tuple[Request | None, str]] = {}

    def expect(self, key: str, request: Request | None, fingerprint: str) -> None:
        """A final state of ``key`` goes to the database: announce it once committed.
        ``request`` is None for a stored request that could not be loaded."""
        self._announce[key] = (request, fingerprint)

    def committed(self, result: CommitResult, work: UnitOfWork) -> None:
        """``work`` is durable: count it and announce its final states."""
        self._record_stats(result, work)
        self._announce_completions(result, work)

    def already_done(self, request: Request, key: str, fingerprint: str) -> None:
        """``request_done`` with state ``already_done`` for a known request refused because
        it is already finished in this window (its final state was committed earlier)."""
        signals.send_request_done(self.crawler, self.spider, request, key, fingerprint,
                                  signals.ALREADY_DONE)

    def _announce_completions(self, result: CommitResult, work: UnitOfWork) -> None:
        """Send ``request_done`` for each final state ``work`` wrote: called once its
        transaction has committed, never before (a lost lease's completion wrote nothing)."""
        lost = set(result.lost) if result.lost else ()
        for completion in work.completions:
            announced = self._announce.pop(completion.key, None)
            if announced is None or completion.key in lost or not completion.state.terminal:
                continue
            request, fingerprint = announced
            signals.send_request_done(self.crawler, self.spider, request, completion.key,
                                      fingerprint, completion.state.value)

    def _record_stats(self, result: CommitResult, work: UnitOfWork) -> None:
        self._count_completions(result, work)
        for url in result.quarantined:
            logger.warning(
                "scrapy_idempotent: %s quarantined (failed): it was started %d times without "
                "finishing, as if it killed the crawl each time; `scrapy idempotent retry "
                "--kind quarantined` puts it back", strip_url(url, strip_credentials=True),
                self.max_attempts)
        inc = self.stats.inc_value
        inc("idempotent/transactions")
        for name, value in (
            ("requests/added", result.requests_added),
            ("requests/duplicate", result.requests_duplicate),
            ("requests/already_done", result.requests_already_done),
            ("requests/due_again", result.requests_due_again),
            ("records/inserted", result.records_inserted),
            ("records/updated", result.records_updated),
            ("records/unchanged", result.records_unchanged),
            ("records/conflicts", result.records_conflicts),
            ("records/stale", result.records_stale),
            ("records/rejected", result.rejects),
            ("requests/leases_lost", result.leases_lost),
            ("requests/quarantined", len(result.quarantined)),
            ("outbox/written", result.outbox_entries),
        ):
            if value:
                inc(f"idempotent/{name}", value)

    def _count_completions(self, result: CommitResult, work: UnitOfWork) -> None:
        """Stats of the completions written (a lost lease's completion counts nothing)."""
        lost = set(result.lost)
        for completion in work.completions:
            if completion.key in lost:
                continue  # nothing of it was written: it does not count
            self.stats.inc_value(f"idempotent/requests/{completion.state.value}"
                                 if completion.state is not RequestState.PENDING
                                 else "idempotent/requests/continued")
            if completion.error_kind:
                self.stats.inc_value(f"idempotent/failed/{completion.error_kind}")
        if lost:
            logger.warning(
                "scrapy_idempotent: %d completed request(s) were not this worker's any more "
                "(their lease expired, e.g. the process was stopped, and another worker took "
                "them): nothing of their work was written (idempotent/requests/leases_lost)",
                len(lost))
