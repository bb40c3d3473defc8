"""Conditional requests: a later run asks the site whether a page changed since it was last
done, and a ``304 Not Modified`` completes the page as unchanged (see ``docs/recrawls.rst``).

:class:`ConditionalRequestMiddleware` (a downloader middleware, priority 940, on with
:setting:`IDEMPOTENT_CONDITIONAL_REQUESTS`) sends a leased request whose page has validators
(loaded with its claim) with ``If-None-Match`` / ``If-Modified-Since``, keeps the validators of
each 2xx answer for the page's commit, and turns a 304 to its own conditional request into
an answer no callback or errback sees: the page's in-flight entry is marked not modified,
and its commit marks the stored records seen and enqueues the page's requests again.

Beside Scrapy's ``HttpCacheMiddleware`` (900, nearer the engine): a response the cache
answers never reaches the site, so nothing is sent conditionally; a request the cache made
conditional itself (its own validators) is left alone, and the 304 is the cache's to
answer; the 304 this middleware asked for is marked ``dont_cache`` so that no cache policy
stores it as the page.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from scrapy import Request, signals
from scrapy.exceptions import NotConfigured
from scrapy.http import Response

from .config import config_for
from .crawl import inflight_tracker
from .scrapy_compat import start_failure_exits_nonzero, stat_counter
from .store.base import PageValidators

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable

    from scrapy import Spider
    from scrapy.crawler import Crawler
    from typing_extensions import Self

    from .inflight import InflightTracker
    from .inflight_entries import InflightRequest

__all__ = ["CONDITIONAL_META_KEY", "CONDITIONAL_PRIORITY", "LASTMOD_META_KEY",
           "SITEMAP_PRIORITY", "ConditionalRequestMiddleware", "SitemapLastmodMiddleware",
           "not_modified_since"]

logger = logging.getLogger(__name__)

#: Its place among the downloader middlewares: after Scrapy's HttpCacheMiddleware (900), so
#: a cached answer is the cache's, and before ResponseJournalMiddleware (950), so a replayed
#: 304 is recognised as the answer to this middleware's conditional request.
CONDITIONAL_PRIORITY = 940
#: ``request.meta`` key: ``False`` sends the request without validators (its callback always
#: runs).
CONDITIONAL_META_KEY = "idempotent_conditional"
#: ``request.meta`` key: the ``lastmod`` of the sitemap entry the request was made from (set
#: by :class:`SitemapLastmodMiddleware`, stored with the request).
LASTMOD_META_KEY = "idempotent_lastmod"

#: Its place among the spider middlewares: nearest the spider, so it tags the requests of a
#: sitemap's callback before any other middleware sees them.
SITEMAP_PRIORITY = 990

_IF_NONE_MATCH = b"If-None-Match"
_IF_MODIFIED_SINCE = b"If-Modified-Since"


def page_validators(response: Response) -> PageValidators:
    """The validators ``response`` carries (text as sent) and its body's sha256."""
    etag = response.headers.get(b"ETag")
    last_modified = response.headers.get(b"Last-Modified")
    return PageValidators(
        etag=etag.decode("latin-1") if etag else None,
        last_modified=last_modified.decode("latin-1") if last_modified else None,
        body_hash=hashlib.sha256(response.body).hexdigest(), body_bytes=len(response.body))


def not_modified_since(lastmod: Any, fetched_at: float) -> bool:
    """Whether a sitemap's ``lastmod`` (W3C datetime: a date, or a date and time, UTC when
    it names no zone) says the page did not change after ``fetched_at`` (unix seconds). A
    date alone stands for the end of that day; a coarser value (a year, a month) or one that
    is not a date says nothing."""
    if not isinstance(lastmod, str) or not lastmod or fetched_at <= 0:
        return False
    text = lastmod.strip()
    if len(text) < 10:  # a year, a month: too coarse to tell
        return False
    try:
        if len(text) == 10:  # a date: changed up to its end
            day = datetime.date.fromisoformat(text)
            changed = datetime.datetime.combine(day + datetime.timedelta(days=1),
                                                datetime.time(), datetime.timezone.utc)
        else:
            changed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
            if changed.tzinfo is None:
                changed = changed.replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return False
    return changed.timestamp() <= fetched_at


def _not_modified_callback(response: Response, **kwargs: Any) -> None:
    """The callback of a page answered 304 to its conditional request: nothing to parse (the
    page's commit stores what it stands for)."""
    return None


