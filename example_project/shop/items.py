"""Items scraped from the test shop."""

from __future__ import annotations

import scrapy


class ProductItem(scrapy.Item):
    """One product page. ``sku`` is the natural key: stable on the shop, unique per product."""

    sku = scrapy.Field()
    name = scrapy.Field()
    price = scrapy.Field()
    url = scrapy.Field()
