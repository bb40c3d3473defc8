"""A spider whose product page ``SKU-00013`` kills its own process (SIGKILL) every time it is
parsed, as an out-of-memory kill or a segfault would: the quarantine tests run it with
``scrapy runspider`` against the local shop (``-a url=...``), with their own ``-s`` settings
(concurrency, ``IDEMPOTENT_MAX_ATTEMPTS``) over the few set here."""

import os
import signal
from typing import Any, ClassVar

import scrapy

#: The product page that kills the process.
POISON_SKU = "SKU-00013"


class PoisonSpider(scrapy.Spider):
    name = "poison"
    custom_settings: ClassVar[dict[str, Any]] = {"ADDONS": {"scrapy_idempotent.Addon": 0},
        "IDEMPOTENT_NATURAL_KEYS": {"dict": "sku"}, "ROBOTSTXT_OBEY": False}

    def __init__(self, url, **kwargs):
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self):
        yield scrapy.Request(self.base_url + "/list/1", dont_filter=True)

    def parse(self, response):
        yield from response.follow_all(css="a.product", callback=self.parse_product)
        yield from response.follow_all(css="a.next", callback=self.parse)

    def parse_product(self, response):
        sku = response.css("span.sku::text").get()
        if sku == POISON_SKU:
            os.kill(os.getpid(), signal.SIGKILL)
        yield {"sku": sku}
