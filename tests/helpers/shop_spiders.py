"""Variants of the example project's shop spider that several test files crawl with."""

from __future__ import annotations

from typing import Any

from shop.spiders.shop import ShopSpider

#: The shop's products are keyed by SKU.
NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


class PartlyBrokenSpider(ShopSpider):
    """The shop spider with a bug: products whose SKU ends in 0 lose their SKU."""

    broken = True

    def parse_product(self, response: Any) -> Any:
        for item in super().parse_product(response):
            if type(self).broken and item["sku"].endswith("0"):
                item["sku"] = " "
            yield item
