"""The hand-out gives the engine the request object the callback yielded (as Scrapy does) when
this process took it into the frontier lately; a copy decoded from the stored text otherwise."""

from __future__ import annotations

from typing import Any

import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end, db_rows
from scrapy_idempotent import codec as codec_module
from scrapy_idempotent.recent_requests import RecentRequests


def test_kept_requests_are_taken_once_and_only_with_their_stored_text() -> None:
    recent = RecentRequests(limit=2)
    a, b, c = (scrapy.Request(f"http://example.com/{n}") for n in "abc")
    recent.keep("ka", "data a", a)
    assert recent.take("ka", "other text") is None  # stored otherwise since: not this one
    assert recent.take("ka", "data a") is None  # forgotten by the first take
    recent.keep("ka", "data a", a)
    assert recent.take("ka", "data a") is a
    assert recent.take("ka", "data a") is None
    recent.keep("ka", "data a", a)
    recent.keep("kb", "data b", b)
    recent.keep("kc", "data c", c)  # over the limit: the oldest goes
    assert len(recent) == 2
    assert recent.take("ka", "data a") is None
    assert recent.take("kc", "data c") is c
    assert recent.take("kb", "data b") is b


class YieldedSpider(scrapy.Spider):
    """Follows the shop's links; remembers every request object it yielded, and which
    objects the engine handed back to its callback."""

    name = "yielded"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url = url
        self.yielded: list[scrapy.Request] = []  # (kept alive: their ids stay theirs)
        self.answered: list[scrapy.Request] = []

    async def start(self) -> Any:
        request = scrapy.Request(self.url + "/list/1", callback=self.parse)
        self.yielded.append(request)
        yield request

    def parse(self, response: Any) -> Any:
        self.answered.append(response.request)
        for href in response.css("a::attr(href)").getall():
            request = response.follow(href, callback=self.parse)
            self.yielded.append(request)
            yield request


@deferred_f_from_coro_f
async def test_the_engine_gets_the_yielded_request_objects(tmp_path: Any,
                                                           monkeypatch: Any) -> None:
    decoded: list[str] = []
    decode = codec_module.RequestCodec.decode

    def counting_decode(self: Any, text: str) -> scrapy.Request:
        decoded.append(text)
        return decode(self, text)

    monkeypatch.setattr(codec_module.RequestCodec, "decode", counting_decode)
    with LocalSite(listing_pages=3, products_per_page=4) as shop:
        crawler = get_crawler(YieldedSpider, crawl_settings(tmp_path / "f.db"))
        await crawl_to_end(crawler, url=shop.url)
    spider = crawler.spider
    assert crawler.stats.get_value("finish_reason") == "finished"
    done = db_rows(tmp_path / "f.db", "SELECT count(*) FROM requests WHERE state = 'done'")
    assert done[0][0] == len(spider.answered) > 10
    yielded = {id(request) for request in spider.yielded}
    assert all(id(request) in yielded for request in spider.answered)
    assert decoded == []


class TwiceSpider(scrapy.Spider):
    """Yields one ``dont_filter`` request object twice: two frontier entries."""

    name = "twice"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url = url
        self.answered: list[scrapy.Request] = []

    async def start(self) -> Any:
        yield scrapy.Request(self.url + "/ok/home", callback=self.parse_home)

    def parse_home(self, response: Any) -> Any:
        request = scrapy.Request(self.url + "/ok/twice", dont_filter=True)
        yield request
        yield request

    def parse(self, response: Any) -> Any:
        self.answered.append(response.request)
        return []


@deferred_f_from_coro_f
async def test_one_object_yielded_twice_is_fetched_twice(tmp_path: Any) -> None:
    with LocalSite(listing_pages=1, products_per_page=1) as shop:
        crawler = get_crawler(TwiceSpider, crawl_settings(tmp_path / "f.db"))
        await crawl_to_end(crawler, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    answered = crawler.spider.answered
    assert len(answered) == 2
    assert answered[0] is not answered[1]
    assert [r.url for r in answered] == [shop.url + "/ok/twice"] * 2
    done = db_rows(tmp_path / "f.db", "SELECT count(*) FROM requests WHERE state = 'done'")
    assert done[0][0] == 3
