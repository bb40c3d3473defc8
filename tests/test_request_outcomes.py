"""Every way a request can end inside Scrapy, each as a real crawl of a local site.

Whatever happens to a request, the frontier must end with it in the right terminal state:
no lease dangles, no crawl hangs, no request or record is lost silently, and records are
stored exactly once. Each test runs real crawls in this process against the local site
(``site`` fixture) and then checks the frontier rows (``url, state, error_kind, attempts``),
that nothing is left ``leased``, the close reason, the records stored and the
``idempotent/...`` stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
import scrapy
from local_site import LocalSite, free_port
from scrapy.downloadermiddlewares.retry import get_retry_request
from scrapy.exceptions import CloseSpider, DropItem
from scrapy.http import JsonRequest
from scrapy.http.request.form import FormRequest  # not scrapy.http: deprecated there in 2.16
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, crawl_to_end, db_rows

NATURAL_KEYS = {"dict": "key"}


# -- fixtures and helpers ---------------------------------------------------------------------



def settings(db_path: Path, **extra: Any) -> dict[str, Any]:
    """A quick crawl with the add-on: dict items keyed by their ``key`` field."""
    values: dict[str, Any] = {
        "IDEMPOTENT_NATURAL_KEYS": NATURAL_KEYS,
        "DOWNLOAD_TIMEOUT": 5,
        "CONCURRENT_REQUESTS": 4,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "TELNETCONSOLE_ENABLED": False,
    }
    values.update(extra)
    return crawl_settings(db_path, **values)


def rows(db_path: Path, site: LocalSite) -> list[tuple[str, str, str | None, int]]:
    """The frontier: ``(url relative to the site, state, error_kind, attempts)``, sorted."""
    return sorted(
        (url.removeprefix(site.url), state, kind, attempts)
        for url, state, kind, attempts in db_rows(
            db_path, "SELECT url, state, error_kind, attempts FROM requests")
    )


def frontier(db_path: Path, site: LocalSite) -> dict[str, tuple[str, str | None, int]]:
    """The frontier by relative URL, checking that no URL has two rows."""
    found = rows(db_path, site)
    by_url = {url: (state, kind, attempts) for url, state, kind, attempts in found}
    assert len(by_url) == len(found), f"a URL has several frontier rows: {found}"
    return by_url


def assert_nothing_leased(db_path: Path) -> None:
    leased = db_rows(db_path, "SELECT url, worker FROM requests WHERE state = 'leased'")
    assert leased == [], f"leases left dangling: {leased}"
    journal = db_rows(db_path, "SELECT key FROM responses")
    assert journal == [], "responses of finished requests left in the journal"


def records(db_path: Path) -> dict[str, dict[str, Any]]:
    """Stored records by their ``key`` field (each record ID is one row by construction)."""
    found = [json.loads(data) for (data,) in db_rows(db_path, "SELECT data FROM records")]
    by_key = {record["key"]: record for record in found}
    assert len(by_key) == len(found), f"two records share a key: {found}"
    return by_key


def record_owner(db_path: Path, site: LocalSite) -> dict[str, str | None]:
    """Record ``key`` -> URL of the frontier entry whose completion stored it."""
    urls = dict(db_rows(db_path, "SELECT key, url FROM requests"))
    owners: dict[str, str | None] = {}
    for data, request_key in db_rows(db_path, "SELECT data, request_key FROM records"):
        url = urls.get(request_key)
        owners[json.loads(data)["key"]] = url.removeprefix(site.url) if url else None
    return owners


async def crawl(spidercls: type, settings_dict: dict[str, Any], **kwargs: Any) -> Any:
    """Like :func:`crawling.run_crawl`, also noting the URLs of requests Scrapy reports as
    dropped (``request_dropped``: the scheduler refused them) in ``crawler.dropped_urls``."""
    from scrapy import signals
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(spidercls, settings_dict)
    dropped: list[str] = []

    def on_dropped(request: Any, spider: Any) -> None:
        dropped.append(request.url)

    crawler.dropped_urls = dropped  # type: ignore[attr-defined]
    crawler.on_dropped = on_dropped  # type: ignore[attr-defined]  # signals hold weak refs
    crawler.signals.connect(on_dropped, signals.request_dropped)
    await crawl_to_end(crawler, **kwargs)
    return crawler


def istats(crawler: Any) -> dict[str, Any]:
    """The crawl's ``idempotent/...`` stats, without the prefix."""
    return {k.removeprefix("idempotent/"): v for k, v in crawler.stats.get_stats().items()
            if k.startswith("idempotent/")}


def finish_reason(crawler: Any) -> str:
    return str(crawler.stats.get_value("finish_reason"))


def path_of(response: Any) -> str:
    """The path (and query) of a response's URL."""
    from urllib.parse import urlsplit

    split = urlsplit(str(response.url))
    return split.path + (f"?{split.query}" if split.query else "")


class PathSpider(scrapy.Spider):
    """Base of the spiders below: ``url`` is the site's root; ``self.at(path)`` is absolute."""

    name = "paths"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    def at(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path


# -- success ------------------------------------------------------------------------------------


class LinksSpider(PathSpider):
    """Every page yields one item (unless its path says ``empty``) and follows its links."""

    start_paths: tuple[str, ...] = ("/ok/home?links=/ok/a,/ok/b,/ok/empty",)

    async def start(self) -> Any:
        for path in self.start_paths:
            yield scrapy.Request(self.at(path))

    def parse(self, response: Any) -> Any:
        if not path_of(response).startswith("/ok/empty"):
            yield {"key": path_of(response)}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)


