"""IDEMPOTENT_QUEUE_PREFETCH bounds the messages a worker holds, messages taken over from
another consumer included: a dead consumer's long pending list (XCLAIM) or a group's idle
messages (XAUTOCLAIM) are taken a prefetch at a time, poll after poll, not all at once."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest
from local_site import LocalSite
from scrapy import signals as scrapy_signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_to_end, stored_products, wait_for
from helpers.queues import (
    GROUP,
    QueueSpider,
    acknowledged_all,
    product_message,
    queue_settings,
)
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)
from scrapy_idempotent.queue_input import QueueInput

PREFETCH = 4
MESSAGES = 30


def dead_worker_of_this_host() -> str:
    """The worker id of a process of this host that has exited."""
    found = subprocess.run(
        [sys.executable, "-c",
         "from scrapy_idempotent.workers import new_worker_id; print(new_worker_id())"],
        check=True, capture_output=True, text=True)
    return found.stdout.strip()


class HeldAtAck:
    """Wraps the queue input's Redis client (the real one) and notes, at every XACK, how
    many messages are pending for the crawl's consumer: what it holds unacknowledged."""

    def __init__(self, crawler: Any) -> None:
        self.crawler = crawler
        self.held: list[int] = []
        crawler.signals.connect(self.spider_opened, signal=scrapy_signals.spider_opened)

    def spider_opened(self) -> None:
        (queue_input,) = [ext for ext in self.crawler.extensions.middlewares
                          if isinstance(ext, QueueInput)]
        client, consumer, probe = queue_input.redis, queue_input.consumer, self

        class CountingClient:
            def __getattr__(self, name: str) -> Any:
                return getattr(client, name)

            def xack(self, key: str, group: str, *ids: str) -> Any:
                probe.held.append(len(client.xpending_range(
                    key, group, "-", "+", 1000, consumername=consumer)))
                return client.xack(key, group, *ids)

        queue_input.redis = CountingClient()


@pytest.mark.parametrize("owner", ["dead_consumer_of_this_host", "idle_consumer_elsewhere"])
@deferred_f_from_coro_f
async def test_messages_taken_over_are_bounded_by_the_prefetch(
        redis_server: RedisServer, crawl_database: str, owner: str) -> None:  # noqa: F811
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    client.xgroup_create(key, GROUP, id="0", mkstream=True)
    consumer = dead_worker_of_this_host() if owner == "dead_consumer_of_this_host" \
        else "otherhost:4242:1:cafe"
    with LocalSite() as shop:
        for number in range(1, MESSAGES + 1):
            client.xadd(key, product_message(shop, number))
        client.xreadgroup(GROUP, consumer, {key: ">"})  # all of them, never acknowledged
        assert int(client.xpending(key, GROUP)["pending"]) == MESSAGES
        if owner == "idle_consumer_elsewhere":
            wait_for(lambda: min(p["time_since_delivered"] for p in client.xpending_range(
                key, GROUP, "-", "+", MESSAGES)) >= 1000, 60, "the messages idle for 1 s")
        client.xadd(key, {"stop": "1"})
        crawler = get_crawler(QueueSpider, queue_settings(
            crawl_database, redis_server, key, IDEMPOTENT_QUEUE_PREFETCH=PREFETCH,
            IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS=1))
        held = HeldAtAck(crawler)
        await crawl_to_end(crawler)
        assert shop.request_count == MESSAGES
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert len(stored_products(crawl_database)) == MESSAGES
    assert stats["idempotent/queue/claimed"] == MESSAGES
    assert acknowledged_all(client, key)
    # never more than the prefetch held (the stop message, read last, is acknowledged alone)
    assert len(held.held) >= MESSAGES // PREFETCH
    assert max(held.held) <= PREFETCH, held.held
    # removed once it had nothing left: at once when it ran on this host, once its
    # messages were taken over by idle time when it ran elsewhere
    assert consumer not in {c["name"] for c in client.xinfo_consumers(key, GROUP)}
    client.close()