class ConditionalRequestMiddleware:
    """Downloader middleware: conditional requests for pages done before (see the module
    docstring)."""

    def __init__(self, crawler: Crawler, *, sitemap_lastmod: bool = True) -> None:
        self.crawler = crawler
        self.sitemap_lastmod = sitemap_lastmod  #: IDEMPOTENT_SITEMAP_LASTMOD
        self._count = stat_counter(crawler.stats)
        self._tracker: InflightTracker | None = None

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        if crawler.spider is None:  # built outside a crawl (Scrapy's own tests)
            raise NotConfigured
        with start_failure_exits_nonzero(crawler):
            config = config_for(crawler)
        if not config.conditional_requests:  # (off by default: no warning for it)
            raise NotConfigured
        return cls(crawler, sitemap_lastmod=config.sitemap_lastmod)

    def _entry(self, request: Request) -> InflightRequest | None:
        if self._tracker is None:
            self._tracker = inflight_tracker(self.crawler, type(self).__name__)
        return self._tracker.for_request(request) if self._tracker is not None else None

    # ``spider``: Scrapy 2.13 passes it; later releases do not (see :mod:`.scrapy_compat`).
    def process_request(self, request: Request,
                        spider: Spider | None = None) -> Response | None:
        entry = self._entry(request)
        if entry is None or entry.validators is None:
            return None
        if request.meta.get(CONDITIONAL_META_KEY, True) is False:
            return None
        if not entry.validators.due:
            # adaptive revisits: its interval has not passed since it was last fetched or
            # confirmed; it stands unchanged for this run without a request
            entry.not_due = True
            self._count("idempotent/revisit/not_due")
            return self._not_modified(entry, request, Response(
                request.url, status=304, request=request, flags=["not_due"]))
        if self.sitemap_lastmod and not_modified_since(request.meta.get(LASTMOD_META_KEY),
                                                       entry.validators.fetched_at):
            # the sitemap says the page did not change since it was fetched: not fetched
            self._count("idempotent/sitemap/skipped")
            return self._not_modified(entry, request, Response(
                request.url, status=304, request=request, flags=["sitemap"]))
        if not entry.validators.usable:
            return None
        headers = request.headers
        if _IF_NONE_MATCH in headers or _IF_MODIFIED_SINCE in headers:
            return None  # made conditional by someone else (HttpCacheMiddleware): theirs
        if entry.validators.etag is not None:
            headers[_IF_NONE_MATCH] = entry.validators.etag
        if entry.validators.last_modified is not None:
            headers[_IF_MODIFIED_SINCE] = entry.validators.last_modified
        entry.conditional = True
        self._count("idempotent/conditional/sent")
        return None

    def process_response(self, request: Request, response: Response,
                         spider: Spider | None = None) -> Response:
        entry = self._entry(request)
        if entry is None:
            return response
        if entry.conditional:
            # a redirect or retry made from this request is not conditional
            request.headers.pop(_IF_NONE_MATCH, None)
            request.headers.pop(_IF_MODIFIED_SINCE, None)
            if response.status == 304:
                return self._not_modified(entry, request, response)
        if 200 <= response.status < 300:
            entry.answered = page_validators(response)
        return response

    def _not_modified(self, entry: InflightRequest, request: Request,
                      response: Response) -> Response:
        entry.not_modified = True
        if "sitemap" not in response.flags and "not_due" not in response.flags:
            self._count("idempotent/conditional/not_modified")
        assert entry.validators is not None
        if entry.validators.body_bytes:
            self._count("idempotent/revisit/bytes_saved", entry.validators.body_bytes)
        request.meta["dont_cache"] = True  # no cache policy stores the 304 as the page
        # the response goes on with a request of its own: no callback or errback of the
        # spider's sees it, nor HttpErrorMiddleware (a 304 is not an error here)
        answered = request.replace(callback=_not_modified_callback, errback=None,
                                   meta={**request.meta, "handle_httpstatus_all": True})
        return response.replace(request=answered)


class SitemapLastmodMiddleware:
    """Spider middleware: the requests a ``SitemapSpider`` makes from a sitemap's entries
    carry the entry's ``lastmod`` (meta ``idempotent_lastmod``, stored with the request), so
    that a later run skips a page the sitemap says did not change since it was fetched
    (:class:`ConditionalRequestMiddleware`). The ``lastmod`` values are read through the
    spider's ``sitemap_filter`` (wrapped when the spider opens) and held only while that
    sitemap's output is handed on."""

    def __init__(self, crawler: Crawler) -> None:
        self.crawler = crawler
        self._lastmod: dict[str, str] = {}
        crawler.signals.connect(self._spider_opened, signal=signals.spider_opened)

    @classmethod
    def from_crawler(cls, crawler: Crawler) -> Self:
        if crawler.spider is None:  # built outside a crawl (Scrapy's own tests)
            raise NotConfigured
        with start_failure_exits_nonzero(crawler):
            config = config_for(crawler)
        if not (config.conditional_requests and config.sitemap_lastmod):
            raise NotConfigured
        return cls(crawler)

    def _spider_opened(self, spider: Spider) -> None:
        from scrapy.spiders import SitemapSpider

        if not isinstance(spider, SitemapSpider):
            return
        entries_of = spider.sitemap_filter
        lastmod = self._lastmod

        def sitemap_filter(entries: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
            for entry in entries_of(entries):
                if entry.get("lastmod") and entry.get("loc"):
                    lastmod[entry["loc"]] = entry["lastmod"]
                yield entry

        spider.sitemap_filter = sitemap_filter  # type: ignore[method-assign]

    async def process_spider_output(self, response: Response, result: AsyncIterator[Any],
                                    spider: Spider | None = None) -> AsyncIterator[Any]:
        tagged = False
        try:
            async for output in result:
                if self._lastmod and isinstance(output, Request):
                    lastmod = self._lastmod.pop(output.url, None)
                    if lastmod is not None:
                        output.meta.setdefault(LASTMOD_META_KEY, lastmod)
                        tagged = True
                yield output
        finally:
            if tagged:  # a sitemap's output: forget its entries no rule took
                self._lastmod.clear()
