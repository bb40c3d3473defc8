"""Feeding a crawl from an SQS queue (moto's server mode, real crawls of the local shop):
messages become requests, are deleted only after their page is committed, a slow request
keeps its message invisible, bad messages are parked (a parked queue, or the queue's redrive
policy), FIFO queues alike, and an SQS endpoint that goes away and comes back is ridden out."""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest
from local_site import LocalSite, Received, Responder
from scrapy import signals as scrapy_signals
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from scrapy.utils.test import get_crawler
from sqs_server import SqsQueue, SqsServer, sqs_server  # noqa: F401  (the fixture)

from crawling import crawl_settings, crawl_to_end
from helpers.queues import NATURAL_KEYS, QueueSpider, product, reactor_wait_for
from helpers.stored import frontier_counts, frontier_entries, stored_products
from scrapy_idempotent.queue_input import QueueInput
from shop.site import product_html


def sqs_settings(db_path: str, queue: SqsQueue, **extra: Any) -> dict[str, Any]:
    extra = {"CLOSESPIDER_TIMEOUT": 150, **extra}
    return crawl_settings(db_path, IDEMPOTENT_QUEUE_URL=queue.url,
                          IDEMPOTENT_QUEUE_POLL_SECONDS=0.05, **NATURAL_KEYS, **extra)


def product_body(shop: LocalSite, number: int) -> dict[str, Any]:
    return {"url": product(shop, number), "callback": "parse_product"}


def body_url(body: str) -> str | None:
    text = body.strip()
    if not text.startswith("{"):
        return text
    data = json.loads(text)
    return data.get("url") if isinstance(data, dict) else None


class DeleteProbe:
    """Wraps the SQS input's boto3 client (the real one) and checks at every delete that the
    page each deleted message asked for is committed in a final state."""

    def __init__(self, crawler: Any, db_path: str, redeliver: bool = False) -> None:
        self.crawler, self.db_path = crawler, db_path
        self.problems: list[str] = []
        self.deleted = 0
        #: make each message visible again at its first receipt (its timeout run out before
        #: any extension): it is received a second time while its request is in progress
        self.redeliver = redeliver
        self.receipts: dict[str, int] = {}  #: message id -> times received
        self.received_again: dict[str, threading.Event] = {}  #: URL -> set at its 2nd receipt
        self._lock = threading.Lock()
        crawler.signals.connect(self.spider_opened, signal=scrapy_signals.spider_opened)

    def spider_opened(self) -> None:
        (queue_input,) = [ext for ext in self.crawler.extensions.middlewares
                          if isinstance(ext, QueueInput)]
        broker: Any = queue_input.broker
        client, probe = broker.client, self

        class CheckedClient:
            def __getattr__(self, name: str) -> Any:
                return getattr(client, name)

            def receive_message(self, **kwargs: Any) -> Any:
                reply = client.receive_message(**kwargs)
                for message in reply.get("Messages", []):
                    message_id = message["MessageId"]
                    probe.receipts[message_id] = probe.receipts.get(message_id, 0) + 1
                    if probe.receipts[message_id] == 2:
                        probe.event(body_url(message["Body"]) or "").set()
                    if probe.redeliver and probe.receipts[message_id] == 1:
                        client.change_message_visibility(
                            QueueUrl=kwargs["QueueUrl"], ReceiptHandle=message["ReceiptHandle"],
                            VisibilityTimeout=0)
                return reply

            def delete_message_batch(self, QueueUrl: str, Entries: Any) -> Any:
                bodies = {h: broker._bodies.get(i, "") for i, h in broker._handles.items()}
                for entry in Entries:
                    probe.check(bodies.get(entry["ReceiptHandle"], ""))
                return client.delete_message_batch(QueueUrl=QueueUrl, Entries=Entries)

        broker.client = CheckedClient()

    def event(self, url: str) -> threading.Event:
        with self._lock:
            return self.received_again.setdefault(url, threading.Event())

    def check(self, body: str) -> None:
        self.deleted += 1
        url = body_url(body) if body else None
        if url is None:
            return  # the stop message
        states = {entry.state for entry in frontier_entries(self.db_path) if entry.url == url}
        if not states or not states <= {"done", "failed"}:
            self.problems.append(f"{url} deleted in state {states}")


@pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo"])
@deferred_f_from_coro_f
async def test_messages_become_requests_deleted_after_their_commit(
        sqs_server: SqsServer, crawl_database: str, fifo: bool) -> None:  # noqa: F811
    queue = SqsQueue(sqs_server, fifo=fifo)
    with LocalSite(listing_pages=2, products_per_page=3, products_failing=[3]) as shop:
        for _ in range(3):  # the same URL three times: one entry, one record
            queue.push(product_body(shop, 1))
        queue.push({**product_body(shop, 2), "meta": {"source": "q"}, "priority": 5})
        queue.push(product_body(shop, 3))  # answers 503: failed, then deleted
        queue.push(f"{shop.url}/list/2")  # a plain URL: links products 4..6 and list 1
        crawler = get_crawler(QueueSpider, sqs_settings(
            crawl_database, queue, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        probe = DeleteProbe(crawler, crawl_database)
        await crawl_to_end(crawler)
        requests = shop.counts_by_path()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert probe.problems == []
    assert probe.deleted == 6
    assert requests["/product/SKU-00001"] == 1
    assert frontier_counts(crawl_database) == {"done": 7, "failed": 1}
    assert sorted(p["sku"] for p in stored_products(crawl_database)) == [
        f"SKU-{n:05d}" for n in (1, 2, 4, 5, 6)]
    assert queue.all_acknowledged()
    assert stats["idempotent/queue/received"] == 6
    assert stats["idempotent/queue/acknowledged"] == 6


@deferred_f_from_coro_f
async def test_a_message_received_again_while_held_is_taken_once_and_deleted_after_commit(
        sqs_server: SqsServer, crawl_database: str) -> None:  # noqa: F811
    """Every message is made visible again at its first receipt, as when its visibility
    timeout runs out before the worker extends it: it is received a second time (in the same
    take, or at the next poll) while its request is only buffered or in progress. The second
    receipt is the same held message: taken once, not counted as taken over from another
    consumer, and deleted (with its latest receipt handle) only after its page's commit."""
    queue = SqsQueue(sqs_server)
    with LocalSite() as shop:
        crawler = get_crawler(QueueSpider, sqs_settings(
            crawl_database, queue, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        probe = DeleteProbe(crawler, crawl_database, redeliver=True)
        for number in range(1, 26):
            queue.push(product_body(shop, number))
            # each page is answered once its message has been received again: the second
            # receipt comes while the request is in progress, however fast the page would be
            url = product(shop, number)
            shop.add_responder(url.removeprefix(shop.url), held_until_received_again(
                probe.event(url), number, shop.price_version))
        await crawl_to_end(crawler)
        requests = shop.counts_by_path()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert min(probe.receipts.values()) >= 2, probe.receipts  # each received again
    assert probe.problems == []
    assert probe.deleted == 25
    assert stats["idempotent/queue/received"] == 25
    assert stats.get("idempotent/queue/claimed", 0) == 0  # nobody else's
    assert stats["idempotent/queue/acknowledged"] == 25
    assert set(requests.values()) == {1}
    assert frontier_counts(crawl_database) == {"done": 25}
    assert len(stored_products(crawl_database)) == 25
    assert queue.all_acknowledged()


def held_until_received_again(received_again: threading.Event, number: int,
                               price_version: int) -> Responder:
    def respond(received: Received) -> tuple[int, dict[str, str], str]:
        # bounded, so a message never received again fails the assertion, not the run
        received_again.wait(60)
        return 200, {"Content-Type": "text/html; charset=utf-8"}, product_html(
            number, price_version)
    return respond


def test_the_broker_count_is_exact_while_a_visibility_timeout_runs_out(
        sqs_server: SqsServer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """How the kill tests count at the broker. moto counts the visible messages, then those
    in flight, reading the clock anew for each message: a message whose visibility timeout
    runs out between the two readings is in neither count, so right after a kill (the
    killed worker's timeouts running out) a queue may show one message fewer than it holds,
    with none deleted. Here moto's clock passes the message's timeout just after the first
    reading of every count: the count of :meth:`SqsQueue.remaining` is still exact."""
    import moto.sqs.models
    from moto.core import DEFAULT_ACCOUNT_ID

    queue = SqsQueue(sqs_server)
    queue.push("https://example.com/1")
    client = sqs_server.client()
    (received,) = client.receive_message(QueueUrl=queue.url, VisibilityTimeout=30)["Messages"]
    (held,) = [m for m in moto.sqs.models.sqs_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]
               .queues[queue.name]._messages if m.id == received["MessageId"]]
    now = [0.0]

    def clock() -> float:  # moto's clock (milliseconds): a millisecond later at each reading
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(moto.sqs.models, "unix_time_millis", clock)
    missed = []  # the instants (before the timeout) at which moto's counts miss the message
    for before in range(60):
        now[0] = held.visible_at - before
        if sum(queue.counts()) == 0:
            missed.append(before)
    assert missed  # moto's own counts: at some instant, the message is in neither
    for before in missed:
        now[0] = held.visible_at - before
        assert queue.remaining() == 1


@deferred_f_from_coro_f
async def test_a_stop_message_finishes_the_crawl(
        sqs_server: SqsServer, crawl_database: str) -> None:  # noqa: F811
    queue = SqsQueue(sqs_server, fifo=True)
    with LocalSite() as shop:
        queue.push(product_body(shop, 1), group="g")
        queue.push({"stop": True}, group="g")  # a FIFO group: read after the product
        crawler = get_crawler(QueueSpider, sqs_settings(crawl_database, queue))
        await crawl_to_end(crawler)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert [p["sku"] for p in stored_products(crawl_database)] == ["SKU-00001"]
    assert queue.all_acknowledged()


@deferred_f_from_coro_f
async def test_a_slow_request_keeps_its_message_invisible(
        sqs_server: SqsServer, crawl_database: str) -> None:  # noqa: F811
    """The visibility timeout is 2 s, the page takes 8 s: the heartbeat extends it, so another
    consumer polling the queue all along never receives the message."""
    queue = SqsQueue(sqs_server)
    other = sqs_server.client()
    received_elsewhere: list[Any] = []
    with LocalSite(delay=8) as shop:
        queue.push(product_body(shop, 1))
        crawler = get_crawler(QueueSpider, sqs_settings(
            crawl_database, queue, IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS=2,
            IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=0.5))
        crawling = crawler.crawl()
        await reactor_wait_for(lambda: shop.in_flight >= 1, "the page requested")

        def nobody_else_gets_it() -> bool:
            received_elsewhere.extend(other.receive_message(
                QueueUrl=queue.url, WaitTimeSeconds=0, VisibilityTimeout=0).get("Messages", []))
            return shop.in_flight == 0

        await reactor_wait_for(nobody_else_gets_it, "the slow page answered")
        await maybe_deferred_to_future(crawling)
    assert received_elsewhere == []
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/queue/received") == 1
    assert queue.all_acknowledged()


@deferred_f_from_coro_f
async def test_bad_messages_go_to_the_parked_queue_with_their_error(
        sqs_server: SqsServer, crawl_database: str) -> None:  # noqa: F811
    queue = SqsQueue(sqs_server)
    with LocalSite() as shop:
        bad = ['{"url": ', json.dumps({"url": product(shop, 1), "callback": "nope"}),
               "ftp://example.com/file"]
        ids = {queue.push(body): body for body in bad}
        queue.push(product_body(shop, 7))
        crawler = get_crawler(QueueSpider, sqs_settings(
            crawl_database, queue, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/queue/parked"] == 3
    parked_url = queue.client.get_queue_url(QueueName=f"{queue.name}-parked")["QueueUrl"]
    parked = {m["id"]: m for m in (json.loads(p["Body"]) for p in queue.receive_all(parked_url))}
    assert {i: p["body"] for i, p in parked.items()} == ids
    errors = sorted(p["error"] for p in parked.values())
    assert any("not JSON" in e for e in errors)
    assert any("method of the spider" in e for e in errors)
    assert any("http(s) URL" in e for e in errors)
    assert [p["sku"] for p in stored_products(crawl_database)] == ["SKU-00007"]
    assert queue.all_acknowledged()


@deferred_f_from_coro_f
async def test_a_bad_message_is_left_to_the_redrive_policy(
        sqs_server: SqsServer, crawl_database: str) -> None:  # noqa: F811
    queue = SqsQueue(sqs_server, redrive=True)
    assert queue.dead_letter_url is not None
    with LocalSite() as shop:
        bad = queue.push(json.dumps({"url": product(shop, 1), "dont_filter": True}))
        queue.push(product_body(shop, 7))
        crawler = get_crawler(QueueSpider, sqs_settings(
            crawl_database, queue, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        await crawl_to_end(crawler)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert [p["sku"] for p in stored_products(crawl_database)] == ["SKU-00007"]
    assert queue.all_acknowledged()  # the bad one moved on to the dead-letter queue
    (dead,) = queue.receive_all(queue.dead_letter_url)
    assert dead["MessageId"] == bad


@deferred_f_from_coro_f
async def test_the_crawl_goes_on_when_sqs_comes_back(
        sqs_server: SqsServer, crawl_database: str, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """The SQS endpoint goes away mid-crawl (its server stopped: connections refused) and
    comes back: the deletes owed are sent again, the messages pushed meanwhile are read."""
    queue = SqsQueue(sqs_server)
    with LocalSite(delay=0.05) as shop:
        for n in range(1, 21):
            queue.push(product_body(shop, n))
        crawler = get_crawler(QueueSpider, sqs_settings(crawl_database, queue,
                                                        CONCURRENT_REQUESTS=2))
        crawling = crawler.crawl()
        await reactor_wait_for(lambda: shop.request_count >= 5, "the crawl going")
        sqs_server.stop()
        try:
            await reactor_wait_for(
                lambda: crawler.stats.get_value("idempotent/queue/sqs_errors"), "an error")
        finally:
            sqs_server.start_again()
        for n in range(21, 31):
            queue.push(product_body(shop, n))
        queue.push({"stop": True})
        with caplog.at_level(logging.INFO, logger="scrapy_idempotent.queue_input"):
            await maybe_deferred_to_future(crawling)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert len(stored_products(crawl_database)) == 30
    assert frontier_counts(crawl_database) == {"done": 30}
    assert queue.all_acknowledged()
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_sqs_queue_urls() -> None:
    from scrapy_idempotent.config import queue_broker
    from scrapy_idempotent.queue_input.sqs import sqs_queue_location

    assert sqs_queue_location("sqs://jobs") == ("jobs", None, None, None)
    assert sqs_queue_location("sqs://jobs.fifo?region=eu-west-1") == (
        "jobs.fifo", None, "eu-west-1", None)
    assert sqs_queue_location("https://sqs.eu-west-1.amazonaws.com/123456789012/jobs") == (
        "jobs", "https://sqs.eu-west-1.amazonaws.com/123456789012/jobs", "eu-west-1", None)
    assert sqs_queue_location("http://127.0.0.1:4566/000000000000/jobs") == (
        "jobs", "http://127.0.0.1:4566/000000000000/jobs", None, "http://127.0.0.1:4566")
    assert queue_broker("https://sqs.eu-west-1.amazonaws.com/123456789012/jobs") == "sqs"
    assert queue_broker("http://localhost") is None
