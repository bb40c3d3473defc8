"""The queue input asks the frontier about the requests it fed (was it refused before the
frontier? which redirect targets were?). A frontier that cannot be read at once (StoreBusy:
on PostgreSQL, a lost connection being re-established on another thread) leaves the answer
for later: the message is kept, decided at the next reconciliation, and the crawl neither
drops the poll's other messages nor waits forever for a refused redirect target."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from local_site import LocalSite
from scrapy import signals as scrapy_signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_to_end, frontier_counts
from helpers.queues import QueueSpider, acknowledged_all, product_message, queue_settings
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)
from scrapy_idempotent import scrapy_compat
from scrapy_idempotent.exceptions import StoreBusy


class ReadsBusyOnce:
    """The scheduler's ``request_state`` raises StoreBusy the first time each fingerprint is
    asked (as the store's read does while its connection is being re-established)."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.refused: list[str] = []
        crawler.signals.connect(self.spider_opened, signal=scrapy_signals.spider_opened)

    def spider_opened(self) -> None:
        scheduler = scrapy_compat.engine_scheduler(self.crawler)
        state = scheduler.request_state

        def busy_once(fingerprint: str) -> str | None:
            if fingerprint not in self.refused:
                self.refused.append(fingerprint)
                raise StoreBusy("the connection is being re-established")
            return state(fingerprint)

        scheduler.request_state = busy_once


@deferred_f_from_coro_f
async def test_queue_decisions_wait_for_a_readable_frontier(
        redis_server: RedisServer, db_path: Path) -> None:  # noqa: F811
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    with LocalSite(listing_pages=1, products_per_page=2) as shop:
        # redirected off-site: done once its redirect is committed
        client.xadd(key, {"url": f"{shop.url}/redirect/302/away?to=http://elsewhere.invalid/x"})
        client.xadd(key, {"url": "http://elsewhere.invalid/y"})  # refused: parked
        client.xadd(key, product_message(shop, 1))
        client.xadd(key, {"stop": "1"})
        spider = type("OffsiteQueueSpider", (QueueSpider,), {"allowed_domains": ["127.0.0.1"]})
        settings = queue_settings(db_path, redis_server, key)
        settings["CLOSESPIDER_TIMEOUT"] = 60  # a message waited for in vain ends the crawl
        crawler = get_crawler(spider, settings)
        busy = ReadsBusyOnce(crawler)
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert len(busy.refused) >= 3  # each question was met by a busy frontier first
    assert frontier_counts(db_path) == {"redirected": 1, "done": 1}
    assert stats["idempotent/queue/parked"] == 1
    assert stats["idempotent/queue/acknowledged"] == 3  # the parked one is acknowledged apart
    assert "idempotent/queue/redis_errors" not in stats
    assert acknowledged_all(client, key)
    parked = client.xrange(f"{key}:parked")
    assert [fields["fields"] for _, fields in parked] == [
        '{"url": "http://elsewhere.invalid/y"}']
    client.close()
