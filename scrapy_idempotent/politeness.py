"""Politeness for the whole crawl: Scrapy's per-slot limits kept where requests are claimed.

Scrapy keeps its politeness (``CONCURRENT_REQUESTS_PER_DOMAIN`` or ``_PER_IP``,
``DOWNLOAD_DELAY``, ``DOWNLOAD_SLOTS``) in each process's downloader: with several workers on
one crawl, a site would see every limit multiplied by the number of workers, and a restarted
worker would forget that a site asked it to slow down. With ``IDEMPOTENT_POLITENESS =
"crawl"`` (the default) the limits belong to the crawl:

* every request is stored with its download slot (Scrapy's slot key, from the downloader's
  ``get_slot_key``: the ``download_slot`` meta key, else the host name, or its IP with
  ``CONCURRENT_REQUESTS_PER_IP``);
* a claim takes requests only from slots that may send now: fewer leased requests (all
  workers together) than the slot's concurrency, its delay waited out since the slot's last
  claim (one request per claim then), not paused; the slots that waited longest first
  (see :meth:`~.SqlStore._claim_by_slot`). So nothing waits in one worker's downloader that
  another could send, and a paused or slow site does not fill the downloaders;
* the delay is the store's, so the worker's downloader does not add its own again (its slot
  delay is set to 0 as the request is handed out, unless AutoThrottle drives it);
* a 429 (or a 503 with ``Retry-After``) pauses the slot in the store for every worker,
  durable before the request is retried (:class:`SlotBackoffMiddleware`): for the site's
  ``Retry-After`` (seconds or an HTTP date), else ``IDEMPOTENT_BACKOFF_SECONDS`` doubled
  with every such answer in a row, up to ``IDEMPOTENT_BACKOFF_MAX_SECONDS``, with jitter.
  The request is retried without counting against ``RETRY_TIMES`` (up to
  :data:`THROTTLED_RETRIES` times in a row; not with ``RETRY_ENABLED = False`` or
  ``dont_retry``, where the pause alone holds);
* with ``ROBOTSTXT_OBEY``, robots.txt's ``Crawl-delay`` for the crawl's user agent is the
  slot's delay when it is longer.

``IDEMPOTENT_POLITENESS = "worker"`` keeps Scrapy's own limits in each worker and claims the
frontier's head whatever its slots.
"""

from __future__ import annotations

import email.utils
import logging
import time
from typing import TYPE_CHECKING, Any

from .scrapy_compat import downloader_slots, slot_key_of
from .store.base import SlotLimits

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.settings import BaseSettings
    from scrapy.statscollectors import StatsCollector
    from twisted.internet.defer import Deferred
    from typing_extensions import Self

    from .config import IdempotentConfig
    from .engine_hooks import EngineWakeup
    from .leases import ClaimedRequests
    from .store.base import FrontierStore
    from .writer import WriterThread

__all__ = ["BACKOFF_PRIORITY", "THROTTLED_RETRIES", "Politeness", "SlotBackoffMiddleware",
           "retry_after_seconds", "slot_limits", "throttled"]

logger = logging.getLogger(__name__)

#: A request throttled this many times in a row goes on to RetryMiddleware (which counts
#: RETRY_TIMES) instead of being retried once more after the pause.
THROTTLED_RETRIES = 10
#: Between RetryMiddleware (550) and RedirectMiddleware (600): it sees a 429 or 503 before
#: RetryMiddleware does (process_response runs from the highest number down).
BACKOFF_PRIORITY = 560
#: A pause is lengthened by a random share of itself up to this (without Retry-After).
BACKOFF_JITTER = 0.25
#: meta key: how many times the request was throttled (retried after a 429 or 503)
THROTTLED_META = "idempotent_throttled"


