"""``CrawlRobotsTxtMiddleware``: robots.txt fetched once per site for the crawl, obeyed by
every request of every worker and every resume.

Scrapy's ``RobotsTxtMiddleware`` keeps each site's robots.txt in its process: every resume and
every worker fetches it again, and in Scrapy 2.14 to 2.19 only the first of the requests that
wait for it together gets the parsed rules (the others share one Deferred whose first awaiter
takes its result, ``RobotsTxtMiddleware.robot_parser``), so they are downloaded as if
allowed: a killed and resumed crawl, which starts many requests of a site at once, fetched
pages robots.txt disallows. With ``ROBOTSTXT_OBEY = True`` the add-on puts
:class:`CrawlRobotsTxtMiddleware` in its place, at its priority:

* a request of a site (Scrapy's key: the URL's host and port) waits in the middleware until
  the site's rules are in memory, and every waiting request is then judged by them: a
  disallowed one raises ``IgnoreRequest`` ("Forbidden by robots.txt", stat
  ``robotstxt/forbidden``) before anything is sent, and ends ``failed`` with kind
  ``ignored/IgnoreRequest`` as with Scrapy's middleware;
* the rules come from the crawl's database when a worker kept them there less than
  ``IDEMPOTENT_ROBOTSTXT_MAX_AGE_SECONDS`` ago; else robots.txt is fetched (Scrapy's request:
  priority 1000, ``dont_obey_robotstxt``, through every downloader middleware, retries and
  redirects included), kept in the database, and applied;
* answers (see :func:`rules_body`): a 2xx is parsed with ``ROBOTSTXT_PARSER``; a 4xx allows
  everything (RFC 9309, 2.3.1.3) and is kept too; a 5xx or a network error (after Scrapy's
  retries) is Scrapy's behaviour (the 5xx body parsed, which is an allow-all for an error
  page; nothing disallowed after an error) for this process only and is not kept, so the
  next worker or resume asks again;
* two workers that fetch one site's robots.txt at the same moment both keep it; the first
  one stored wins and both apply that one (:meth:`~.FrontierStore.keep_robots_txt`).

``dont_obey_robotstxt`` meta, ``data:`` and ``file:`` URLs are not judged, as in Scrapy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from scrapy import signals
from scrapy.exceptions import IgnoreRequest, NotConfigured
from scrapy.http import Request
from scrapy.http.request import NO_CALLBACK
from scrapy.utils.defer import maybe_deferred_to_future
from scrapy.utils.httpobj import urlparse_cached
from scrapy.utils.misc import build_from_crawler, load_object
from twisted.internet.defer import Deferred

from .crawl import store_call

if TYPE_CHECKING:
    from scrapy.crawler import Crawler
    from scrapy.http import Response
    from scrapy.robotstxt import RobotParser
    from scrapy.statscollectors import StatsCollector
    from typing_extensions import Self

    from .store.base import FrontierStore, RobotsTxt

__all__ = ["ROBOTS_DOWNLOAD_PRIORITY", "CrawlRobotsTxtMiddleware", "rules_body"]

logger = logging.getLogger(__name__)

#: The priority of robots.txt's own request (Scrapy's ``RobotsTxtMiddleware.DOWNLOAD_PRIORITY``)
ROBOTS_DOWNLOAD_PRIORITY = 1000


def rules_body(status: int, body: bytes) -> bytes | None:
    """What a robots.txt answer with ``status`` says, as the body to parse: a 4xx (no
    robots.txt, or one refused) allows everything (RFC 9309, 2.3.1.3: an empty file); every
    other answer's body as received (a 2xx is the file; a 5xx, as in Scrapy, whatever its
    page says). None when the answer is not kept for the crawl (a 5xx: the site could not
    answer now, the next worker or resume asks again)."""
    if 400 <= status < 500:
        return b""
    if status >= 500:
        return None
    return body


class _Rules:
    """A site's rules in memory: the parser (None: everything allowed) until when (the
    monotonic clock of this process: a duration since the rules were fetched)."""

    __slots__ = ("parser", "until")

    def __init__(self, parser: RobotParser | None, until: float) -> None:
        self.parser = parser
        self.until = until


class CrawlRobotsTxtMiddleware:
    """Downloader middleware in place of Scrapy's ``RobotsTxtMiddleware`` (see the module
    docstring); ``NotConfigured`` without ``ROBOTSTXT_OBEY``. Outside a crawl with the
    package's scheduler it keeps the rules in memory only (Scrapy's behaviour, without the
    waiting requests let through)."""

    def __init__(self, crawler: Crawler, *, max_age_seconds: float) -> None:
        settings = crawler.settings
        self.crawler = crawler
        assert crawler.stats is not None
        self.stats: StatsCollector = crawler.stats
        self.max_age_seconds = max_age_seconds
        self.default_useragent: str = settings["USER_AGENT"]
        self.robotstxt_useragent: str | None = settings["ROBOTSTXT_USER_AGENT"]
        self.parser_class: Any = load_object(settings.get("ROBOTSTXT_PARSER"))
        # the parser's dependencies are checked at start, as Scrapy does
        build_from_crawler(self.parser_class, crawler, b"")
        self._rules: dict[str, _Rules] = {}
        #: sites whose rules are being looked up: the Deferreds of the requests waiting
        self._waiting: dict[str, list[Deferred[RobotParser | None]]] = {}

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        if not crawler.settings.getbool("ROBOTSTXT_OBEY"):
            raise NotConfigured
        from .config import config_for
        from .scrapy_compat import start_failure_exits_nonzero

        with start_failure_exits_nonzero(crawler):
            max_age = config_for(crawler).robotstxt_max_age_seconds
        return cls(crawler, max_age_seconds=max_age)

    # -- judging requests -----------------------------------------------------------------

    async def process_request(self, request: Request, spider: Any = None) -> None:
        if request.meta.get("dont_obey_robotstxt"):
            return
        if request.url.startswith(("data:", "file:")):
            return
        parser = await self.rules_for(request)
        if parser is not None and not parser.allowed(request.url, self.useragent_of(request)):
            logger.debug("Forbidden by robots.txt: %(request)s", {"request": request},
                         extra={"spider": self.crawler.spider})
            self.stats.inc_value("robotstxt/forbidden")
            raise IgnoreRequest("Forbidden by robots.txt")

    def useragent_of(self, request: Request) -> str | bytes:
        """The user agent robots.txt's groups are matched against (Scrapy's rule:
        ``ROBOTSTXT_USER_AGENT``, else the request's ``User-Agent``, else ``USER_AGENT``)."""
        if self.robotstxt_useragent:
            return self.robotstxt_useragent
        found: str | bytes | None = request.headers.get(b"User-Agent", self.default_useragent)
        return found if found is not None else self.default_useragent

    def parser_of(self, netloc: str) -> RobotParser | None:
        """The parsed robots.txt of ``netloc`` if in memory now (None: unknown yet, or
        everything allowed)."""
        rules = self._rules.get(netloc)
        return rules.parser if rules is not None else None

    async def rules_for(self, request: Request) -> RobotParser | None:
        """The parser of ``request``'s site (None: everything allowed), once known: from
        memory, else looked up once for every request that waits for it meanwhile."""
        netloc = urlparse_cached(request).netloc
        rules = self._rules.get(netloc)
        if rules is not None and rules.until > time.monotonic():
            return rules.parser
        waiting = self._waiting.get(netloc)
        if waiting is not None:
            # each waiting request gets a Deferred of its own: one shared Deferred would give
            # its result to the first awaiter only (Scrapy 2.19's RobotsTxtMiddleware)
            mine: Deferred[RobotParser | None] = Deferred()
            waiting.append(mine)
            return await maybe_deferred_to_future(mine)
        self._waiting[netloc] = []
        try:
            parser, lifetime = await self._look_up(request, netloc)
        except BaseException as exc:
            # never "allowed" for want of rules: every waiting request fails with this one
            for waiter in self._waiting.pop(netloc):
                waiter.errback(exc)
            raise
        self._rules[netloc] = _Rules(parser, time.monotonic() + lifetime)
        for waiter in self._waiting.pop(netloc):
            waiter.callback(parser)
        return parser

    # -- looking rules up -----------------------------------------------------------------

    async def _look_up(self, request: Request, netloc: str) -> tuple[RobotParser | None, float]:
        """The site's parser and how long (seconds) it may be used from now: the crawl's
        robots.txt when one is kept and young enough, else fetched now (and kept)."""
        kept = await self._call("reading a site's robots.txt",
                                lambda store: store.robots_txt(netloc))
        if kept is not None and kept.age_seconds < self.max_age_seconds:
            self.stats.inc_value("idempotent/robotstxt/read")
            logger.debug("scrapy_idempotent: robots.txt of %s read from the crawl's database "
                         "(fetched %.0f s ago)", netloc, kept.age_seconds)
            return (await self._parse(kept.body, request),
                    self.max_age_seconds - kept.age_seconds)
        url = urlparse_cached(request)
        robots_request = Request(f"{url.scheme}://{netloc}/robots.txt",
                                 priority=ROBOTS_DOWNLOAD_PRIORITY,
                                 meta={"dont_obey_robotstxt": True}, callback=NO_CALLBACK)
        self.stats.inc_value("robotstxt/request_count")
        try:
            response = await self._download(robots_request)
        except IgnoreRequest:  # another middleware refused it: nothing to obey
            return None, self.max_age_seconds
        except Exception as exc:
            logger.error("Error downloading %s: %s", robots_request, exc, exc_info=True,
                         extra={"spider": self.crawler.spider})  # Scrapy's line
            self.stats.inc_value(f"robotstxt/exception_count/{type(exc)}")
            return None, self.max_age_seconds  # Scrapy's behaviour, in this process only
        self.stats.inc_value("robotstxt/response_count")
        self.stats.inc_value(f"robotstxt/response_status_count/{response.status}")
        body = rules_body(response.status, response.body)
        if body is None:  # a 5xx: Scrapy's behaviour, in this process only
            return await self._parse(response.body, request), self.max_age_seconds
        kept = await self._call(
            "keeping a site's robots.txt",
            lambda store: store.keep_robots_txt(netloc, response.url, response.status, body,
                                                max_age_seconds=self.max_age_seconds))
        if kept is None:  # not a crawl with the package's store: this process's rules
            return await self._parse(body, request), self.max_age_seconds
        self.stats.inc_value("idempotent/robotstxt/kept")
        logger.debug("scrapy_idempotent: robots.txt of %s fetched (%d) and kept for the "
                     "crawl", netloc, response.status)
        return (await self._parse(kept.body, request),
                self.max_age_seconds - kept.age_seconds)

    async def _call(self, what: str,
                    action: Callable[[FrontierStore], RobotsTxt | None]) -> RobotsTxt | None:
        """``action(store)`` on the crawl's writer thread; None outside a crawl with the
        package's store, or when the store cannot be used (logged: the rules are then this
        process's own, fetched again)."""
        try:
            calling = store_call(self.crawler, type(self).__name__, what, action)
            if calling is None:
                return None
            result: RobotsTxt | None = await maybe_deferred_to_future(calling)
        except Exception as exc:
            logger.warning("scrapy_idempotent: robots.txt not shared with the crawl (%s "
                           "failed: %s); this process fetches and obeys its own", what, exc)
            return None
        return result

    async def _download(self, request: Request) -> Response:
        engine: Any = self.crawler.engine
        download_async = getattr(engine, "download_async", None)
        if download_async is not None:  # Scrapy 2.14
            response: Response = await download_async(request)
            return response
        return await maybe_deferred_to_future(engine.download(request))

    async def _parse(self, body: bytes, request: Request) -> RobotParser:
        parser: RobotParser = build_from_crawler(self.parser_class, self.crawler, body)
        robots_parsed = getattr(signals, "robots_parsed", None)  # Scrapy 2.14
        if robots_parsed is None:
            return parser
        send = getattr(self.crawler.signals, "send_catch_log_async", None)
        if send is not None:  # Scrapy 2.14
            await send(signal=robots_parsed, robotparser=parser, request=request)
        else:
            await maybe_deferred_to_future(self.crawler.signals.send_catch_log_deferred(
                signal=robots_parsed, robotparser=parser, request=request))
        return parser
