"""A shop spider that counts in ``self.state`` (as a ``JOBDIR`` user's spider does): the
product pages it parsed, per listing page too, and the last SKU seen. Run in the test process,
or by ``scrapy runspider`` (the site's URL in ``-a url=...``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import scrapy


class StateSpider(scrapy.Spider):
    name = "state"

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{url}/list/1"]

    def parse(self, response: Any) -> Iterator[Any]:
        self.state["listings"] = self.state.get("listings", 0) + 1
        yield from response.follow_all(css="a.product", callback=self.parse_product)
        yield from response.follow_all(css="a.listing.next")

    def parse_product(self, response: Any) -> Iterator[Any]:
        sku = response.css(".sku::text").get()
        self.state["products"] = self.state.get("products", 0) + 1
        by_letter = self.state.setdefault("by_digit", {})
        by_letter[sku[-1]] = by_letter.get(sku[-1], 0) + 1
        yield {"sku": sku, "price": response.css(".price::text").get()}
        self.state["last_sku"] = sku  # after the item: the step after it is the page's too
