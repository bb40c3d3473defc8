"""Feeding a crawl from a RabbitMQ queue (Debian's rabbitmq-server, real crawls of the local
shop): manual acknowledgements after the commit, bad messages dead-lettered to the parked
queue, a consumer cancelled by the broker and a connection cut by it both ridden out."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from local_site import LocalSite
from rabbitmq_server import AmqpKillQueue, RabbitMQServer, rabbitmq_server  # noqa: F401
from scrapy import signals as scrapy_signals
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end
from helpers.queues import NATURAL_KEYS, QueueSpider, product, reactor_wait_for
from helpers.stored import frontier_counts, frontier_entries, stored_products
from scrapy_idempotent.queue_input import QueueInput


def amqp_settings(db_path: str, queue: AmqpKillQueue, **extra: Any) -> dict[str, Any]:
    extra = {"CLOSESPIDER_TIMEOUT": 150, **extra}
    return crawl_settings(db_path, IDEMPOTENT_QUEUE_URL=queue.url,
                          IDEMPOTENT_QUEUE_KEY=queue.name,
                          IDEMPOTENT_QUEUE_POLL_SECONDS=0.05, **NATURAL_KEYS, **extra)


def product_body(shop: LocalSite, number: int) -> dict[str, Any]:
    return {"url": product(shop, number), "callback": "parse_product"}


class AckProbe:
    """Checks, at every acknowledgement the RabbitMQ input sends, that the page of each
    message is committed in a final state."""

    def __init__(self, crawler: Any, db_path: str) -> None:
        self.crawler, self.db_path = crawler, db_path
        self.problems: list[str] = []
        self.acked = 0
        crawler.signals.connect(self.spider_opened, signal=scrapy_signals.spider_opened)

    def spider_opened(self) -> None:
        (queue_input,) = [ext for ext in self.crawler.extensions.middlewares
                          if isinstance(ext, QueueInput)]
        broker: Any = queue_input.broker
        urls: dict[str, str | None] = {}
        on_message, ack = broker._on_message, broker.ack

        def noted(channel: Any, method: Any, properties: Any, body: bytes) -> None:
            on_message(channel, method, properties, body)
            message_id, fields = broker._buffer[-1]
            urls[message_id] = fields.get("url") or (
                json.loads(fields["request"]).get("url") if "request" in fields else None)

        def checked(ids: list[str]) -> int:
            for message_id in ids:
                self.check(urls.get(message_id))
            return int(ack(ids))

        broker._on_message, broker.ack = noted, checked

    def check(self, url: str | None) -> None:
        self.acked += 1
        if url is None:
            return  # the stop message
        states = {entry.state for entry in frontier_entries(self.db_path) if entry.url == url}
        if not states or not states <= {"done", "failed"}:
            self.problems.append(f"{url} acknowledged in state {states}")


@deferred_f_from_coro_f
async def test_messages_become_requests_acknowledged_after_their_commit(
        rabbitmq_server: RabbitMQServer, crawl_database: str) -> None:  # noqa: F811
    queue = AmqpKillQueue(rabbitmq_server)
    with LocalSite(listing_pages=2, products_per_page=3, products_failing=[3]) as shop:
        queue.push_many([product_body(shop, 1)] * 3 + [  # one entry, one record
            {**product_body(shop, 2), "meta": {"source": "q"}, "priority": 5},
            product_body(shop, 3),  # answers 503: failed, then acknowledged
            f"{shop.url}/list/2", {"stop": True}])
        crawler = get_crawler(QueueSpider, amqp_settings(crawl_database, queue))
        probe = AckProbe(crawler, crawl_database)
        await crawl_to_end(crawler)
        requests = shop.counts_by_path()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert probe.problems == []
    assert probe.acked == 7
    assert requests["/product/SKU-00001"] == 1
    assert frontier_counts(crawl_database) == {"done": 7, "failed": 1}
    assert sorted(p["sku"] for p in stored_products(crawl_database)) == [
        f"SKU-{n:05d}" for n in (1, 2, 4, 5, 6)]
    assert queue.all_acknowledged()
    assert stats["idempotent/queue/acknowledged"] == 7


@deferred_f_from_coro_f
async def test_bad_messages_are_dead_lettered_to_the_parked_queue(
        rabbitmq_server: RabbitMQServer, crawl_database: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    queue = AmqpKillQueue(rabbitmq_server)
    with LocalSite() as shop:
        bad = ['{"url": ', json.dumps({"url": product(shop, 1), "callback": "nope"}),
               "ftp://example.com/file"]
        queue.push_many([*bad, product_body(shop, 7), {"stop": True}])
        crawler = get_crawler(QueueSpider, amqp_settings(crawl_database, queue))
        with caplog.at_level(logging.WARNING, logger="scrapy_idempotent.queue_input"):
            await crawl_to_end(crawler)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/queue/parked") == 3
    assert [p["sku"] for p in stored_products(crawl_database)] == ["SKU-00007"]
    assert queue.all_acknowledged()
    connection, channel = queue._channel()
    parked = []
    while True:
        method, properties, body = channel.basic_get(f"{queue.name}:parked", auto_ack=True)
        if method is None:
            break
        parked.append((body.decode(), properties.headers["x-death"][0]["reason"]))
    connection.close()
    assert sorted(parked) == sorted((b, "rejected") for b in bad)
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "not JSON" in warnings and "method of the spider" in warnings


@pytest.mark.parametrize("fault", ["connection cut", "consumer cancelled"])
@deferred_f_from_coro_f
async def test_the_crawl_goes_on_after_a_cut_connection_or_a_cancelled_consumer(
        rabbitmq_server: RabbitMQServer, crawl_database: str, fault: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """The broker cuts the worker's connection (its held messages are requeued and delivered
    again), or deletes the queue (the consumer is cancelled; the worker declares it again):
    messages pushed after are read, nothing is left unacknowledged."""
    queue = AmqpKillQueue(rabbitmq_server)
    with LocalSite(delay=0.05) as shop:
        queue.push_many([product_body(shop, n) for n in range(1, 21)])
        crawler = get_crawler(QueueSpider, amqp_settings(crawl_database, queue,
                                                         CONCURRENT_REQUESTS=2))
        crawling = crawler.crawl()
        await reactor_wait_for(lambda: shop.request_count >= 5, "the crawl going")
        with caplog.at_level(logging.INFO, logger="scrapy_idempotent.queue_input"):
            if fault == "connection cut":
                rabbitmq_server.close_all_connections()
                await reactor_wait_for(lambda: any(
                    "connected again" in r.getMessage() for r in caplog.records),
                    "connected again")
            else:
                connection, channel = queue._channel()
                channel.queue_delete(queue.name)
                connection.close()
                await reactor_wait_for(lambda: any(
                    "cancelled this consumer" in r.getMessage() for r in caplog.records),
                    "consuming again")
            queue.push_many([product_body(shop, n) for n in range(21, 31)] + [{"stop": True}])
            await maybe_deferred_to_future(crawling)
    assert crawler.stats.get_value("finish_reason") == "finished"
    skus = {p["sku"] for p in stored_products(crawl_database)}
    if fault == "connection cut":
        assert len(skus) == 30  # nothing lost
    else:  # the messages deleted with the queue are gone; those pushed after it are read
        assert {f"SKU-{n:05d}" for n in range(21, 31)} <= skus
    assert set(frontier_counts(crawl_database)) == {"done"}
    assert queue.all_acknowledged()
