"""The shop spider: plain Scrapy, with no idempotency code at all.

Crash safety comes from the project's settings (the ``scrapy_idempotent`` add-on), not from
anything here::

    scrapy crawl shop -a url=http://127.0.0.1:8000
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import scrapy
from scrapy.http import Response, TextResponse

from shop.items import ProductItem


class ShopSpider(scrapy.Spider):
    """Walks the listing pages of the test shop and scrapes every product page."""

    name = "shop"

    def __init__(self, url: str = "http://127.0.0.1:8000", *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.base_url = url.rstrip("/")

    async def start(self) -> AsyncIterator[Any]:
        # dont_filter=True, like the requests Scrapy builds from start_urls.
        yield scrapy.Request(f"{self.base_url}/list/1", callback=self.parse, dont_filter=True)

    def parse(self, response: Response, **kwargs: Any) -> Iterator[scrapy.Request]:
        """A listing page: follow every product and every other listing page."""
        if not isinstance(response, TextResponse):  # not HTML: nothing to follow
            return
        yield from response.follow_all(css="a.product", callback=self.parse_product)
        yield from response.follow_all(css="a.listing", callback=self.parse)

    def parse_product(self, response: Response) -> Iterator[ProductItem]:
        """A product page: one item."""
        if not isinstance(response, TextResponse):  # not HTML: no product
            return
        yield ProductItem(
            sku=response.css("span.sku::text").get(),
            name=response.css("h1.name::text").get(),
            price=response.css("span.price::text").get(),
            url=response.url,
        )
