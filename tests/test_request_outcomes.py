"""How a request ends inside Scrapy, each as a real crawl of the local site: success, callback
errors, download errors, HTTP errors, retries, and requests ignored (robots.txt, offsite,
depth). Redirects, item pipelines, requests through the store and closing early have files of
their own.

Whatever happens to a request, the frontier must end with it in the right terminal state:
no lease dangles, no crawl hangs, no request or record is lost silently, and records are
stored exactly once. Each test runs real crawls in this process against the local site
(``site`` fixture) and then checks the frontier rows (``url, state, error_kind, attempts``),
that nothing is left ``leased``, the close reason, the records stored and the
``idempotent/...`` stats (helpers in ``helpers/site_crawls.py``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

import pytest
import scrapy
from local_site import LocalSite, free_port
from scrapy.downloadermiddlewares.retry import get_retry_request
from scrapy.utils.defer import deferred_f_from_coro_f

from helpers.site_crawls import (
    LinksSpider,
    PathSpider,
    assert_nothing_leased,
    crawl,
    finish_reason,
    frontier,
    istats,
    path_of,
    record_owner,
    records,
    settings,
)

# -- success ------------------------------------------------------------------------------------


@deferred_f_from_coro_f
async def test_success_items_and_requests_and_a_page_without_items(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(LinksSpider, settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/ok/home?links=/ok/a,/ok/b,/ok/empty": ("done", None, 1),
        "/ok/a": ("done", None, 1),
        "/ok/b": ("done", None, 1),
        "/ok/empty": ("done", None, 1),  # no items: done all the same
    }
    assert_nothing_leased(crawl_database)
    assert set(records(crawl_database)) == {"/ok/home?links=/ok/a,/ok/b,/ok/empty", "/ok/a",
                                            "/ok/b"}
    assert record_owner(crawl_database, site)["/ok/a"] == "/ok/a"
    stats = istats(crawler)
    assert stats["requests/done"] == 4
    assert stats["requests/leased"] == 4
    assert stats["records/inserted"] == 3
    assert "requests/failed" not in stats
    assert site.counts_by_path() == {"/ok/home": 1, "/ok/a": 1, "/ok/b": 1, "/ok/empty": 1}


class SlowPipeline:
    """An ``async def process_item`` before ours: items lag behind the callback. The last
    item of ``/ok/many`` waits until that callback's output is exhausted: Scrapy 2.14 and
    later read a callback's output ahead of the pipelines anyway, 2.13 reads it at their
    pace (``CONCURRENT_ITEMS`` at a time), so without the wait its items would not lag."""

    finished: ClassVar[dict[str, float]] = {}

    async def process_item(self, item: Any, spider: Any = None) -> Any:
        await asyncio.sleep(0.05)
        while item["key"] == "many-11" and InterleavedSpider.ended is None:
            await asyncio.sleep(0.01)  # another item worker finishes reading the callback
        SlowPipeline.finished[item["key"]] = time.monotonic()
        return item


class InterleavedSpider(PathSpider):
    """``/ok/many`` yields 12 items and 12 requests interleaved; each child yields 1 item."""

    #: When the callback of ``/ok/many`` ran out of output (``time.monotonic()``).
    ended: ClassVar[float | None] = None

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/many"), callback=self.parse_many)

    def parse_many(self, response: Any) -> Any:
        for i in range(12):
            yield {"key": f"many-{i}"}
            yield response.follow(f"/ok/child{i}", callback=self.parse_child)
        InterleavedSpider.ended = time.monotonic()  # the callback's output is exhausted

    def parse_child(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_interleaved_items_and_requests_with_a_slow_pipeline(
    site: LocalSite, crawl_database: str
) -> None:
    SlowPipeline.finished.clear()
    InterleavedSpider.ended = None
    crawler = await crawl(InterleavedSpider, settings(
        crawl_database, CONCURRENT_ITEMS=2, ITEM_PIPELINES={f"{__name__}.SlowPipeline": 100},
    ), url=site.url)
    assert finish_reason(crawler) == "finished"
    # the items of /ok/many really lagged behind its callback
    ended = InterleavedSpider.ended
    assert ended is not None and SlowPipeline.finished["many-11"] > ended
    expected_rows = {"/ok/many": ("done", None, 1)}
    expected_rows.update({f"/ok/child{i}": ("done", None, 1) for i in range(12)})
    assert frontier(crawl_database, site) == expected_rows
    assert_nothing_leased(crawl_database)
    owners = record_owner(crawl_database, site)
    assert len(owners) == 24
    for i in range(12):
        assert owners[f"many-{i}"] == "/ok/many"  # stored with the page that produced it
        assert owners[f"/ok/child{i}"] == f"/ok/child{i}"
    stats = istats(crawler)
    assert stats["records/inserted"] == 24
    assert stats["requests/done"] == 13
    assert stats["requests/leased"] == 13
    assert "requests/repeated" not in stats
    assert crawler.stats.get_value("item_scraped_count") == 24
    assert all(n == 1 for n in site.counts_by_path().values())
    assert site.request_count == 13


# -- callback errors ------------------------------------------------------------------------


class CallbackErrorSpider(PathSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/raise-now"), callback=self.parse_raise_now)
        yield scrapy.Request(self.at("/ok/raise-first"), callback=self.parse_raise_first)
        yield scrapy.Request(self.at("/ok/raise-midway"), callback=self.parse_raise_midway)
        yield scrapy.Request(self.at("/ok/raise-async"), callback=self.parse_async_midway)

    def parse_raise_now(self, response: Any) -> Any:
        raise KeyError("no such thing")  # a plain function: raises when called

    def parse_raise_first(self, response: Any) -> Any:
        if response.status == 200:
            raise ValueError("before the first yield")
        yield {"key": "never"}

    def parse_raise_midway(self, response: Any) -> Any:
        yield {"key": "midway-1"}
        yield response.follow("/ok/before-raise", callback=self.parse_child)
        yield {"key": "midway-2"}
        raise RuntimeError("midway")

    async def parse_async_midway(self, response: Any) -> Any:
        yield {"key": "async-midway-1"}
        await asyncio.sleep(0.01)
        raise LookupError("async midway")

    def parse_child(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_callback_raising_before_its_first_yield_and_midway(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(CallbackErrorSpider, settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/ok/raise-now": ("failed", "spider_error/KeyError", 1),
        "/ok/raise-first": ("failed", "spider_error/ValueError", 1),
        "/ok/raise-midway": ("failed", "spider_error/RuntimeError", 1),
        "/ok/raise-async": ("failed", "spider_error/LookupError", 1),
        "/ok/before-raise": ("done", None, 1),  # yielded before the raise: kept
    }
    assert_nothing_leased(crawl_database)
    # what was yielded before the raise is stored, with the request that produced it
    assert record_owner(crawl_database, site) == {
        "midway-1": "/ok/raise-midway", "midway-2": "/ok/raise-midway",
        "async-midway-1": "/ok/raise-async", "/ok/before-raise": "/ok/before-raise",
    }
    stats = istats(crawler)
    assert stats["requests/failed"] == 4
    assert stats["failed/spider_error/KeyError"] == 1
    assert stats["failed/spider_error/ValueError"] == 1
    assert stats["failed/spider_error/RuntimeError"] == 1
    assert stats["failed/spider_error/LookupError"] == 1
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 4
    assert all(n == 1 for n in site.counts_by_path().values())


# -- download errors --------------------------------------------------------------------------


class DownloadErrorSpider(PathSpider):
    """One request that fails to download (``target``), one that works; an errback that
    yields a failure item, when ``use_errback``."""

    def __init__(self, url: str, target: str, use_errback: bool, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.target = target
        self.use_errback = use_errback
        self.errback_calls: list[str] = []
        self.errback_items: list[dict[str, Any]] = []

    async def start(self) -> Any:
        yield scrapy.Request(self.target, callback=self.parse,
                             errback=self.on_error if self.use_errback else None)
        yield scrapy.Request(self.at("/ok/control"))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response)}

    def on_error(self, failure: Any) -> Any:
        self.errback_calls.append(type(failure.value).__name__)
        item = {"key": f"failure:{failure.request.url}", "error": type(failure.value).__name__}
        self.errback_items.append(item)
        yield item
        yield scrapy.Request(self.at("/ok/fallback"))  # errback children reach the frontier


@pytest.mark.parametrize("use_errback", [False, True], ids=["no-errback", "errback"])
@pytest.mark.parametrize(("kind", "error"), [
    ("refused", "DownloadConnectionRefusedError"),
    ("reset", None),
    ("timeout", "DownloadTimeoutError"),
])
@deferred_f_from_coro_f
async def test_download_error_ends_failed_after_its_retries(
    site: LocalSite, crawl_database: str, kind: str, error: str | None, use_errback: bool
) -> None:
    target = {
        "refused": f"http://127.0.0.1:{free_port()}/ok/nobody-home",
        "reset": f"{site.url}/reset/x",
        "timeout": f"{site.url}/slow/1.5/x",
    }[kind]
    crawler = await crawl(DownloadErrorSpider, settings(
        crawl_database, RETRY_ENABLED=True, RETRY_TIMES=1, DOWNLOAD_TIMEOUT=0.5,
    ), url=site.url, target=target, use_errback=use_errback)
    spider = crawler.spider
    assert finish_reason(crawler) == "finished"
    found = {url if "://" in url else site.url + url: state
             for url, state in frontier(crawl_database, site).items()}
    state, error_kind, attempts = found[target]
    assert state == "failed"
    assert error_kind is not None and error_kind.startswith("download_error/")
    if error is not None:
        assert error_kind == f"download_error/{error}"
    assert attempts == 2  # RETRY_TIMES=1: one retry, the same entry continued
    assert found[f"{site.url}/ok/control"] == ("done", None, 1)
    if use_errback:
        assert found[f"{site.url}/ok/fallback"] == ("done", None, 1)
    assert len(found) == (3 if use_errback else 2)
    assert_nothing_leased(crawl_database)
    stats = istats(crawler)
    assert stats["requests/failed"] == 1
    assert stats[f"failed/{error_kind}"] == 1
    assert stats["requests/retried"] == 1
    assert stats["requests/continued"] == 1
    assert stats["requests/leased"] == (4 if use_errback else 3)
    assert stats["requests/repeated"] == 1
    assert crawler.stats.get_value("retry/count") == 1
    stored = records(crawl_database)
    if use_errback:
        # the errback runs once per final failure; its item bypassed the spider
        # middlewares, still got a record ID and is stored with the failed request
        assert len(spider.errback_calls) == 1
        failure_key = f"failure:{target}"
        assert set(stored) == {"/ok/control", "/ok/fallback", failure_key}
        assert stored[failure_key]["error"] == spider.errback_calls[0]
        assert len(spider.errback_items[0]["record_id"]) == 32
        owners = record_owner(crawl_database, site)
        assert owners[failure_key] in (target, target.removeprefix(site.url))
        assert stats["records/inserted"] == 3
    else:
        assert set(stored) == {"/ok/control"}
        assert stats["records/inserted"] == 1
    if kind != "refused":
        assert site.hits(target.removeprefix(site.url)) == 2


class ErrbackRetrySpider(PathSpider):
    """The errback retries the failed request itself (``get_retry_request``, at most 2
    times) and yields a failure item when it gives up."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.errback_calls = 0

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/reset/eb"), errback=self.on_error)

    def on_error(self, failure: Any) -> Any:
        self.errback_calls += 1
        retry = get_retry_request(failure.request, spider=self, reason="errback",
                                  max_retry_times=2)
        if retry is not None:
            yield retry
        else:
            yield {"key": "gave-up", "calls": self.errback_calls}


