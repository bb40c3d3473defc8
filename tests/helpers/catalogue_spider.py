"""A spider of the local site's catalogue (``/list`` and its ``/item/<i>`` pages, the
``site`` fixture), for tests about the database rather than the shop."""

from __future__ import annotations

from typing import Any

import scrapy


class CatalogueSpider(scrapy.Spider):
    """``/list`` -> every ``/item/<i>`` -> one dict item ``{"sku", "name", "text"}``."""

    name = "catalogue"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = url

    async def start(self) -> Any:
        yield scrapy.Request(f"{self.base_url}/list", dont_filter=True)

    def parse(self, response: Any) -> Any:
        yield from response.follow_all(css="a.item", callback=self.parse_item)

    def parse_item(self, response: Any) -> Any:
        yield {
            "sku": response.css("span.sku::text").get(),
            "name": response.css("h1::text").get(),
            "text": response.css("p.text::text").get(),
        }
