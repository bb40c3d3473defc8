"""Real crawls in this process against the local site (``site`` fixture), observed as a Scrapy
user sees them: the requests sent and their order, ``item_scraped``, ``request_dropped``,
Scrapy's own stats; and the records the frontier stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import scrapy
from scrapy import signals
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end
from helpers.stored import stored_products


def settings(database: str | Path, **extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "key"},
        "DOWNLOAD_TIMEOUT": 5,
        "CONCURRENT_REQUESTS": 4,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "TELNETCONSOLE_ENABLED": False,
    }
    values.update(extra)
    return crawl_settings(database, **values)


class Observed:
    """What Scrapy's signals told a user about one crawl."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.scraped: list[Any] = []
        self.dropped: list[str] = []
        self.sent: list[str] = []
        crawler.signals.connect(self.on_scraped, signals.item_scraped)
        crawler.signals.connect(self.on_dropped, signals.request_dropped)
        crawler.signals.connect(self.on_sent, signals.request_reached_downloader)

    def on_scraped(self, item: Any) -> None:
        self.scraped.append(item)

    def on_dropped(self, request: Any) -> None:
        self.dropped.append(request.url)

    def on_sent(self, request: Any) -> None:
        self.sent.append(request.url)

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.crawler.stats.get_stats())

    @property
    def reason(self) -> str:
        return str(self.crawler.stats.get_value("finish_reason"))


async def crawl(spidercls: type, settings_dict: dict[str, Any], **kwargs: Any) -> Observed:
    crawler = get_crawler(spidercls, settings_dict)
    observed = Observed(crawler)
    await crawl_to_end(crawler, **kwargs)
    return observed


def records(database: str | Path) -> list[dict[str, Any]]:
    """Every stored record's data, read through the store interface (record ID order)."""
    return stored_products(database)


def path_of(url: str) -> str:
    from urllib.parse import urlsplit

    split = urlsplit(url)
    return split.path + (f"?{split.query}" if split.query else "")


class SiteSpider(scrapy.Spider):
    name = "fidelity"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    def at(self, path: str) -> str:
        return self.base_url + path


#: One request at a time, from download to the end of its callback: a scraper slot of one byte
#: holds the next download back while a response is being processed. (Before 2.18 Scrapy
#: waited 0.1 s before each callback while the downloader went on, which made even plain
#: Scrapy's order depend on timing.)
ONE_AT_A_TIME = {"CONCURRENT_REQUESTS": 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 1,
                 "SCRAPER_SLOT_MAX_ACTIVE_SIZE": 1}
