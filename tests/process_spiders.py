"""Spiders the kill tests run in a real ``CrawlerProcess`` of their own (a subprocess):

    python tests/process_spiders.py --url URL --db DB --marker FILE --stats FILE [-s NAME=VALUE]

runs :class:`VariantsSpider` (or the spider named by ``--spider``) with the add-on in a
``CrawlerProcess``. The marker file gets one line per item that reached the item pipelines
(:class:`MarkerPipeline`, priority 900, before ``UpsertPipeline``); the stats file receives
the crawl's stats as JSON when the crawl ends (not when the process is killed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import scrapy


class MarkerPipeline:
    """Appends the key of every item it sees to ``MARKER_FILE`` (flushed at once)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_crawler(cls, crawler: Any) -> MarkerPipeline:
        return cls(crawler.settings.get("MARKER_FILE"))

    def process_item(self, item: Any, spider: Any = None) -> Any:  # Scrapy 2.13 passes it
        with open(self.path, "a") as f:
            f.write(f"{item['key']}\n")
            f.flush()
            os.fsync(f.fileno())
        return item


class VariantsSpider(scrapy.Spider):
    """A product page yields 3 variant items, then awaits a request to a URL that blocks
    until the test releases it, so the page cannot finish before then."""

    name = "variants"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base_url}/ok/product1", callback=self.parse_product)

    async def parse_product(self, response: Any) -> Any:
        for colour in ("red", "green", "blue"):
            yield {"key": f"product1-{colour}", "colour": colour, "url": response.url}
        stock = scrapy.Request(f"{self.base_url}/block/stock1")
        engine = self.crawler.engine
        if hasattr(engine, "download_async"):
            answer = await engine.download_async(stock)
        else:  # Scrapy 2.13: ExecutionEngine.download() returns a Deferred
            from scrapy.utils.defer import maybe_deferred_to_future

            answer = await maybe_deferred_to_future(engine.download(stock))
        self.logger.info("stock answered %s", answer.status)


class MemoryChildSpider(scrapy.Spider):
    """A page yields an item and a request that cannot be stored (a live object in its
    meta), to a URL that blocks until the test releases it: the page is not done before
    that request is."""

    name = "memory_child"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base_url}/ok/page1", callback=self.parse_page)

    def parse_page(self, response: Any) -> Any:
        yield {"key": "page1"}
        yield scrapy.Request(f"{self.base_url}/block/memory-child", callback=self.parse_child,
                             meta={"session": object()})

    def parse_child(self, response: Any) -> Any:
        yield {"key": "memory-child"}


SPIDERS = {"variants": VariantsSpider, "memory_child": MemoryChildSpider}


def main(argv: list[str] | None = None) -> None:
    from scrapy.crawler import CrawlerProcess

    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--stats", required=True)
    parser.add_argument("-s", dest="settings", action="append", default=[])
    parser.add_argument("--spider", default="variants", choices=sorted(SPIDERS))
    args = parser.parse_args(argv)
    settings: dict[str, Any] = {
        "ADDONS": {"scrapy_idempotent.Addon": 0},
        "IDEMPOTENT_DATABASE": args.db,
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "key"},
        "ITEM_PIPELINES": {"process_spiders.MarkerPipeline": 900},
        "MARKER_FILE": args.marker,
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "LOG_LEVEL": "INFO",
        "RETRY_ENABLED": False,
        "DOWNLOAD_TIMEOUT": 60,
    }
    for pair in args.settings:
        name, _, value = pair.partition("=")
        settings[name] = json.loads(value)
    process = CrawlerProcess(settings)
    crawler = process.create_crawler(SPIDERS[args.spider])
    process.crawl(crawler, url=args.url)
    process.start()
    with open(args.stats, "w") as f:
        json.dump(crawler.stats.get_stats(), f, default=str)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.modules.setdefault("process_spiders", sys.modules[__name__])
    main()
