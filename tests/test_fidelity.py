"""Drop-in fidelity: with the add-on, a spider behaves as it does under plain Scrapy.

Each test runs real crawls in this process against :class:`paths_site.PathsSite` and checks
what a Scrapy user sees (requests sent and their order, ``item_scraped``, ``request_dropped``,
Scrapy's own stats and log lines) besides what the frontier stored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import scrapy
from paths_site import PathsSite
from scrapy import signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, db_rows


@pytest.fixture
def site() -> Iterator[PathsSite]:
    with PathsSite() as paths_site:
        yield paths_site
    assert paths_site.errors == []


def settings(db_path: Path, **extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "key"},
        "DOWNLOAD_TIMEOUT": 5,
        "CONCURRENT_REQUESTS": 4,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "TELNETCONSOLE_ENABLED": False,
    }
    values.update(extra)
    return crawl_settings(db_path, **values)


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
    await crawler.crawl_async(**kwargs)
    return observed


def records(db_path: Path) -> list[dict[str, Any]]:
    return [json.loads(data) for (data,) in db_rows(db_path, "SELECT data FROM records")]


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


# -- IDEMPOTENT_RECORD_ID_FIELD ----------------------------------------------------------------


class OneItemSpider(SiteSpider):
    async def start(self) -> Any:
        yield scrapy.Request(self.at("/ok/one"))

    def parse(self, response: Any) -> Any:
        yield {"key": "one"}


@pytest.mark.parametrize("value", [None, ""])
@deferred_f_from_coro_f
async def test_record_id_field_none_or_empty_leaves_items_unchanged(
    site: PathsSite, db_path: Path, value: str | None
) -> None:
    observed = await crawl(OneItemSpider, settings(
        db_path, IDEMPOTENT_RECORD_ID_FIELD=value), url=site.url)
    assert observed.reason == "finished"
    assert observed.scraped == [{"key": "one"}]
    assert records(db_path) == [{"key": "one"}]


@deferred_f_from_coro_f
async def test_record_id_field_default_stamps_dict_items(site: PathsSite, db_path: Path) -> None:
    observed = await crawl(OneItemSpider, settings(db_path), url=site.url)
    [item] = observed.scraped
    [(record_id,)] = db_rows(db_path, "SELECT record_id FROM records")
    assert item == {"key": "one", "record_id": record_id}
