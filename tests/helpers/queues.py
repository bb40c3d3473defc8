"""Crawls fed from a queue (Redis stream, RabbitMQ, SQS): the spider with no start requests
that takes all its work from the queue, its settings and messages, and waiting on a state while
the reactor runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from local_site import LocalSite

from crawling import crawl_settings
from redis_server import RedisServer
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}
GROUP = "scrapy_idempotent"


class QueueSpider(ShopSpider):
    """The shop spider with no start requests: all its work comes from the queue."""

    name = "queue_shop"

    async def start(self) -> AsyncIterator[Any]:
        return
        yield


def queue_settings(db_path: str | Path, server: RedisServer, key: str,
                   **extra: Any) -> dict[str, Any]:
    # CLOSESPIDER_TIMEOUT: a crawl that would wait for its queue forever ends (not finished)
    extra = {"CLOSESPIDER_TIMEOUT": 150, **extra}
    return crawl_settings(db_path, IDEMPOTENT_QUEUE_URL=server.url, IDEMPOTENT_QUEUE_KEY=key,
                          IDEMPOTENT_QUEUE_POLL_SECONDS=0.05, **NATURAL_KEYS, **extra)


def product(shop: LocalSite, number: int) -> str:
    return f"{shop.url}/product/SKU-{number:05d}"


def product_message(shop: LocalSite, number: int) -> dict[str, str]:
    """A JSON request message for a product page (``url`` alone would use ``parse``)."""
    return {"request": json.dumps({"url": product(shop, number), "callback": "parse_product"})}


def acknowledged_all(client: Any, key: str) -> bool:
    """Every entry of the stream was delivered to the group and none is pending."""
    (group,) = client.xinfo_groups(key)
    return bool(group["pending"] == 0 and group["last-delivered-id"] == client.xinfo_stream(
        key)["last-generated-id"])


async def reactor_wait_for(condition: Any, what: str, timeout: float = 120) -> None:
    """Poll a state while the reactor keeps running (the crawls go on meanwhile)."""
    import time

    from scrapy.utils.defer import maybe_deferred_to_future
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await maybe_deferred_to_future(deferLater(reactor, 0.05, lambda: None))
