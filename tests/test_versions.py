"""The Scrapy releases the package runs on (:mod:`scrapy_idempotent.scrapy_compat`).

Every supported release is tested whole by the matrix (``.ci/matrix.py``); these tests check,
on whichever release runs them, what a release outside the range gets and that the
backports behave as the newest Scrapy does. A missing feature is simulated by removing it
from Scrapy's class for the test (an older Scrapy cannot be imported beside this one); the
matrix also runs ``scrapy crawl`` under the release below the range.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import scrapy
from local_site import LocalSite
from scrapy.core.scraper import Scraper
from scrapy.http import HtmlResponse, JsonResponse, Response, TextResponse
from scrapy.settings import Settings
from scrapy.utils.defer import deferred_f_from_coro_f
from twisted.internet import defer, error
from twisted.web import _newclient
from twisted.web import error as web_error

from crawling import crawl_settings, run_crawl
from helpers.stored import stored_records
from scrapy_idempotent import Addon, UnsupportedScrapy, scrapy_compat
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


@pytest.fixture
def small_shop() -> LocalSite:
    with LocalSite(listing_pages=1, products_per_page=3) as site:
        yield site


def test_the_supported_range_is_the_one_setup_cfg_states() -> None:
    setup_cfg = (Path(__file__).resolve().parent.parent / "setup.cfg").read_text()
    floor = "{}.{}".format(*scrapy_compat.OLDEST_SUPPORTED)
    assert f"scrapy>={floor}\n" in setup_cfg
    assert scrapy_compat.supported_range() == "2.13 to 2.19"
    assert scrapy_compat.scrapy_version("2.19.0") == (2, 19)
    assert scrapy_compat.scrapy_version("2.20.0rc1") == (2, 20)
    assert scrapy_compat.scrapy_version("garbage") == (0, 0)
    assert scrapy_compat.OLDEST_SUPPORTED <= scrapy_compat.scrapy_version() \
        <= scrapy_compat.NEWEST_TESTED  # the matrix runs only supported releases


def test_a_scrapy_without_async_start_is_refused_by_the_add_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(scrapy.Spider, "start")  # as in Scrapy 2.12
    monkeypatch.setattr(scrapy, "__version__", "2.12.0")
    settings = Settings()
    with caplog.at_level(logging.CRITICAL), pytest.raises(UnsupportedScrapy) as raised:
        Addon().update_settings(settings)
    message = str(raised.value)
    assert "supports Scrapy 2.13 to 2.19" in message
    assert "Scrapy 2.12.0 lacks the asynchronous Spider.start() (Scrapy 2.13)" in message
    assert "pip install 'scrapy>=2.13,<2.20'" in message
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL] == [
        f"{message}; the crawl was not started"]
    assert settings["SCHEDULER"] != "scrapy_idempotent.IdempotentScheduler"  # nothing wired


@deferred_f_from_coro_f
async def test_an_engine_without_a_hook_is_refused_before_any_request(
    small_shop: LocalSite, crawl_database: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    # a release whose scraper lost a method the completion hooks wrap
    monkeypatch.delattr(Scraper, "handle_spider_error")
    with pytest.raises(UnsupportedScrapy, match=r"lacks the engine internals that exact "
                       r"completion hooks \(Scraper.handle_spider_error\(\)\)"):
        await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                        url=small_shop.url)
    assert small_shop.request_count == 0
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL
                and "lacks the engine internals" in r.getMessage()]
    assert len(critical) == 1


@deferred_f_from_coro_f
async def test_an_engine_whose_hook_changed_shape_is_refused_before_any_request(
    small_shop: LocalSite, crawl_database: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    # a release whose scraper's method takes the spider again, in the middle: the hooks would
    # pass the response where the spider is expected and complete requests wrongly
    def handle_spider_error(self: Scraper, failure: Any, spider: Any, request: Any,
                            response: Any) -> None:
        pass

    monkeypatch.setattr(Scraper, "handle_spider_error", handle_spider_error)
    with pytest.raises(UnsupportedScrapy, match=r"in the shape it calls them: "
                       r"Scraper\.handle_spider_error\(failure, request, response\) \(its "
                       r"parameters are \(failure, spider, request, response\)\)"):
        await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                        url=small_shop.url)
    assert small_shop.request_count == 0
    critical = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1 and "\n" not in critical[0]


@deferred_f_from_coro_f
async def test_a_newer_release_with_every_hook_runs_with_one_warning(
    small_shop: LocalSite, crawl_database: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scrapy, "__version__", "2.99.0")
    monkeypatch.setattr(scrapy_compat, "_warned_untested", False)
    with caplog.at_level(logging.WARNING, logger="scrapy_idempotent"):
        crawler = await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                                  url=small_shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert len(stored_records(crawl_database)) == 3
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "scrapy_idempotent.scrapy_compat"]
    # checked by the add-on and again by the scheduler, said once
    assert warnings == [
        "scrapy_idempotent 0.1.0 is tested with Scrapy 2.13 to 2.19, not 2.99.0: the engine "
        "hooks it needs are present, but check that interrupted crawls resume correctly"]


def test_a_supported_release_runs_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scrapy_compat, "_warned_untested", False)
    with caplog.at_level(logging.WARNING, logger="scrapy_idempotent"):
        scrapy_compat.check_scrapy()
    assert caplog.records == []


@pytest.mark.parametrize(("exc", "name"), [
    (error.TimeoutError(), "DownloadTimeoutError"),
    (type("ProxyTimeout", (error.TimeoutError,), {})(), "DownloadTimeoutError"),  # subclass
    (error.TCPTimedOutError(), "TCPTimedOutError"),  # not a TimeoutError: not wrapped either
    (defer.TimeoutError(), "DownloadTimeoutError"),
    (error.DNSLookupError(), "CannotResolveHostError"),
    (error.ConnectionRefusedError(), "DownloadConnectionRefusedError"),
    (defer.CancelledError(), "DownloadCancelledError"),
    (_newclient.ResponseFailed([]), "DownloadFailedError"),
    (web_error.SchemeNotSupported("gopher"), "UnsupportedURLSchemeError"),
    (error.ConnectionLost(), "ConnectionLost"),  # not wrapped by Scrapy either
    (ValueError("x"), "ValueError"),
])
def test_download_failures_are_named_as_scrapy_2_15_names_them(
    exc: BaseException, name: str
) -> None:
    assert scrapy_compat.failure_name(exc) == name


def test_scrapys_own_download_errors_keep_their_names() -> None:
    exceptions = pytest.importorskip("scrapy.exceptions")
    for cls_name in ("DownloadTimeoutError", "CannotResolveHostError",
                     "DownloadConnectionRefusedError", "DownloadFailedError"):
        cls = getattr(exceptions, cls_name, None)
        if cls is None:  # Scrapy < 2.15: the Twisted ones reach the engine (tested above)
            continue
        assert scrapy_compat.failure_name(cls("x")) == cls_name


RESPONSES = [
    Response("http://shop/a", status=404, body=b"\x00\x01", flags=["cached"],
             headers={"X-A": ["1", "2"]}, protocol="HTTP/1.1"),
    TextResponse("http://shop/b", body="é".encode(), encoding="utf-8"),
    HtmlResponse("http://shop/c", body=b"<html></html>",
                 headers={"Content-Type": "text/html; charset=latin-1"}),
    JsonResponse("http://shop/d.json", body=b'{"a": 1}'),
]


@pytest.mark.parametrize("response", RESPONSES, ids=lambda r: type(r).__name__)
def test_the_response_backport_is_scrapys_to_dict(response: Response) -> None:
    data = scrapy_compat._response_to_dict(response)
    if hasattr(response, "to_dict"):  # Scrapy 2.19: the backport says the same
        assert data == response.to_dict()
    for built in (scrapy_compat._response_from_dict(dict(data)),
                  scrapy_compat.response_from_dict(dict(data))):
        assert type(built) is type(response)
        assert scrapy_compat._response_to_dict(built) == data
        assert built.body == response.body
        assert built.headers == response.headers
    without_class = {k: v for k, v in data.items() if k != "_class"}
    guessed = scrapy_compat._response_from_dict(without_class)  # as responsetypes guesses
    assert guessed.url == response.url and guessed.body == response.body


@deferred_f_from_coro_f
async def test_the_hooks_shadow_the_engine_while_the_spider_runs_and_are_removed_at_close(
    small_shop: LocalSite, crawl_database: str
) -> None:
    from scrapy import signals
    from scrapy.utils.test import get_crawler

    from crawling import crawl_to_end

    hooked = ("remove_request", "_handle_downloader_output", "handle_spider_output_async",
              "handle_spider_error", "start_itemproc_async", "start_itemproc")
    seen: dict[str, set[str]] = {}

    def shadowed(engine: object) -> set[str]:
        objects = (engine, engine._slot, engine.scraper)  # type: ignore[attr-defined]
        return {name for obj in objects for name in hooked if name in vars(obj)}

    crawler = get_crawler(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS))

    def opened() -> None:
        seen["open"] = shadowed(crawler.engine)

    def closed() -> None:
        seen["closed"] = shadowed(crawler.engine)  # the scheduler closed before this signal

    crawler.signals.connect(opened, signals.spider_opened)
    crawler.signals.connect(closed, signals.spider_closed)
    await crawl_to_end(crawler, url=small_shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    itemproc = "start_itemproc_async" if hasattr(crawler.engine.scraper,
                                                  "start_itemproc_async") else "start_itemproc"
    assert seen["open"] == {"remove_request", "_handle_downloader_output",
                            "handle_spider_output_async", "handle_spider_error", itemproc}
    assert seen["closed"] == set()


def test_the_stat_counter_counts_as_inc_value_does() -> None:
    from scrapy.statscollectors import MemoryStatsCollector
    from scrapy.utils.test import get_crawler

    crawler = get_crawler(scrapy.Spider)
    stats = MemoryStatsCollector(crawler)
    count = scrapy_compat.stat_counter(stats)
    count("a")
    count("a", 3)
    assert stats.get_value("a") == 4
    stats.set_stats({"b": 1})  # a collector whose dict is replaced: counts go to the new one
    count("b")
    count("a")
    assert stats.get_stats() == {"b": 2, "a": 1}

    class OwnCollector(MemoryStatsCollector):  # a collector of its own: its method is called
        def inc_value(self, key: str, count: int = 1, start: int = 0,
                      spider: object = None) -> None:
            super().inc_value(f"own/{key}", count, start)

    own = OwnCollector(crawler)
    scrapy_compat.stat_counter(own)("a")
    assert own.get_stats() == {"own/a": 1}