def slot_limits(settings: BaseSettings) -> SlotLimits:
    """The crawl's per-slot limits from Scrapy's settings, as the downloader reads them
    (scrapy/core/downloader/__init__.py, ``Downloader._get_slot``): the concurrency is
    ``CONCURRENT_REQUESTS_PER_IP`` when set, else ``CONCURRENT_REQUESTS_PER_DOMAIN``; the
    delay ``DOWNLOAD_DELAY``; ``DOWNLOAD_SLOTS`` entries' ``concurrency`` and ``delay``,
    and ``THROTTLING_SCOPES`` entries' where the installed Scrapy has that setting
    (:func:`.scrapy_compat.per_slot_settings`)."""
    from .scrapy_compat import per_slot_settings

    per_slot: list[tuple[str, int | None, float | None]] = []
    for slot, given in sorted(per_slot_settings(settings).items()):
        concurrency = given.get("concurrency")
        delay = given.get("delay")
        per_slot.append((str(slot), int(concurrency) if concurrency is not None else None,
                         float(delay) if delay is not None else None))
    return SlotLimits(
        concurrency=(settings.getint("CONCURRENT_REQUESTS_PER_IP")
                     or settings.getint("CONCURRENT_REQUESTS_PER_DOMAIN")),
        delay_seconds=settings.getfloat("DOWNLOAD_DELAY"),
        per_slot=tuple(per_slot))


