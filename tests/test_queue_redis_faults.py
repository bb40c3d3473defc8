"""A queue-fed crawl meets a Redis that lost its consumer group (restarted without
persistence), a read whose answer is lost, or a Redis that cannot be reached at all: it
creates the group again, takes the messages of the lost answer, and goes on, and it never
waits for ever past IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end, stored_products
from helpers.queues import (
    QueueSpider,
    acknowledged_all,
    product_message,
    queue_settings,
    reactor_wait_for,
)
from redis_server import RedisServer, private_redis_server


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis server of this test alone (it is restarted)."""
    with private_redis_server(tmp_path / "redis") as server:
        yield server


@deferred_f_from_coro_f
async def test_a_redis_restarted_without_persistence_gets_its_group_again(
        own_redis: RedisServer, crawl_database: str, caplog: pytest.LogCaptureFixture) -> None:
    key = f"q-{uuid.uuid4().hex}"
    client = own_redis.client()
    # CLOSESPIDER_TIMEOUT: a crawl that never reads again ends, not finished
    settings = queue_settings(crawl_database, own_redis, key, CLOSESPIDER_TIMEOUT=60)
    with LocalSite() as shop:
        client.xadd(key, product_message(shop, 1))
        crawler = get_crawler(QueueSpider, settings)
        crawling = crawler.crawl()
        await reactor_wait_for(
            lambda: crawler.stats.get_value("idempotent/queue/acknowledged") == 1,
            "the first message acknowledged")
        own_redis.restart()  # empty: no stream, no group
        client = own_redis.client()
        client.xadd(key, product_message(shop, 2))
        client.xadd(key, product_message(shop, 3))
        client.xadd(key, {"stop": "1"})
        with caplog.at_level(logging.WARNING, logger="scrapy_idempotent.queue_input"):
            await maybe_deferred_to_future(crawling)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert sorted(p["sku"] for p in stored_products(crawl_database)) == [
        "SKU-00001", "SKU-00002", "SKU-00003"]
    assert acknowledged_all(client, key)
    assert any("consumer group 'scrapy_idempotent' is gone" in r.getMessage()
               and "creating it again" in r.getMessage() for r in caplog.records)
    client.close()


@deferred_f_from_coro_f
async def test_the_messages_of_a_read_whose_answer_was_lost_are_taken(
        own_redis: RedisServer, crawl_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read of new messages runs on the server (they are pending for the worker's
    consumer from then on) and its answer never arrives (the connection cut): the worker
    reads its own pending entries again and does their requests; nothing is left pending."""
    import redis

    key = f"q-{uuid.uuid4().hex}"
    client = own_redis.client()
    lost = threading.Event()
    real_xreadgroup = redis.Redis.xreadgroup

    def xreadgroup(self: redis.Redis, groupname: str, consumername: str,
                   streams: dict[str, str], *args: object, **kwargs: object) -> object:
        reply = real_xreadgroup(self, groupname, consumername, streams, *args, **kwargs)
        if not lost.is_set() and reply and list(streams.values()) == [">"]:
            lost.set()
            raise redis.ConnectionError("Connection closed by server.")  # the answer lost
        return reply

    monkeypatch.setattr(redis.Redis, "xreadgroup", xreadgroup)
    with LocalSite() as shop:
        for number in (1, 2, 3):
            client.xadd(key, product_message(shop, number))
        crawler = get_crawler(QueueSpider, queue_settings(crawl_database, own_redis, key))
        crawling = crawler.crawl()
        await reactor_wait_for(lost.is_set, "the first read")
        client.xadd(key, {"stop": "1"})
        await maybe_deferred_to_future(crawling)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/queue/redis_errors"] == 1
    assert sorted(p["sku"] for p in stored_products(crawl_database)) == [
        "SKU-00001", "SKU-00002", "SKU-00003"]
    assert acknowledged_all(client, key)
    client.close()


@deferred_f_from_coro_f
async def test_the_idle_timeout_ends_a_crawl_whose_redis_cannot_be_reached(
        crawl_database: str, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("redis")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = crawl_settings(
        crawl_database, IDEMPOTENT_QUEUE_URL=f"redis://127.0.0.1:{port}/0",
        IDEMPOTENT_QUEUE_POLL_SECONDS=0.05, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1,
        CLOSESPIDER_TIMEOUT=60)
    crawler = get_crawler(QueueSpider, settings)
    with caplog.at_level(logging.ERROR, logger="scrapy_idempotent.queue_input"):
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "idempotent_queue_unreachable"
    assert stats["idempotent/queue/redis_errors"] >= 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("could not be reached for 1.0 s" in e and "IDEMPOTENT_QUEUE_IDLE_TIMEOUT"
               in e for e in errors), errors
