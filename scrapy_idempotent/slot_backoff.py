"""``SlotBackoffMiddleware``: the downloader middleware of the crawl's politeness (see
:mod:`.politeness`). A 429 (or a 503 with ``Retry-After``) pauses the request's download
slot for every worker, durable before the request is retried; robots.txt's ``Crawl-delay``
is kept as the slot's delay."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._retry_after import retry_after_seconds
from .config import config_for
from .crawl import idempotent_scheduler
from .robots import CrawlRobotsTxtMiddleware
from .scrapy_compat import start_failure_exits_nonzero

if TYPE_CHECKING:
    from scrapy import Request
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from typing_extensions import Self

    from .politeness import Politeness

__all__ = ["BACKOFF_PRIORITY", "THROTTLED_META", "THROTTLED_RETRIES", "SlotBackoffMiddleware",
           "throttled"]

#: A request throttled this many times in a row goes on to RetryMiddleware (which counts
#: RETRY_TIMES) instead of being retried once more after the pause.
THROTTLED_RETRIES = 10
#: Between RetryMiddleware (550) and RedirectMiddleware (600): it sees a 429 or 503 before
#: RetryMiddleware does (process_response runs from the highest number down).
BACKOFF_PRIORITY = 560
#: meta key: how many times the request was throttled (retried after a 429 or 503)
THROTTLED_META = "idempotent_throttled"


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

            engine = self.crawler.engine
            middlewares = getattr(getattr(getattr(engine, "downloader", None), "middleware",
                                          None), "middlewares", ())
            robots = self._robots = next(
                (mw for mw in middlewares
                 if isinstance(mw, (CrawlRobotsTxtMiddleware, RobotsTxtMiddleware))), False)
        if not robots:
            return None
        from scrapy.utils.httpobj import urlparse_cached

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