def retry_after_seconds(value: bytes | str | None, now: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` header asks for (RFC 9110 10.2.3: a number of seconds,
    or an HTTP date); None when absent or not understood."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Politeness:
    """One worker's part in the crawl's politeness (see the module docstring): the slot of
    each request enqueued, the downloader's own delay out of the way, the pauses sites ask
    for, and a wake-up of the engine when a waiting slot may send."""

    def __init__(self, config: IdempotentConfig, *, stats: StatsCollector,
                 claimed: ClaimedRequests, wakeup: EngineWakeup, writer: WriterThread,
                 autothrottle: bool) -> None:
        self.crawl_wide = config.politeness == "crawl"
        self.limits = config.slot_limits if self.crawl_wide else None
        self.first_backoff_seconds = config.backoff_seconds
        self.max_backoff_seconds = config.backoff_max_seconds
        self.stats = stats
        self.claimed = claimed
        self.wakeup = wakeup
        self.writer = writer
        self.autothrottle = autothrottle
        self._downloader: Any = None
        self._wake_call: Any = None
        self._backing_off: set[str] = set()  #: slots this worker paused (backoff to reset)
        #: slot -> until when (``time.monotonic()``) this worker sends none of its requests:
        #: a site's pause binds here from the answer on, before it is written
        self._holds: dict[str, float] = {}
        self._crawl_delays: dict[str, float] = {}  #: robots.txt Crawl-delay kept, per slot

    def open(self, downloader: Any, store: FrontierStore) -> None:
        """At the spider's open, on the calling thread: claims keep the limits from now on
        (written into the store: the crawl's limits are those of the last worker started)."""
        self._downloader = downloader
        store.keep_slot_limits(self.limits)

    def close(self) -> None:
        if self._wake_call is not None and self._wake_call.active():
            self._wake_call.cancel()
        self._wake_call = None

    def slot_of(self, request: Request) -> str:
        """The download slot ``request`` is stored with ("" when limits are per worker)."""
        if not self.crawl_wide or self._downloader is None:
            return ""
        return slot_key_of(self._downloader, request)

    def handing_out(self, request: Request) -> None:
        """``request`` goes to the downloader: the crawl's claim kept the slot's delay, so
        the worker's downloader slot has none of its own (AutoThrottle's delay stays)."""
        if not self.crawl_wide or self.autothrottle or self._downloader is None:
            return
        slots = downloader_slots(self._downloader)
        if slots is None:
            # Scrapy's throttler keeps this worker's delay: it holds a request only until
            # the delay has passed since this worker's previous one of the slot, which the
            # crawl's claims have already waited out (their delay is the crawl's)
            return
        key = slot_key_of(self._downloader, request)
        slot = slots.get(key)
        if slot is None:
            from scrapy.core.downloader import Slot

            slots[key] = Slot(self._concurrency_of(key), 0.0, 0)
        elif slot.delay:
            slot.delay = 0.0

    def _concurrency_of(self, slot: str) -> int:
        limits = self.limits
        assert limits is not None
        for name, concurrency, _ in limits.per_slot:
            if name == slot and concurrency is not None:
                return concurrency
        return limits.concurrency

    def claim_again_in(self, seconds: float) -> None:
        """A claim left requests of slots that wait (a delay, a pause): ask the store again
        when the first of them may send."""
        from twisted.internet import reactor as installed  # the one Scrapy installed

        clock: Any = installed
        call = self._wake_call
        if call is not None and call.active():
            if call.getTime() <= clock.seconds() + seconds:
                return
            call.cancel()
        self.claimed.slots_wait_until(time.monotonic() + seconds)
        self._wake_call = clock.callLater(max(seconds, 0.0), self._slot_ready)

    def _slot_ready(self) -> None:
        self._wake_call = None
        self.claimed.wake()
        self.wakeup.now()

    # -- what sites say -------------------------------------------------------------------

    def holding(self, slot: str) -> bool:
        """Whether this worker holds back requests of ``slot``: its site paused it (a 429)
        and the pause is not over."""
        if not self._holds or not slot:
            return False
        until = self._holds.get(slot)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._holds[slot]
        return False

    def throttled(self, slot: str, retry_after: float | None) -> Deferred[float]:
        """A site answered ``slot``'s request with 429 (or 503): pause the slot for every
        worker; the Deferred fires with the seconds paused once the pause is durable. The
        pause binds this worker at once (:meth:`holding`): for the shortest it can be
        until it is written, then for the pause written."""
        self.stats.inc_value("idempotent/requests/throttled")
        self._holds[slot] = time.monotonic() + min(
            retry_after if retry_after is not None else self.first_backoff_seconds,
            self.max_backoff_seconds)
        self._backing_off.add(slot)
        first, most = self.first_backoff_seconds, self.max_backoff_seconds
        pausing = self.writer.call("pausing a download slot", lambda store: store.pause_slot(
            slot, retry_after=retry_after, first_seconds=first, max_seconds=most,
            jitter=BACKOFF_JITTER))
        pausing.addCallback(self._paused, slot)
        return pausing

    def _paused(self, seconds: float, slot: str) -> float:
        self._holds[slot] = max(self._holds.get(slot, 0.0), time.monotonic() + seconds)
        self.stats.inc_value("idempotent/slots/paused")
        logger.info("scrapy_idempotent: download slot %s paused for %.1f s for every worker "
                    "(the site answered 429 or 503)", slot, seconds)
        return seconds

    def answered(self, slot: str) -> None:
        """``slot`` answered normally: a slot this worker backed off starts from the first
        pause again at its next 429 or 503."""
        if slot in self._backing_off:
            self._backing_off.discard(slot)
            self.writer.call("ending a download slot's backoff",
                             lambda store: store.slot_answered(slot))

    def crawl_delay(self, slot: str, delay: float) -> None:
        """robots.txt asks for ``delay`` seconds between requests to ``slot``'s site."""
        if self._crawl_delays.get(slot) == delay:
            return
        self._crawl_delays[slot] = delay
        self.stats.inc_value("idempotent/slots/crawl_delay")
        self.writer.call("keeping a download slot's crawl delay",
                         lambda store: store.set_slot_delay(slot, delay))


class SlotBackoffMiddleware:
    """Downloader middleware (the add-on puts it at :data:`BACKOFF_PRIORITY`): a 429 (or a
    503 with ``Retry-After``) pauses the request's download slot for the whole crawl, and
    the request is retried without counting against ``RETRY_TIMES``; robots.txt's
    ``Crawl-delay`` is kept as the slot's delay. Nothing with ``IDEMPOTENT_POLITENESS =
    "worker"``."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self._politeness: Politeness | None = None
        self._looked_up = False
        self._robots: Any = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        from scrapy.exceptions import NotConfigured

        from .config import config_for
        from .scrapy_compat import start_failure_exits_nonzero

        with start_failure_exits_nonzero(crawler):
            politeness = config_for(crawler).politeness
        if politeness != "crawl":
            # not in every response's way for nothing; without a message, Scrapy leaves it
            # out of its list of middlewares silently (the default is no cause for a warning)
            raise NotConfigured
        return cls(crawler)

    @property
    def politeness(self) -> Politeness | None:
        if not self._looked_up:
            from .crawl import idempotent_scheduler

            scheduler = idempotent_scheduler(self.crawler, type(self).__name__)
            found = scheduler.politeness if scheduler is not None else None
            self._politeness = found if found is not None and found.crawl_wide else None
            self._looked_up = True
        return self._politeness

    def process_request(self, request: Request, spider: Any = None) -> None:
        politeness = self.politeness
        if politeness is None or not self.crawler.settings.getbool("ROBOTSTXT_OBEY"):
            return
        delay = self._crawl_delay(request)
        if delay:
            politeness.crawl_delay(politeness.slot_of(request), delay)

    def _crawl_delay(self, request: Request) -> float | None:
        """robots.txt's Crawl-delay for ``request``'s site, once the robots.txt middleware
        has it parsed: the package's :class:`~.CrawlRobotsTxtMiddleware` (which the add-on
        puts in place of Scrapy's), or Scrapy's ``RobotsTxtMiddleware`` wired by hand (its
        parsers by netloc: ``RobotsTxtMiddleware._parsers``, private, read only when
        present)."""
        robots = self._robots
        if robots is None:
            from scrapy.downloadermiddlewares.robotstxt import RobotsTxtMiddleware

            from .robots import CrawlRobotsTxtMiddleware

            engine = self.crawler.engine
            middlewares = getattr(getattr(getattr(engine, "downloader", None), "middleware",
                                          None), "middlewares", ())
            robots = self._robots = next(
                (mw for mw in middlewares
                 if isinstance(mw, (CrawlRobotsTxtMiddleware, RobotsTxtMiddleware))), False)
        if not robots:
            return None
        from scrapy.utils.httpobj import urlparse_cached

        from .robots import CrawlRobotsTxtMiddleware

        netloc = urlparse_cached(request).netloc
        if isinstance(robots, CrawlRobotsTxtMiddleware):
            parser: Any = robots.parser_of(netloc)
            agent: Any = robots.useragent_of(request)
        else:
            parser = getattr(robots, "_parsers", {}).get(netloc)
            agent = getattr(robots, "_robotstxt_useragent", None) or request.headers.get(
                b"User-Agent", self.crawler.settings.get("USER_AGENT"))
        crawl_delay = getattr(getattr(parser, "rp", None), "crawl_delay", None)
        if crawl_delay is None:
            return None
        if isinstance(agent, bytes):
            agent = agent.decode("latin-1")
        try:
            delay = crawl_delay(agent)
        except Exception:  # a parser's own failure: no delay known
            return None
        return float(delay) if delay else None

    async def process_response(self, request: Request, response: Response,
                               spider: Any = None) -> Request | Response:
        politeness = self.politeness
        if politeness is None:
            return response
        slot = request.meta.get("download_slot") or politeness.slot_of(request)
        retry_after = retry_after_seconds(response.headers.get(b"Retry-After"))
        if not throttled(response.status, retry_after is not None):
            politeness.answered(slot)
            return response
        from scrapy.utils.defer import maybe_deferred_to_future

        # durable before the request goes on: a kill after this leaves the pause stored
        await maybe_deferred_to_future(politeness.throttled(slot, retry_after))
        times = int(request.meta.get(THROTTLED_META, 0))
        if (request.meta.get("dont_retry") or times >= THROTTLED_RETRIES
                or not self.crawler.settings.getbool("RETRY_ENABLED")):
            return response  # RetryMiddleware and HttpErrorMiddleware decide, as in Scrapy
        retry = request.copy()
        retry.dont_filter = True
        retry.meta[THROTTLED_META] = times + 1
        return retry


def throttled(status: int, retry_after: bool) -> bool:
    """Whether an answer asks for a pause: a 429, or a 503 with ``Retry-After`` (a 503
    without it is a failing page as often as a busy site: RetryMiddleware retries it, as in
    Scrapy, and the slot is not paused)."""
    return status == 429 or (status == 503 and retry_after)
