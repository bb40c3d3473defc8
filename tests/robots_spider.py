"""A spider of a catalogue whose pages link to pages robots.txt disallows: the robots.txt kill
test runs it with ``scrapy runspider`` (``-a url=BASE``): ``/cat/1`` links its products
``/ok/...``, pages under ``/private/`` and ``/cat/2``, and so on (routes the test adds)."""

from typing import Any, ClassVar

import scrapy


class RobotsSpider(scrapy.Spider):
    name = "robots"
    custom_settings: ClassVar[dict[str, Any]] = {
        "ADDONS": {"scrapy_idempotent.Addon": 0}, "ROBOTSTXT_OBEY": True,
        "TELNETCONSOLE_ENABLED": False, "MEMUSAGE_ENABLED": False, "RETRY_ENABLED": False,
        "CONCURRENT_REQUESTS": 8, "CONCURRENT_REQUESTS_PER_DOMAIN": 8, "LOG_LEVEL": "INFO",
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "url"}}

    def __init__(self, url, **kwargs):
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self):
        yield scrapy.Request(f"{self.base_url}/cat/1")

    def parse(self, response):
        yield {"url": response.url}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href)
