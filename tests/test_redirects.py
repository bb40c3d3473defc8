"""Redirects inside Scrapy, each as a real crawl of the local site: HTTP and meta-refresh
redirects end their entry ``redirected`` and the target is crawled once; chains, loops, too
many redirects and a redirect to itself end, and no lease dangles."""

from __future__ import annotations

from typing import Any

import pytest
import scrapy
from local_site import LocalSite
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
    rows,
    settings,
)

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
    site: LocalSite, crawl_database: str, code: int
) -> None:
    method, body = ("POST", b"payload=1") if code == 307 else ("GET", b"")
    source, target = f"/redirect/{code}/r?to=/echo/t{code}", f"/echo/t{code}"
    crawler = await crawl(RedirectSpider, settings(crawl_database), url=site.url,
                          plan=[(source, method, body)])
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        source: ("redirected", None, 1),
        target: ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    # the target's item is attributed to the target
    assert record_owner(crawl_database, site) == {target: target}
    stored = records(crawl_database)[target]
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
    site: LocalSite, crawl_database: str
) -> None:
    source = "/refresh/m?to=/ok/meta-target"
    crawler = await crawl(RedirectSpider, settings(crawl_database), url=site.url,
                          plan=[(source, "GET", b"")])
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        source: ("redirected", None, 1),
        "/ok/meta-target": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    assert record_owner(crawl_database, site) == {"/ok/meta-target": "/ok/meta-target"}
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
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(RedirectToDoneSpider, settings(crawl_database), url=site.url)
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/ok/already": ("done", None, 1),
        "/redirect/302/late?to=/ok/already": ("redirected", None, 1),
    }
    assert_nothing_leased(crawl_database)
    assert site.hits("/ok/already") == 1  # no second fetch of the target
    assert set(records(crawl_database)) == {"/ok/already"}
    stats = istats(crawler)
    assert stats["requests/redirected"] == 1
    assert stats["requests/done"] == 1
    assert stats["requests/already_done"] == 1
    assert stats["records/inserted"] == 1


@deferred_f_from_coro_f
async def test_chain_of_three_redirects(site: LocalSite, crawl_database: str) -> None:
    crawler = await crawl(RedirectSpider, settings(crawl_database), url=site.url,
                          plan=[("/chain/3/c", "GET", b"")])
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/chain/3/c": ("redirected", None, 1),
        "/chain/2/c": ("redirected", None, 1),
        "/chain/1/c": ("redirected", None, 1),
        "/chain/0/c": ("done", None, 1),
    }
    assert_nothing_leased(crawl_database)
    assert record_owner(crawl_database, site) == {"/chain/0/c": "/chain/0/c"}
    assert site.counts_by_path() == {f"/chain/{n}/c": 1 for n in range(4)}
    stats = istats(crawler)
    assert stats["requests/redirected"] == 3
    assert stats["requests/done"] == 1
    assert stats["records/inserted"] == 1


@deferred_f_from_coro_f
async def test_too_many_redirects_ends_failed_and_calls_the_errback_once(
    site: LocalSite, crawl_database: str
) -> None:
    crawler = await crawl(RedirectSpider, settings(crawl_database, REDIRECT_MAX_TIMES=2),
                          url=site.url, plan=[("/chain/3/m", "GET", b"")])
    assert finish_reason(crawler) == "finished"
    assert frontier(crawl_database, site) == {
        "/chain/3/m": ("redirected", None, 1),
        "/chain/2/m": ("redirected", None, 1),
        "/chain/1/m": ("failed", "ignored/IgnoreRequest", 1),  # its redirect was discarded
    }
    assert_nothing_leased(crawl_database)
    assert site.hits("/chain/0/m") == 0
    assert crawler.spider.errback_calls == ["/chain/1/m"]
    assert record_owner(crawl_database, site) == {"failure:/chain/1/m": "/chain/1/m"}
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
async def test_redirect_loop_ends(site: LocalSite, crawl_database: str) -> None:
    crawler = await crawl(LoopSpider, settings(crawl_database), url=site.url, dont_filter=False)
    assert finish_reason(crawler) == "finished"
    # 0 -> 1 -> 0: the way back is to an entry already answered
    assert frontier(crawl_database, site) == {
        "/loop/l/0": ("redirected", None, 1),
        "/loop/l/1": ("redirected", None, 1),
    }
    assert_nothing_leased(crawl_database)
    assert site.counts_by_path() == {"/loop/l/0": 1, "/loop/l/1": 1}
    assert istats(crawler)["requests/already_done"] == 1


@deferred_f_from_coro_f
async def test_redirect_loop_of_a_dont_filter_request_ends_at_redirect_max_times(
    site: LocalSite, crawl_database: str
) -> None:
    # dont_filter (start_urls) is inherited by redirects: each hop is a new entry, as with
    # Scrapy's own scheduler, until REDIRECT_MAX_TIMES
    crawler = await crawl(LoopSpider, settings(crawl_database, REDIRECT_MAX_TIMES=3), url=site.url,
                          dont_filter=True)
    assert finish_reason(crawler) == "finished"
    assert rows(crawl_database, site) == [
        ("/loop/l/0", "redirected", None, 1),
        ("/loop/l/0", "redirected", None, 1),
        ("/loop/l/1", "failed", "ignored/IgnoreRequest", 1),
        ("/loop/l/1", "redirected", None, 1),
    ]
    assert_nothing_leased(crawl_database)
    assert site.request_count == 4


@deferred_f_from_coro_f
async def test_redirect_to_itself_continues_the_same_entry(
    site: LocalSite, crawl_database: str
) -> None:
    # a cookie check: the page redirects to itself once; the same request again
    path = "/self/1/cookie-check"
    crawler = await crawl(LinksSpider, settings(crawl_database), url=site.url, start_paths=(path,))
    assert finish_reason(crawler) == "finished"
    assert site.hits(path) == 2
    assert frontier(crawl_database, site) == {path: ("done", None, 2)}
    assert_nothing_leased(crawl_database)
    assert set(records(crawl_database)) == {path}
    assert crawler.dropped_urls == []
