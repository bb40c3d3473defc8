"""A shop spider whose product pages each yield two item types keyed by the same field: a
product and its offer (``sku``). Run in the test process, or by ``scrapy runspider`` (the
site's URL in ``-a url=...``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import scrapy


class ProductItem(scrapy.Item):
    sku = scrapy.Field()
    name = scrapy.Field()
    record_id = scrapy.Field()


class OfferItem(scrapy.Item):
    sku = scrapy.Field()
    price = scrapy.Field()
    record_id = scrapy.Field()


#: The natural keys the tests configure: both types keyed by ``sku``.
NATURAL_KEYS = {f"{__name__}.ProductItem": "sku", f"{__name__}.OfferItem": "sku"}


class OffersSpider(scrapy.Spider):
    name = "offers"

    def __init__(self, url: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_urls = [f"{url}/list/1"]

    def parse(self, response: Any) -> Iterator[Any]:
        yield from response.follow_all(css="a.product", callback=self.parse_product)
        yield from response.follow_all(css="a.listing.next")

    def parse_product(self, response: Any) -> Iterator[Any]:
        sku = response.css(".sku::text").get()
        yield ProductItem(sku=sku, name=response.css(".name::text").get())
        yield OfferItem(sku=sku, price=response.css(".price::text").get())