@deferred_f_from_coro_f
async def test_success_items_and_requests_and_a_page_without_items(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(LinksSpider, settings(db_path), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/ok/home?links=/ok/a,/ok/b,/ok/empty": ("done", None, 1),
        "/ok/a": ("done", None, 1),
        "/ok/b": ("done", None, 1),
        "/ok/empty": ("done", None, 1),  # no items: done all the same
    }
    assert_nothing_leased(db_path)
    assert set(records(db_path)) == {"/ok/home?links=/ok/a,/ok/b,/ok/empty", "/ok/a", "/ok/b"}
    assert record_owner(db_path, site)["/ok/a"] == "/ok/a"
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
    site: LocalSite, db_path: Path
) -> None:
    SlowPipeline.finished.clear()
    InterleavedSpider.ended = None
    crawler = await crawl(InterleavedSpider, settings(
        db_path, CONCURRENT_ITEMS=2, ITEM_PIPELINES={f"{__name__}.SlowPipeline": 100},
    ), url=site.url)
    assert finish_reason(crawler) == "finished"
    # the items of /ok/many really lagged behind its callback
    ended = InterleavedSpider.ended
    assert ended is not None and SlowPipeline.finished["many-11"] > ended
    expected_rows = {"/ok/many": ("done", None, 1)}
    expected_rows.update({f"/ok/child{i}": ("done", None, 1) for i in range(12)})
    assert frontier(db_path, site) == expected_rows
    assert_nothing_leased(db_path)
    owners = record_owner(db_path, site)
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
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(CallbackErrorSpider, settings(db_path), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/ok/raise-now": ("failed", "spider_error/KeyError", 1),
        "/ok/raise-first": ("failed", "spider_error/ValueError", 1),
        "/ok/raise-midway": ("failed", "spider_error/RuntimeError", 1),
        "/ok/raise-async": ("failed", "spider_error/LookupError", 1),
        "/ok/before-raise": ("done", None, 1),  # yielded before the raise: kept
    }
    assert_nothing_leased(db_path)
    # what was yielded before the raise is stored, with the request that produced it
    assert record_owner(db_path, site) == {
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
    site: LocalSite, db_path: Path, kind: str, error: str | None, use_errback: bool
) -> None:
    target = {
        "refused": f"http://127.0.0.1:{free_port()}/ok/nobody-home",
        "reset": f"{site.url}/reset/x",
        "timeout": f"{site.url}/slow/1.5/x",
    }[kind]
    crawler = await crawl(DownloadErrorSpider, settings(
        db_path, RETRY_ENABLED=True, RETRY_TIMES=1, DOWNLOAD_TIMEOUT=0.5,
    ), url=site.url, target=target, use_errback=use_errback)
    spider = crawler.spider
    assert finish_reason(crawler) == "finished"
    found = {url if "://" in url else site.url + url: state
             for url, state in frontier(db_path, site).items()}
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
    assert_nothing_leased(db_path)
    stats = istats(crawler)
    assert stats["requests/failed"] == 1
    assert stats[f"failed/{error_kind}"] == 1
    assert stats["requests/retried"] == 1
    assert stats["requests/continued"] == 1
    assert stats["requests/leased"] == (4 if use_errback else 3)
    assert stats["requests/repeated"] == 1
    assert crawler.stats.get_value("retry/count") == 1
    stored = records(db_path)
    if use_errback:
        # the errback runs once per final failure; its item bypassed the spider
        # middlewares, still got a record ID and is stored with the failed request
        assert len(spider.errback_calls) == 1
        failure_key = f"failure:{target}"
        assert set(stored) == {"/ok/control", "/ok/fallback", failure_key}
        assert stored[failure_key]["error"] == spider.errback_calls[0]
        assert len(spider.errback_items[0]["record_id"]) == 32
        owners = record_owner(db_path, site)
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
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(ErrbackRetrySpider, settings(db_path), url=site.url)
    assert finish_reason(crawler) == "finished"
    [(state, error_kind, attempts)] = frontier(db_path, site).values()
    assert (state, attempts) == ("failed", 3)
    assert error_kind is not None and error_kind.startswith("download_error/")
    assert_nothing_leased(db_path)
    assert crawler.spider.errback_calls == 3
    assert site.hits("/reset/eb") == 3
    assert record_owner(db_path, site) == {"gave-up": "/reset/eb"}
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
    site: LocalSite, db_path: Path, code: int, use_errback: bool
) -> None:
    path = f"/status/{code}/x"
    crawler = await crawl(HttpErrorSpider, settings(
        db_path, RETRY_ENABLED=True, RETRY_TIMES=1,
    ), url=site.url, path=path, use_errback=use_errback)
    assert finish_reason(crawler) == "finished"
    attempts = 2 if code == 500 else 1  # 500 is retried once, 404 is not
    assert frontier(db_path, site) == {path: ("failed", "http_status", attempts)}
    assert_nothing_leased(db_path)
    assert site.hits(path) == attempts
    stats = istats(crawler)
    assert stats["requests/failed"] == 1
    assert stats["failed/http_status"] == 1
    assert "requests/done" not in stats
    if use_errback:
        assert crawler.spider.errback_calls == [code]
        assert set(records(db_path)) == {f"failure:{path}"}
        assert record_owner(db_path, site) == {f"failure:{path}": path}
        assert stats["records/inserted"] == 1
    else:
        assert records(db_path) == {}
        assert "records/inserted" not in stats


class HandleStatusSpider(HttpErrorSpider):
    handle_httpstatus_list = (404,)


@pytest.mark.parametrize("how", ["setting", "spider", "meta-list", "meta-all"])
@deferred_f_from_coro_f
async def test_http_error_allowed_by_httperror_allowed_codes_is_done(
    site: LocalSite, db_path: Path, how: str
) -> None:
    path = "/status/404/allowed"
    extra: dict[str, Any] = {"HTTPERROR_ALLOWED_CODES": [404]} if how == "setting" else {}
    meta = {"meta-list": {"handle_httpstatus_list": [404]},
            "meta-all": {"handle_httpstatus_all": True}}.get(how)
    spidercls = HandleStatusSpider if how == "spider" else HttpErrorSpider
    crawler = await crawl(spidercls, settings(db_path, **extra), url=site.url, path=path,
                          use_errback=True, meta=meta)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {path: ("done", None, 1)}
    assert_nothing_leased(db_path)
    assert records(db_path)[f"page:{path}"]["status"] == 404
    assert crawler.spider.errback_calls == []
    stats = istats(crawler)
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1
    assert "requests/failed" not in stats


# -- retries --------------------------------------------------------------------------------


