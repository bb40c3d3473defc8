"""A Redis server that stops answering (stopped with SIGSTOP: connections stay open, replies
never come, as with a dropped route or a failover) does not stall a queue-fed crawl: the
Redis commands wait on the queue input's own thread while the reactor downloads and commits;
once Redis answers again, the acknowledgements go out and new messages are read."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import frontier_counts, stored_products
from helpers.queues import (
    QueueSpider,
    acknowledged_all,
    queue_settings,
    reactor_wait_for,
)
from redis_server import RedisServer, private_redis_server

#: Pages downloaded while Redis does not answer: a reactor blocked on Redis (a 10 s socket
#: timeout per command, one command per poll) would take minutes for these.
DOWNLOADS_WHILE_STOPPED = 150


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of this test alone (it is stopped and continued)."""
    with private_redis_server(tmp_path / "redis") as server:
        try:
            yield server
        finally:  # (continued, if the test left it stopped, so that it can be stopped)
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGCONT)


@deferred_f_from_coro_f
async def test_the_crawl_goes_on_while_redis_does_not_answer(
        own_redis: RedisServer, crawl_database: str) -> None:
    from scrapy.utils.defer import maybe_deferred_to_future

    key = f"q-{uuid.uuid4().hex}"
    client = own_redis.client()
    assert own_redis.process is not None
    pid = own_redis.process.pid
    with LocalSite() as shop:
        client.xadd(key, {"url": f"{shop.url}/list/1"})  # the whole shop: 525 pages
        crawler = get_crawler(QueueSpider, queue_settings(crawl_database, own_redis, key))
        crawling = crawler.crawl()
        await reactor_wait_for(lambda: shop.request_count >= 20, "the crawl to get going")
        os.kill(pid, signal.SIGSTOP)  # Redis stops answering; its sockets stay open
        try:
            at_stop = shop.request_count
            await reactor_wait_for(
                lambda: shop.request_count >= at_stop + DOWNLOADS_WHILE_STOPPED,
                "downloads while Redis does not answer")
            assert crawling.called is False
        finally:
            os.kill(pid, signal.SIGCONT)
        client.xadd(key, {"stop": "1"})  # read once Redis answers again
        await maybe_deferred_to_future(crawling)
        requests = shop.request_count
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert requests == 525
    assert frontier_counts(crawl_database) == {"done": 525}
    assert len(stored_products(crawl_database)) == 500
    assert acknowledged_all(client, key)
    assert stats["idempotent/queue/acknowledged"] == 2  # /list/1, then the stop message
    client.close()
