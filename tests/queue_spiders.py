"""A spider for queue-fed crawls in subprocesses (``scrapy runspider`` from the example
project): the shop spider without start requests, so all its work comes from the queue."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from shop.spiders.shop import ShopSpider


class QueueShopSpider(ShopSpider):
    name = "queue_shop"

    async def start(self) -> AsyncIterator[Any]:
        return
        yield