@deferred_f_from_coro_f
async def test_retry_middleware_503_then_200_continues_the_same_entry(
    site: LocalSite, db_path: Path
) -> None:
    path = "/flaky/1/x"
    crawler = await crawl(LinksSpider, settings(db_path, RETRY_ENABLED=True, RETRY_TIMES=2),
                          url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {path: ("done", None, 2)}  # one row, attempts 2
    assert_nothing_leased(db_path)
    assert set(records(db_path)) == {path}
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
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(RetryFromCallbackSpider, settings(db_path, RETRY_TIMES=2),
                          url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {"/ok/retry-me": ("done", None, 2)}
    assert_nothing_leased(db_path)
    assert records(db_path) == {"/ok/retry-me": {"key": "/ok/retry-me", "calls": 2}}
    assert site.hits("/ok/retry-me") == 2
    stats = istats(crawler)
    assert stats["requests/retried"] == 1
    assert stats["requests/continued"] == 1
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1
    assert "requests/duplicate" not in stats
    assert crawler.dropped_urls == []


# -- redirects --------------------------------------------------------------------------------


class RedirectSpider(PathSpider):
    """``plan``: ``(path, method, body)`` requests to start with; every page (or echo) yields
    one item keyed by the URL that answered; the errback yields one keyed by the request."""

    def __init__(self, url: str, plan: list[tuple[str, str, bytes]], **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.plan = plan
        self.errback_calls: list[str] = []

    async def start(self) -> Any:
        for path, method, body in self.plan:
            yield scrapy.Request(self.at(path), method=method, body=body, errback=self.on_error)

    def parse(self, response: Any) -> Any:
        item: dict[str, Any] = {"key": path_of(response), "status": response.status}
        if "/echo/" in response.url:
            echo = response.json()
            item.update(method=echo["method"], body=echo["body"])
        yield item

    def on_error(self, failure: Any) -> Any:
        self.errback_calls.append(failure.request.url.removeprefix(self.base_url))
        yield {"key": f"failure:{failure.request.url.removeprefix(self.base_url)}",
               "error": type(failure.value).__name__}


@pytest.mark.parametrize("code", [301, 302, 307])
@deferred_f_from_coro_f
async def test_http_redirect_ends_redirected_and_the_target_is_crawled(
    site: LocalSite, db_path: Path, code: int
) -> None:
    method, body = ("POST", b"payload=1") if code == 307 else ("GET", b"")
    source, target = f"/redirect/{code}/r?to=/echo/t{code}", f"/echo/t{code}"
    crawler = await crawl(RedirectSpider, settings(db_path), url=site.url,
                          plan=[(source, method, body)])
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        source: ("redirected", None, 1),
        target: ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    # the target's item is attributed to the target
    assert record_owner(db_path, site) == {target: target}
    stored = records(db_path)[target]
    assert (stored["method"], stored["body"]) == (method, body.decode())  # 307 keeps the POST
    assert site.hits(target, method) == 1
    assert site.hits(f"/redirect/{code}/r") == 1
    stats = istats(crawler)
    assert stats["requests/redirected"] == 1
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1
    assert crawler.dropped_urls == []


@deferred_f_from_coro_f
async def test_meta_refresh_ends_redirected_and_the_target_is_crawled(
    site: LocalSite, db_path: Path
) -> None:
    source = "/refresh/m?to=/ok/meta-target"
    crawler = await crawl(RedirectSpider, settings(db_path), url=site.url,
                          plan=[(source, "GET", b"")])
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        source: ("redirected", None, 1),
        "/ok/meta-target": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    assert record_owner(db_path, site) == {"/ok/meta-target": "/ok/meta-target"}
    assert istats(crawler)["requests/redirected"] == 1
    assert site.hits("/ok/meta-target") == 1


class RedirectToDoneSpider(PathSpider):
    """``/ok/already`` first (higher priority); its callback then links a redirect to it."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/already"), priority=10)

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response)}
        if path_of(response) == "/ok/already":
            yield scrapy.Request(self.at("/redirect/302/late?to=/ok/already"))


@deferred_f_from_coro_f
async def test_redirect_to_a_url_already_done_is_not_fetched_again(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(RedirectToDoneSpider, settings(db_path), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/ok/already": ("done", None, 1),
        "/redirect/302/late?to=/ok/already": ("redirected", None, 1),
    }
    assert_nothing_leased(db_path)
    assert site.hits("/ok/already") == 1  # no second fetch of the target
    assert set(records(db_path)) == {"/ok/already"}
    stats = istats(crawler)
    assert stats["requests/redirected"] == 1
    assert stats["requests/done"] == 1
    assert stats["requests/already_done"] == 1
    assert stats["records/inserted"] == 1


@deferred_f_from_coro_f
async def test_chain_of_three_redirects(site: LocalSite, db_path: Path) -> None:
    crawler = await crawl(RedirectSpider, settings(db_path), url=site.url,
                          plan=[("/chain/3/c", "GET", b"")])
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/chain/3/c": ("redirected", None, 1),
        "/chain/2/c": ("redirected", None, 1),
        "/chain/1/c": ("redirected", None, 1),
        "/chain/0/c": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    assert record_owner(db_path, site) == {"/chain/0/c": "/chain/0/c"}
    assert site.counts_by_path() == {f"/chain/{n}/c": 1 for n in range(4)}
    stats = istats(crawler)
    assert stats["requests/redirected"] == 3
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1


@deferred_f_from_coro_f
async def test_too_many_redirects_ends_failed_and_calls_the_errback_once(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(RedirectSpider, settings(db_path, REDIRECT_MAX_TIMES=2),
                          url=site.url, plan=[("/chain/3/m", "GET", b"")])
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/chain/3/m": ("redirected", None, 1),
        "/chain/2/m": ("redirected", None, 1),
        "/chain/1/m": ("failed", "ignored/IgnoreRequest", 1),  # its redirect was discarded
    }
    assert_nothing_leased(db_path)
    assert site.hits("/chain/0/m") == 0
    assert crawler.spider.errback_calls == ["/chain/1/m"]
    assert record_owner(db_path, site) == {"failure:/chain/1/m": "/chain/1/m"}
    stats = istats(crawler)
    assert stats["requests/redirected"] == 2
    assert stats["requests/failed"] == 1
    assert stats["failed/ignored/IgnoreRequest"] == 1
    assert stats["records/inserted"] == 1


class LoopSpider(PathSpider):
    def __init__(self, url: str, dont_filter: bool, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.dont_filter = dont_filter

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/loop/l/0"), dont_filter=self.dont_filter)


@deferred_f_from_coro_f
async def test_redirect_loop_ends(site: LocalSite, db_path: Path) -> None:
    crawler = await crawl(LoopSpider, settings(db_path), url=site.url, dont_filter=False)
    assert finish_reason(crawler) == "finished"
    # 0 -> 1 -> 0: the way back is to an entry already answered
    assert frontier(db_path, site) == {
        "/loop/l/0": ("redirected", None, 1),
        "/loop/l/1": ("redirected", None, 1),
    }
    assert_nothing_leased(db_path)
    assert site.counts_by_path() == {"/loop/l/0": 1, "/loop/l/1": 1}
    assert istats(crawler)["requests/already_done"] == 1


@deferred_f_from_coro_f
async def test_redirect_loop_of_a_dont_filter_request_ends_at_redirect_max_times(
    site: LocalSite, db_path: Path
) -> None:
    # dont_filter (start_urls) is inherited by redirects: each hop is a new entry, as with
    # Scrapy's own scheduler, until REDIRECT_MAX_TIMES
    crawler = await crawl(LoopSpider, settings(db_path, REDIRECT_MAX_TIMES=3), url=site.url,
                          dont_filter=True)
    assert finish_reason(crawler) == "finished"
    assert rows(db_path, site) == [
        ("/loop/l/0", "redirected", None, 1),
        ("/loop/l/0", "redirected", None, 1),
        ("/loop/l/1", "failed", "ignored/IgnoreRequest", 1),
        ("/loop/l/1", "redirected", None, 1),
    ]
    assert_nothing_leased(db_path)
    assert site.request_count == 4


# -- IgnoreRequest: robots.txt, offsite, depth ---------------------------------------------------


@deferred_f_from_coro_f
async def test_robots_txt_disallowed_request_ends_failed_as_ignored(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(LinksSpider, settings(db_path, ROBOTSTXT_OBEY=True), url=site.url,
                          start_paths=("/ok/open?links=/private/p1,/ok/allowed",))
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/ok/open?links=/private/p1,/ok/allowed": ("done", None, 1),
        "/private/p1": ("failed", "ignored/IgnoreRequest", 1),
        "/ok/allowed": ("done", None, 1),
    }  # robots.txt itself is no frontier entry
    assert_nothing_leased(db_path)
    assert site.hits("/private/p1") == 0
    assert site.hits("/robots.txt") == 1
    assert set(records(db_path)) == {"/ok/open?links=/private/p1,/ok/allowed", "/ok/allowed"}
    stats = istats(crawler)
    assert stats["requests/failed"] == 1
    assert stats["failed/ignored/IgnoreRequest"] == 1
    assert stats["requests/done"] == 2
    assert crawler.stats.get_value("robotstxt/forbidden") == 1


class OffsiteSpider(LinksSpider):
    allowed_domains: ClassVar[list[str]] = ["127.0.0.1"]


@deferred_f_from_coro_f
async def test_offsite_request_never_reaches_the_frontier(
    site: LocalSite, db_path: Path
) -> None:
    offsite = f"http://localhost:{site.port}/ok/offsite"  # the same server, another host
    crawler = await crawl(OffsiteSpider, settings(db_path), url=site.url,
                          start_paths=(f"/ok/onsite?links={offsite},/ok/inside",))
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        f"/ok/onsite?links={offsite},/ok/inside": ("done", None, 1),
        "/ok/inside": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
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
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(DeepSpider, settings(db_path, DEPTH_LIMIT=2), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {f"/ok/deep{n}": ("done", None, 1) for n in range(3)}
    assert_nothing_leased(db_path)
    assert {k: v["depth"] for k, v in records(db_path).items()} == {
        "/ok/deep0": 0, "/ok/deep1": 1, "/ok/deep2": 2}
    assert site.hits("/ok/deep3") == 0
    stats = istats(crawler)
    assert stats["requests/done"] == 3
    assert stats["requests/added"] == 3


# -- pipelines: DropItem and errors before ours -------------------------------------------------


class PickyPipeline:
    """Before ours: drops items marked ``drop``, fails on items marked ``boom``."""

    def process_item(self, item: Any, spider: Any = None) -> Any:
        if item.get("drop"):
            raise DropItem("not wanted")
        if item.get("boom"):
            raise ValueError("pipeline bug")
        return item


class PipelineSpider(PathSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/pipes"))

    def parse(self, response: Any) -> Any:
        yield {"key": "kept"}
        yield {"key": "dropped", "drop": True}
        yield {"key": "broken", "boom": True}
        yield response.follow("/ok/after-pipes", callback=self.parse_after)

    def parse_after(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_drop_item_and_pipeline_error_before_ours(site: LocalSite, db_path: Path) -> None:
    crawler = await crawl(PipelineSpider, settings(
        db_path, ITEM_PIPELINES={f"{__name__}.PickyPipeline": 100}), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/ok/pipes": ("done", None, 1),  # the request still ends done
        "/ok/after-pipes": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    assert record_owner(db_path, site) == {"kept": "/ok/pipes",
                                           "/ok/after-pipes": "/ok/after-pipes"}
    assert db_rows(db_path, "SELECT count(*) FROM rejects") == [(0,)]
    stats = istats(crawler)
    assert stats["records/inserted"] == 2
    assert stats["requests/done"] == 2
    assert crawler.stats.get_value("item_dropped_count") == 1
    assert crawler.stats.get_value("item_scraped_count") == 2


class CopyingPipeline:
    """Before ours: returns a new item object (a common habit), not the one it got."""

    def process_item(self, item: Any, spider: Any = None) -> Any:
        return {**item, "copied": True}


@deferred_f_from_coro_f
async def test_pipeline_returning_a_new_item_object(site: LocalSite, db_path: Path) -> None:
    crawler = await crawl(PipelineSpider, settings(
        db_path, ITEM_PIPELINES={f"{__name__}.CopyingPipeline": 100}), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/ok/pipes": ("done", None, 1),
        "/ok/after-pipes": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    stored = records(db_path)
    assert set(stored) == {"kept", "dropped", "broken", "/ok/after-pipes"}
    assert all(record["copied"] for record in stored.values())
    # still stored with the request that produced it
    assert record_owner(db_path, site) == {
        "kept": "/ok/pipes", "dropped": "/ok/pipes", "broken": "/ok/pipes",
        "/ok/after-pipes": "/ok/after-pipes"}
    assert istats(crawler)["records/inserted"] == 4


@dataclasses.dataclass
class Page:
    """An item type without a configured natural key (the page URL is its key) and without
    room for a record ID field."""

    title: str
    price: int


class RepricingPipeline:
    """Before ours: returns a changed copy of a dataclass item (``dataclasses.replace``)."""

    def process_item(self, item: Any, spider: Any = None) -> Any:
        if isinstance(item, Page):
            return dataclasses.replace(item, price=item.price * 2)
        return item


class PageItemSpider(PathSpider):
    async def start(self) -> Any:
        for name in ("pa", "pb"):
            yield scrapy.Request(self.at(f"/ok/{name}"))

    def parse(self, response: Any) -> Any:
        yield Page(title=path_of(response), price=10)


@deferred_f_from_coro_f
async def test_pipeline_returning_a_new_url_keyed_item_is_stored_under_its_page(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(PageItemSpider, settings(
        db_path, ITEM_PIPELINES={f"{__name__}.RepricingPipeline": 100}), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {"/ok/pa": ("done", None, 1),
                                       "/ok/pb": ("done", None, 1)}
    assert_nothing_leased(db_path)
    stored = sorted(json.loads(data)["title"] for (data,) in db_rows(
        db_path, "SELECT data FROM records WHERE data LIKE '%\"price\":20%'"))
    assert stored == ["/ok/pa", "/ok/pb"], db_rows(db_path, "SELECT reason FROM rejects")
    stats = istats(crawler)
    assert stats["records/inserted"] == 2
    assert "records/rejected" not in stats


class StashMiddleware:
    """A downloader middleware that keeps a live object in ``request.meta`` (as
    scrapy-playwright's ``playwright_page`` or a session object would): a retry or redirect
    copies it, so the copy cannot be stored."""

    def process_request(self, request: Any, spider: Any = None) -> None:
        if "stash" in request.url:
            request.meta["session"] = object()


@pytest.mark.parametrize(("path", "hits", "unstorable", "end", "stored"), [
    ("/flaky/1/stash", 2, 1, ("done", None), {"/flaky/1/stash"}),
    ("/reset/stash", 3, 2, ("failed", "download_error/"), set()),
    ("/redirect/302/stash?to=/ok/stash-target", 1, 1, ("redirected", None),
     {"/ok/stash-target"}),
], ids=["retry", "retries-fail", "redirect"])
@deferred_f_from_coro_f
async def test_retry_or_redirect_that_cannot_be_stored_is_fetched_under_its_requests_lease(
    site: LocalSite, db_path: Path, path: str, hits: int, unstorable: int,
    end: tuple[str, str | None], stored: set[str],
) -> None:
    crawler = await crawl(LinksSpider, settings(
        db_path, RETRY_ENABLED=True, RETRY_TIMES=2,
        DOWNLOADER_MIDDLEWARES={f"{__name__}.StashMiddleware": 560},
    ), url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    # the retries (or the redirect) copy the live object: fetched from memory, as Scrapy
    # does, and the stored request ends with their outcome
    assert istats(crawler)["requests/unstorable"] == unstorable
    assert site.hits(path) == hits
    assert set(records(db_path)) == stored
    assert_nothing_leased(db_path)
    [(state, error_kind, attempts)] = frontier(db_path, site).values()
    assert (state, (error_kind or "")[:len(end[1] or "")] or None) == end, error_kind
    assert attempts == 1
    if end[0] == "redirected":
        assert site.hits("/ok/stash-target") == 1
    assert crawler.dropped_urls == []


# -- closing early and finishing in the next crawl ------------------------------------------------


#: Keys after this one are served by ``/block/...`` in the CloseSpider tests.
GATE_AFTER_KEY = 4


def keyed_path(key: int) -> str:
    """Keys up to :data:`GATE_AFTER_KEY` are answered at once; later ones wait for the
    site's release, which the spider gives when it raises CloseSpider. So what a crawl
    fetches after the stop is bounded by the requests in flight, however long Scrapy takes
    to run the callback (before 2.18 it waited 0.1 s first, long enough to download every
    page of this test)."""
    return f"/ok/k{key}" if key <= GATE_AFTER_KEY else f"/block/k{key}"


class KeyedSpider(PathSpider):
    """40 keyed requests (the key in ``cb_kwargs``); ``stop_at`` raises CloseSpider
    in the callback of that key before it yields its record (after calling ``release``)."""

    def __init__(self, url: str, stop_at: int | None = None,
                 release: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.stop_at = stop_at
        self.release = release
        self.seen: list[int] = []

    async def start(self) -> Any:
        for key in range(40):
            # priorities: keys in ascending order, so key 4 comes early
            yield scrapy.Request(self.at(keyed_path(key)), cb_kwargs={"key": key},
                                 priority=40 - key)

    def parse(self, response: Any, key: int) -> Any:
        self.seen.append(key)
        if key == self.stop_at:
            if self.release is not None:
                self.release()
            raise CloseSpider("stop_at_key")
        yield {"key": f"k{key}", "path": path_of(response)}


@deferred_f_from_coro_f
async def test_close_spider_from_a_callback_then_the_next_crawl_finishes_the_job(
    site: LocalSite, db_path: Path
) -> None:
    first = await crawl(KeyedSpider, settings(db_path, CONCURRENT_REQUESTS=2), url=site.url,
                        stop_at=GATE_AFTER_KEY, release=site.release)
    assert finish_reason(first) == "stop_at_key"
    assert_nothing_leased(db_path)
    after_first = frontier(db_path, site)
    assert len(after_first) == 40
    done_first = {url for url, (state, _, _) in after_first.items() if state == "done"}
    pending = {url for url, (state, _, _) in after_first.items() if state == "pending"}
    assert done_first | pending == set(after_first)  # nothing else: no failed, no leased
    # the request whose callback raised CloseSpider did not finish: it is not done
    assert keyed_path(GATE_AFTER_KEY) in pending
    # at most CONCURRENT_REQUESTS requests were in flight behind the gate when it stopped
    assert len(pending) >= 40 - (GATE_AFTER_KEY + 1) - 2
    assert {f"k{k}" for k in first.spider.seen if k != GATE_AFTER_KEY} == set(records(db_path))

    second = await crawl(KeyedSpider, settings(db_path, CONCURRENT_REQUESTS=2), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(db_path)
    after_second = frontier(db_path, site)
    assert set(after_second) == {keyed_path(k) for k in range(40)}
    assert {state for state, _, _ in after_second.values()} == {"done"}
    # every key not done in the first crawl ran in the second, with its own key
    assert sorted(second.spider.seen) == sorted(
        int(u.rsplit("/k", 1)[1]) for u in pending)
    stored = records(db_path)
    assert set(stored) == {f"k{k}" for k in range(40)}
    assert all(record["path"] == keyed_path(int(key[1:])) for key, record in stored.items())
    inserted = (istats(first).get("records/inserted", 0)
                + istats(second).get("records/inserted", 0))
    assert inserted == 40  # none twice
    assert "records/updated" not in istats(second)
    assert "records/unchanged" not in istats(second)


class StopMidwaySpider(PathSpider):
    """``/ok/stopper`` yields an item and a child, then raises CloseSpider (first crawl)."""

    def __init__(self, url: str, stop: bool = False, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.stop = stop

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/stopper"), callback=self.parse_stopper)

    def parse_stopper(self, response: Any) -> Any:
        yield {"key": "stopper", "n": 1}
        yield response.follow("/ok/after-stop")
        if self.stop:
            raise CloseSpider("stopped_midway")
        yield {"key": "stopper-tail"}

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_close_spider_midway_keeps_what_was_yielded_and_the_page_stays_due(
    site: LocalSite, db_path: Path
) -> None:
    first = await crawl(StopMidwaySpider, settings(db_path), url=site.url, stop=True)
    assert finish_reason(first) == "stopped_midway"
    assert_nothing_leased(db_path)
    after_first = frontier(db_path, site)
    assert after_first["/ok/stopper"][0] == "pending"  # its callback did not finish
    assert after_first["/ok/after-stop"][0] in ("pending", "done")
    assert "stopper" in records(db_path)

    second = await crawl(StopMidwaySpider, settings(db_path), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(db_path)
    assert {url: state for url, (state, _, _) in frontier(db_path, site).items()} == {
        "/ok/stopper": "done", "/ok/after-stop": "done"}
    assert set(records(db_path)) == {"stopper", "stopper-tail", "/ok/after-stop"}
    assert site.hits("/ok/after-stop") == 1
    inserted = (istats(first).get("records/inserted", 0)
                + istats(second).get("records/inserted", 0))
    assert inserted == 3  # none twice; the replayed page's first item is unchanged
    assert istats(second)["records/unchanged"] == 1


class TenPagesSpider(PathSpider):
    """``/ok/root`` links nine pages; every page yields one item. ``/ok/p1`` and ``/ok/p2``
    answer at once, the others (``/block/...``) only once three items went through the
    pipelines: a CLOSESPIDER_* count of 3 is reached with at most one page in flight behind
    the gate, however late Scrapy runs the callbacks (before 2.18 it waited 0.1 s first,
    long enough to download all ten pages)."""

    def __init__(self, url: str, release: Callable[[], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.release = release
        self.items = 0

    @classmethod
    def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> TenPagesSpider:
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider.item_scraped, signal=scrapy.signals.item_scraped)
        return cast("TenPagesSpider", spider)

    def item_scraped(self) -> None:
        self.items += 1
        if self.items == 3 and self.release is not None:
            self.release()

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/root?links=" + ",".join(
            ["/ok/p1", "/ok/p2", *(f"/block/p{n}" for n in range(3, 10))])))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response).split("?")[0]}
        for href in response.css("a::attr(href)").getall():
            # the pages that answer at once first (the frontier is LIFO within a priority)
            yield response.follow(href, priority=1 if href.startswith("/ok/") else 0)


@pytest.mark.parametrize(("setting", "reason"), [
    ("CLOSESPIDER_PAGECOUNT", "closespider_pagecount"),
    ("CLOSESPIDER_ITEMCOUNT", "closespider_itemcount"),
])
@deferred_f_from_coro_f
async def test_closespider_count_leaves_the_rest_pending_for_the_next_crawl(
    site: LocalSite, db_path: Path, setting: str, reason: str
) -> None:
    one_at_a_time = {"CONCURRENT_REQUESTS": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1}
    first = await crawl(TenPagesSpider, settings(db_path, **{setting: 3}, **one_at_a_time),
                        url=site.url, release=site.release)
    assert finish_reason(first) == reason
    assert_nothing_leased(db_path)
    states = [state for state, _, _ in frontier(db_path, site).values()]
    assert set(states) == {"done", "pending"}
    assert len(states) == 10
    done_first = states.count("done")
    assert 3 <= done_first <= 4  # the three counted, and the one in flight behind the gate
    assert len(records(db_path)) == done_first

    second = await crawl(TenPagesSpider, settings(db_path, **one_at_a_time), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(db_path)
    assert {state for state, _, _ in frontier(db_path, site).values()} == {"done"}
    assert len(records(db_path)) == 10
    assert (istats(first)["records/inserted"] + istats(second)["records/inserted"]) == 10
    assert istats(second)["requests/done"] == 10 - done_first
    assert all(n == 1 for n in site.counts_by_path().values()), site.counts_by_path()
    assert site.request_count == 10


# -- identity of children: meta copied from the response, dont_filter, replayed parents -----------


class MetaCopySpider(PathSpider):
    """The parent is reached through a redirect and a retry, so ``response.meta`` carries
    ``redirect_urls``, ``retry_times``, ``depth``, ...; its children copy it wholesale."""

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/redirect/302/mm?to=/flaky/1/mparent"),
                             callback=self.parse_parent, meta={"custom": "kept"})

    def parse_parent(self, response: Any) -> Any:
        yield {"key": "parent", "retry_times": response.meta.get("retry_times"),
               "redirects": len(response.meta.get("redirect_urls", []))}
        for name in ("mc1", "mc2", "mc1"):  # mc1 twice: a duplicate like any other
            yield scrapy.Request(self.at(f"/ok/{name}"), meta=response.meta,
                                 callback=self.parse_child)
        # a plain link to itself, with its meta: a duplicate, not a retry
        yield scrapy.Request(response.url, meta=response.meta, callback=self.parse_child)

    def parse_child(self, response: Any) -> Any:
        yield {"key": path_of(response), "custom": response.meta.get("custom")}


@deferred_f_from_coro_f
async def test_children_with_meta_copied_from_the_response(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(MetaCopySpider, settings(db_path, RETRY_ENABLED=True, RETRY_TIMES=2),
                          url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(db_path, site) == {
        "/redirect/302/mm?to=/flaky/1/mparent": ("redirected", None, 1),
        "/flaky/1/mparent": ("done", None, 2),
        "/ok/mc1": ("done", None, 1),
        "/ok/mc2": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    stored = records(db_path)
    assert stored["parent"] == {"key": "parent", "retry_times": 1, "redirects": 1}
    assert stored["/ok/mc1"]["custom"] == stored["/ok/mc2"]["custom"] == "kept"
    assert record_owner(db_path, site) == {
        "parent": "/flaky/1/mparent", "/ok/mc1": "/ok/mc1", "/ok/mc2": "/ok/mc2"}
    assert site.hits("/ok/mc1") == site.hits("/ok/mc2") == 1
    assert site.hits("/flaky/1/mparent") == 2
    stats = istats(crawler)
    assert stats.get("requests/duplicate", 0) + stats.get("requests/already_done", 0) == 2
    assert stats["requests/done"] == 3
    assert stats["records/inserted"] == 3


class DontFilterSpider(PathSpider):
    """A ``dont_filter`` start request whose callback yields ``dont_filter`` children (one
    URL twice) and a plain one; on its first attempt it also asks for a retry, so the same
    children are yielded again by the replayed parent."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.parent_calls = 0

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/dfparent"), dont_filter=True,
                             callback=self.parse_parent)

    def parse_parent(self, response: Any) -> Any:
        self.parent_calls += 1
        yield {"key": "dfparent", "calls": self.parent_calls}
        yield scrapy.Request(self.at("/ok/df1"), dont_filter=True, callback=self.parse_child)
        yield scrapy.Request(self.at("/ok/df1"), dont_filter=True, callback=self.parse_child)
        yield scrapy.Request(self.at("/ok/df2"), dont_filter=True, callback=self.parse_child)
        yield scrapy.Request(self.at("/ok/plain"), callback=self.parse_child)
        if self.parent_calls == 1:
            yield get_retry_request(response.request, spider=self, reason="replay me")

    def parse_child(self, response: Any) -> Any:
        yield {"key": path_of(response)}


@deferred_f_from_coro_f
async def test_dont_filter_children_of_a_replayed_parent_are_not_inserted_twice(
    site: LocalSite, db_path: Path
) -> None:
    crawler = await crawl(DontFilterSpider, settings(db_path, RETRY_TIMES=2), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert crawler.spider.parent_calls == 2
    expected = [
        ("/ok/df1", "done", None, 1),
        ("/ok/df1", "done", None, 1),  # two dont_filter requests: two entries, by design
        ("/ok/df2", "done", None, 1),
        ("/ok/dfparent", "done", None, 2),
        ("/ok/plain", "done", None, 1),
    ]
    assert rows(db_path, site) == expected
    assert_nothing_leased(db_path)
    assert site.counts_by_path() == {"/ok/dfparent": 2, "/ok/df1": 2, "/ok/df2": 1,
                                     "/ok/plain": 1}
    assert records(db_path)["dfparent"]["calls"] == 2
    stats = istats(crawler)
    assert stats["requests/added"] == 5
    assert stats.get("requests/duplicate", 0) + stats.get("requests/already_done", 0) == 4

    # the same crawl again, resuming the (finished) run: nothing new, nothing fetched
    site.reset_counts()
    again = await crawl(DontFilterSpider, settings(
        db_path, RETRY_TIMES=2, IDEMPOTENT_RUN_MODE="resume"), url=site.url)
    assert finish_reason(again) == "finished"
    assert rows(db_path, site) == expected
    assert site.counts_by_path() == {}
    assert istats(again)["requests/already_done"] == 1
    assert "requests/added" not in istats(again)


# -- request bodies, classes, headers, cookies, cb_kwargs and errbacks through the store ----------


class BodiesSpider(PathSpider):
    """``/ok/gate`` yields POST, FormRequest and JsonRequest children (and an errback on a
    failing POST); the first crawl stops after the gate (CLOSESPIDER_PAGECOUNT=1), so they
    are loaded from the store by the second."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.echoes: dict[str, dict[str, Any]] = {}
        self.errback_calls: list[str] = []

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/gate"), callback=self.parse_gate)

    def parse_gate(self, response: Any) -> Any:
        import datetime
        import decimal

        yield scrapy.Request(
            self.at("/echo/raw"), method="POST", body=b"raw \x00\xff body",
            headers={"X-Custom": "v1", "Content-Type": "application/octet-stream"},
            cookies={"c1": "cookie-one"}, callback=self.parse_echo, errback=self.on_error,
            cb_kwargs={"tag": "raw", "when": datetime.datetime(2024, 5, 6, 7, 8, 9),
                       "amount": decimal.Decimal("12.50"), "pair": (1, "two"),
                       "blob": b"\x01\x02"},
        )
        yield FormRequest(self.at("/echo/form"), formdata={"a": "1", "b": "two words"},
                          callback=self.parse_echo, cb_kwargs={"tag": "form"})
        yield JsonRequest(self.at("/echo/json"), data={"x": [1, 2], "y": "z"},
                          callback=self.parse_echo, cb_kwargs={"tag": "json"})
        for body in (b"one", b"two"):  # differ only in body: two requests
            yield scrapy.Request(self.at("/echo/same"), method="POST", body=body,
                                 callback=self.parse_echo, cb_kwargs={"tag": f"same-{body!r}"})
        yield scrapy.Request(self.at("/status/500/post"), method="POST", body=b"x",
                             callback=self.parse_echo, errback=self.on_error,
                             cb_kwargs={"tag": "failing"})

    def parse_echo(self, response: Any, tag: str, **extra: Any) -> Any:
        echo = response.json()
        self.echoes[tag] = {"echo": echo, "extra": extra,
                            "class": type(response.request).__name__}
        yield {"key": tag, "method": echo["method"], "body_b64": echo["body_b64"]}

    def on_error(self, failure: Any) -> Any:
        tag = failure.request.cb_kwargs["tag"]
        self.errback_calls.append(tag)
        yield {"key": f"failure:{tag}"}


@deferred_f_from_coro_f
async def test_post_form_and_json_requests_round_trip_through_the_store(
    site: LocalSite, db_path: Path
) -> None:
    import base64
    import datetime
    import decimal

    first = await crawl(BodiesSpider, settings(db_path, CLOSESPIDER_PAGECOUNT=1),
                        url=site.url)
    assert finish_reason(first) == "closespider_pagecount"
    assert_nothing_leased(db_path)
    assert site.counts_by_path() == {"/ok/gate": 1}
    assert [r[:3] for r in rows(db_path, site)] == [
        ("/echo/form", "pending", None),
        ("/echo/json", "pending", None),
        ("/echo/raw", "pending", None),
        ("/echo/same", "pending", None),
        ("/echo/same", "pending", None),  # two POSTs that differ only in body
        ("/ok/gate", "done", None),
        ("/status/500/post", "pending", None),
    ]

    second = await crawl(BodiesSpider, settings(db_path), url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(db_path)
    assert [r[:3] for r in rows(db_path, site)] == [
        ("/echo/form", "done", None),
        ("/echo/json", "done", None),
        ("/echo/raw", "done", None),
        ("/echo/same", "done", None),
        ("/echo/same", "done", None),
        ("/ok/gate", "done", None),
        ("/status/500/post", "failed", "http_status"),
    ]
    echoes = second.spider.echoes
    raw = echoes["raw"]
    assert raw["class"] == "Request"
    assert raw["echo"]["method"] == "POST"
    assert base64.b64decode(raw["echo"]["body_b64"]) == b"raw \x00\xff body"
    assert raw["echo"]["headers"]["X-Custom"] == "v1"
    assert raw["echo"]["headers"]["Content-Type"] == "application/octet-stream"
    assert raw["echo"]["cookies"] == {"c1": "cookie-one"}
    assert raw["extra"] == {"when": datetime.datetime(2024, 5, 6, 7, 8, 9),
                            "amount": decimal.Decimal("12.50"), "pair": (1, "two"),
                            "blob": b"\x01\x02"}
    form = echoes["form"]
    assert form["class"] == "FormRequest"
    assert form["echo"]["method"] == "POST"
    assert form["echo"]["body"] == "a=1&b=two+words"
    assert form["echo"]["headers"]["Content-Type"] == "application/x-www-form-urlencoded"
    json_echo = echoes["json"]
    assert json_echo["class"] == "JsonRequest"
    assert json.loads(json_echo["echo"]["body"]) == {"x": [1, 2], "y": "z"}
    assert json_echo["echo"]["headers"]["Content-Type"] == "application/json"
    assert {echoes["same-b'one'"]["echo"]["body"], echoes["same-b'two'"]["echo"]["body"]} == {
        "one", "two"}
    assert site.hits("/echo/same", "POST") == 2
    # the stored errback ran, once, on the failing POST; its item is stored
    assert second.spider.errback_calls == ["failing"]
    assert set(records(db_path)) == {"raw", "form", "json", "same-b'one'", "same-b'two'",
                                     "failure:failing"}
    assert all(n == 1 for path, n in site.counts_by_path().items() if path != "/echo/same")
    stats = istats(second)
    assert stats["requests/done"] == 5
    assert stats["requests/failed"] == 1
    assert stats["records/inserted"] == 6


# -- requests that cannot be stored ---------------------------------------------------------


class UnstorableSpider(PathSpider):
    def __init__(self, url: str, file_path: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.file_path = file_path
        self.handle: Any = None

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/store-test"))

    def parse(self, response: Any) -> Any:
        if path_of(response) != "/ok/store-test":
            yield {"key": path_of(response)}
            return
        self.handle = open(self.file_path)  # noqa: SIM115 - closed in closed()
        yield scrapy.Request(self.at("/ok/u-lambda"), callback=lambda r: None)  # type: ignore[misc]
        yield scrapy.Request(self.at("/ok/u-partial"),
                             callback=functools.partial(self.parse_extra, extra=1))
        yield scrapy.Request(self.at("/ok/u-generator"),
                             meta={"rows": (n for n in range(3))})
        yield scrapy.Request(self.at("/ok/u-file"), cb_kwargs={"fh": self.handle},
                             callback=self.parse_extra)
        yield scrapy.Request(self.at("/ok/u-good"))

    def parse_extra(self, response: Any, **kwargs: Any) -> Any:
        yield {"key": path_of(response)}

    def closed(self, reason: str) -> None:
        if self.handle is not None:
            self.handle.close()


@deferred_f_from_coro_f
async def test_unstorable_requests_are_fetched_from_memory_and_logged_once_per_cause(
    site: LocalSite, db_path: Path, tmp_path: Path, caplog: Any
) -> None:
    data_file = tmp_path / "data.txt"
    data_file.write_text("x")
    crawler = await crawl(UnstorableSpider, settings(db_path), url=site.url,
                          file_path=str(data_file))
    assert finish_reason(crawler) == "finished"
    # only storable requests are in the frontier; the page that yielded the others was done
    # after them (its items: from /ok/u-partial and /ok/u-file, whose callbacks yield some)
    assert frontier(db_path, site) == {
        "/ok/store-test": ("done", None, 1),
        "/ok/u-good": ("done", None, 1),
    }
    assert_nothing_leased(db_path)
    stats = istats(crawler)
    assert stats["requests/unstorable"] == 4
    assert stats["requests/from_memory"] == 4
    assert crawler.dropped_urls == []
    assert site.counts_by_path() == {path: 1 for path in (
        "/ok/store-test", "/ok/u-lambda", "/ok/u-partial", "/ok/u-generator", "/ok/u-file",
        "/ok/u-good")}
    assert set(records(db_path)) == {"/ok/u-partial", "/ok/u-generator", "/ok/u-file",
                                     "/ok/u-good"}
    assert record_owner(db_path, site)["/ok/u-file"] == "/ok/store-test"
    warnings: list[str] = [r.getMessage() for r in caplog.records
                           if r.levelno == logging.WARNING and "from memory" in r.getMessage()]

    def warning_for(name: str) -> str:
        found = [m for m in warnings if f"/ok/{name}" in m]
        assert len(found) == 1, (name, warnings)
        return found[0]

    # once per cause: the lambda and the partial are both a callback that is no spider method
    assert "callback" in warning_for("u-lambda")
    assert not [m for m in warnings if "/ok/u-partial" in m]
    assert "meta['rows']" in warning_for("u-generator")
    assert "generator" in warning_for("u-generator")
    assert "cb_kwargs['fh']" in warning_for("u-file")


# -- pagination driven by a counter on the spider -------------------------------------------------


class CounterPaginationSpider(PathSpider):
    """The next page's number comes from a counter on the spider (a pattern reported to break
    resumes with JOBDIR), so after a resume the counter starts from 1 again while the frontier
    is further on."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.page = 1

    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/page1"))

    def parse(self, response: Any) -> Any:
        yield {"key": path_of(response)}
        self.page += 1
        if self.page <= 5:
            yield response.follow(f"/ok/page{self.page}")


@deferred_f_from_coro_f
async def test_counter_pagination_resume_runs_the_pending_page_and_reports_drops(
    site: LocalSite, db_path: Path, caplog: Any
) -> None:
    one_at_a_time = {"CONCURRENT_REQUESTS": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1}
    first = await crawl(CounterPaginationSpider, settings(
        db_path, CLOSESPIDER_PAGECOUNT=2, **one_at_a_time), url=site.url)
    assert finish_reason(first) == "closespider_pagecount"
    assert_nothing_leased(db_path)
    assert [r[:3] for r in rows(db_path, site)] == [
        ("/ok/page1", "done", None), ("/ok/page2", "done", None),
        ("/ok/page3", "pending", None)]

    site.reset_counts()
    caplog.clear()
    caplog.set_level(logging.INFO, logger="scrapy_idempotent")
    second = await crawl(CounterPaginationSpider, settings(db_path, **one_at_a_time),
                         url=site.url)
    assert finish_reason(second) == "finished"
    assert_nothing_leased(db_path)
    # the pending page still runs after the resume ...
    assert site.counts_by_path() == {"/ok/page3": 1}
    assert [r[:3] for r in rows(db_path, site)] == [
        ("/ok/page1", "done", None), ("/ok/page2", "done", None),
        ("/ok/page3", "done", None)]
    assert set(records(db_path)) == {"/ok/page1", "/ok/page2", "/ok/page3"}
    # ... and the early end (its reset counter linked page 2 again) is visible: the start
    # request and page 2 were dropped as already done, in a stat and in a closing log line
    stats = istats(second)
    assert stats["requests/already_done"] == 2
    assert stats["requests/done"] == 1
    closing = [r.getMessage() for r in caplog.records
               if r.name.startswith("scrapy_idempotent") and "closing" in r.getMessage()]
    assert len(closing) == 1, closing
    assert "2 requests not fetched because already done" in closing[0]


@deferred_f_from_coro_f
async def test_retries_up_to_retry_times_are_not_cut_short_by_the_attempt_limit(
    site: LocalSite, db_path: Path
) -> None:
    # RETRY_TIMES=10: Scrapy makes up to 11 attempts; each retry completes its lease (it is a
    # continuation, not a crash), so IDEMPOTENT_MAX_ATTEMPTS (10) must not quarantine it
    path = "/flaky/10/patient"
    crawler = await crawl(LinksSpider, settings(db_path, RETRY_ENABLED=True, RETRY_TIMES=10),
                          url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    assert site.hits(path) == 11
    assert frontier(db_path, site) == {path: ("done", None, 11)}
    assert_nothing_leased(db_path)
    assert set(records(db_path)) == {path}
    stats = istats(crawler)
    assert stats["requests/retried"] == 10
    assert "requests/quarantined" not in stats


@deferred_f_from_coro_f
async def test_redirect_to_itself_continues_the_same_entry(
    site: LocalSite, db_path: Path
) -> None:
    # a cookie check: the page redirects to itself once; the same request again
    path = "/self/1/cookie-check"
    crawler = await crawl(LinksSpider, settings(db_path), url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    assert site.hits(path) == 2
    assert frontier(db_path, site) == {path: ("done", None, 2)}
    assert_nothing_leased(db_path)
    assert set(records(db_path)) == {path}
    assert crawler.dropped_urls == []