@deferred_f_from_coro_f
async def test_errback_retrying_its_request_continues_the_same_entry(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(ErrbackRetrySpider, settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    [(state, error_kind, attempts)] = frontier(crawl_database, site).values()
    assert (state, attempts) == ("failed", 3)
    assert error_kind is not None and error_kind.startswith("download_error/")
    assert_nothing_leased(crawl_database)
    assert crawler.spider.errback_calls == 3
    assert site.hits("/reset/eb") == 3
    assert record_owner(crawl_database, site) == {"gave-up": "/reset/eb"}
    stats = istats(crawler)
    assert stats["requests/retried"] == 2
    assert stats["requests/continued"] == 2
    assert stats["requests/failed"] == 1
    assert stats["records/inserted"] == 1
    assert crawler.dropped_urls == []


# -- HTTP errors ---------------------------------------------------------------------------


class HttpErrorSpider(PathSpider):
    def __init__(self, url: str, path: str, use_errback: bool,
                 meta: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.path = path
        self.use_errback = use_errback
        self.meta = meta or {}
        self.errback_calls: list[int] = []

    async def start(self) -> Any:
        yield scrapy.Request(self.at(self.path), meta=self.meta,
                             errback=self.on_error if self.use_errback else None)

    def parse(self, response: Any) -> Any:
        yield {"key": f"page:{path_of(response)}", "status": response.status}

    def on_error(self, failure: Any) -> Any:
        status = failure.value.response.status
        self.errback_calls.append(status)
        yield {"key": f"failure:{path_of(failure.value.response)}", "status": status}


@pytest.mark.parametrize("use_errback", [False, True], ids=["no-errback", "errback"])
@pytest.mark.parametrize("code", [404, 500])
@deferred_f_from_coro_f
async def test_http_error_ends_failed(
    site: LocalSite, crawl_database: str, code: int, use_errback: bool
) -> None:
    path = f"/status/{code}/x"
    crawler = await crawl(HttpErrorSpider, settings(
        crawl_database, RETRY_ENABLED=True, RETRY_TIMES=1,
    ), url=site.url, path=path, use_errback=use_errback)
    assert finish_reason(crawler) == "finished"
    attempts = 2 if code == 500 else 1  # 500 is retried once, 404 is not
    assert frontier(crawl_database, site) == {path: ("failed", "http_status", attempts)}
    assert_nothing_leased(crawl_database)
    assert site.hits(path) == attempts
    stats = istats(crawler)
    assert stats["requests/failed"] == 1
    assert stats["failed/http_status"] == 1
    assert "requests/done" not in stats
    if use_errback:
        assert crawler.spider.errback_calls == [code]
        assert set(records(crawl_database)) == {f"failure:{path}"}
        assert record_owner(crawl_database, site) == {f"failure:{path}": path}
        assert stats["records/inserted"] == 1
    else:
        assert records(crawl_database) == {}
        assert "records/inserted" not in stats


class HandleStatusSpider(HttpErrorSpider):
    handle_httpstatus_list = (404,)


@pytest.mark.parametrize("how", ["setting", "spider", "meta-list", "meta-all"])
@deferred_f_from_coro_f
async def test_http_error_allowed_by_httperror_allowed_codes_is_done(
    site: LocalSite, crawl_database: str, how: str
) -> None:
    path = "/status/404/allowed"
    extra: dict[str, Any] = {"HTTPERROR_ALLOWED_CODES": [404]} if how == "setting" else {}
    meta = {"meta-list": {"handle_httpstatus_list": [404]},
            "meta-all": {"handle_httpstatus_all": True}}.get(how)
    spidercls = HandleStatusSpider if how == "spider" else HttpErrorSpider
    crawler = await crawl(spidercls, settings(crawl_database, **extra), url=site.url, path=path,
                          use_errback=True, meta=meta)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {path: ("done", None, 1)}
    assert_nothing_leased(crawl_database)
    assert records(crawl_database)[f"page:{path}"]["status"] == 404
    assert crawler.spider.errback_calls == []
    stats = istats(crawler)
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1
    assert "requests/failed" not in stats


# -- retries --------------------------------------------------------------------------------


@deferred_f_from_coro_f
async def test_retry_middleware_503_then_200_continues_the_same_entry(
    site: LocalSite, crawl_database: str
) -> None:
    path = "/flaky/1/x"
    crawler = await crawl(LinksSpider, settings(crawl_database, RETRY_ENABLED=True, RETRY_TIMES=2),
                          url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {path: ("done", None, 2)}  # one row, attempts 2
    assert_nothing_leased(crawl_database)
    assert set(records(crawl_database)) == {path}
    assert site.hits(path) == 2
    stats = istats(crawler)
    assert stats["requests/retried"] == 1
    assert stats["requests/continued"] == 1
    assert stats["requests/done"] == 1
    assert stats["requests/leased"] == 2
    assert stats["requests/repeated"] == 1
    assert stats["records/inserted"] == 1
    # never refused as a duplicate of itself
    assert "requests/duplicate" not in stats
    assert "requests/already_done" not in stats
    assert crawler.dropped_urls == []
    assert crawler.stats.get_value("retry/count") == 1


class RetryFromCallbackSpider(PathSpider):
    """The first response of ``/ok/retry-me`` is judged bad by the callback, which asks for
    a retry with ``get_retry_request``; the second one yields the item."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.calls = 0

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/retry-me"))

    def parse(self, response: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            retry = get_retry_request(response.request, spider=self, reason="empty page")
            assert retry is not None
            yield retry
            return
        yield {"key": path_of(response), "calls": self.calls}


@deferred_f_from_coro_f
async def test_get_retry_request_from_a_callback_continues_the_same_entry(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(RetryFromCallbackSpider, settings(crawl_database, RETRY_TIMES=2),
                          url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {"/ok/retry-me": ("done", None, 2)}
    assert_nothing_leased(crawl_database)
    assert records(crawl_database) == {"/ok/retry-me": {"key": "/ok/retry-me", "calls": 2}}
    assert site.hits("/ok/retry-me") == 2
    stats = istats(crawler)
    assert stats["requests/retried"] == 1
    assert stats["requests/continued"] == 1
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1
    assert "requests/duplicate" not in stats
    assert crawler.dropped_urls == []


# -- IgnoreRequest: robots.txt, offsite, depth ---------------------------------------------------


@deferred_f_from_coro_f
async def test_robots_txt_disallowed_request_ends_failed_as_ignored(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(LinksSpider, settings(crawl_database, ROBOTSTXT_OBEY=True), url=site.url,
                          start_paths=("/ok/open?links=/private/p1,/ok/allowed",))
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/ok/open?links=/private/p1,/ok/allowed": ("done", None, 1),
        "/private/p1": ("failed", "ignored/IgnoreRequest", 1),
        "/ok/allowed": ("done", None, 1),
    }  # robots.txt itself is no frontier entry
    assert_nothing_leased(crawl_database)
    assert site.hits("/private/p1") == 0
    assert site.hits("/robots.txt") == 1
    assert set(records(crawl_database)) == {"/ok/open?links=/private/p1,/ok/allowed",
                                            "/ok/allowed"}
    stats = istats(crawler)
    assert stats["requests/failed"] == 1
    assert stats["failed/ignored/IgnoreRequest"] == 1
    assert stats["requests/done"] == 2
    assert crawler.stats.get_value("robotstxt/forbidden") == 1


class OffsiteSpider(LinksSpider):
    allowed_domains: ClassVar[list[str]] = ["127.0.0.1"]


@deferred_f_from_coro_f
async def test_offsite_request_never_reaches_the_frontier(
    site: LocalSite, crawl_database: str
) -> None:
    offsite = f"http://localhost:{site.port}/ok/offsite"  # the same server, another host
    crawler = await crawl(OffsiteSpider, settings(crawl_database), url=site.url,
                          start_paths=(f"/ok/onsite?links={offsite},/ok/inside",))
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        f"/ok/onsite?links={offsite},/ok/inside": ("done", None, 1),
        "/ok/inside": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    assert site.hits("/ok/offsite") == 0
    assert crawler.stats.get_value("offsite/filtered") == 1
    stats = istats(crawler)
    assert stats["requests/done"] == 2
    assert "requests/failed" not in stats


class DeepSpider(PathSpider):
    """``/ok/deep0`` -> ``/ok/deep1`` -> ... (each page links the next)."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/deep0"))

    def parse(self, response: Any) -> Any:
        n = int(path_of(response).removeprefix("/ok/deep"))
        yield {"key": path_of(response), "depth": response.meta["depth"]}
        if n < 5:
            yield response.follow(f"/ok/deep{n + 1}")


@deferred_f_from_coro_f
async def test_depth_limit_drops_deeper_requests_before_the_frontier(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(DeepSpider, settings(crawl_database, DEPTH_LIMIT=2), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {f"/ok/deep{n}": ("done", None, 1) for n in range(3)}
    assert_nothing_leased(crawl_database)
    assert {k: v["depth"] for k, v in records(crawl_database).items()} == {
        "/ok/deep0": 0, "/ok/deep1": 1, "/ok/deep2": 2}
    assert site.hits("/ok/deep3") == 0
    stats = istats(crawler)
    assert stats["requests/done"] == 3
    assert stats["requests/added"] == 3


@deferred_f_from_coro_f
async def test_retries_up_to_retry_times_are_not_cut_short_by_the_attempt_limit(
    site: LocalSite, crawl_database: str
) -> None:
    # RETRY_TIMES=10: Scrapy makes up to 11 attempts; each retry completes its lease (it is a
    # continuation, not a crash), so IDEMPOTENT_MAX_ATTEMPTS (10) must not quarantine it
    path = "/flaky/10/patient"
    crawler = await crawl(LinksSpider, settings(crawl_database, RETRY_ENABLED=True,
                                                RETRY_TIMES=10),
                          url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    assert site.hits(path) == 11
    assert frontier(crawl_database, site) == {path: ("done", None, 11)}
    assert_nothing_leased(crawl_database)
    assert set(records(crawl_database)) == {path}
    stats = istats(crawler)
    assert stats["requests/retried"] == 10
    assert "requests/quarantined" not in stats
