"""The queue input's depth in the metrics: what each broker tells (Redis: waiting, held and
parked; SQS: the same from its attributes; RabbitMQ: waiting and parked from passive declares),
read in the background so that a broker that is slow or unreachable never holds or fails a
scrape."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from rabbitmq_server import AmqpKillQueue, RabbitMQServer, rabbitmq_server  # noqa: F401
from sqs_server import SqsQueue, SqsServer, sqs_server  # noqa: F401  (the fixture)

from crawling import wait_for
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)
from scrapy_idempotent.config import QueueConfig
from scrapy_idempotent.queue_input import broker_for
from scrapy_idempotent.queue_input.broker import QueueBroker, QueueDepth
from scrapy_idempotent.store import SQLiteStore, open_store

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from scrapy_idempotent.metrics import QueueProbe, StoreCollector  # noqa: E402


def queue_config(url: str, key: str) -> QueueConfig:
    return QueueConfig(url=url, key=key, group="scrapy_idempotent", idle_timeout_seconds=None,
                       claim_idle_seconds=60.0, prefetch=10, poll_seconds=1.0)


def depth_of(config: QueueConfig) -> QueueDepth:
    broker = broker_for(config, "test-metrics")
    try:
        return broker.depth()
    finally:
        broker.close()


def test_a_redis_stream_tells_waiting_held_and_parked(
        redis_server: RedisServer) -> None:  # noqa: F811
    key = f"q-{uuid.uuid4().hex[:8]}"
    config = queue_config(redis_server.url, key)
    assert depth_of(config) == QueueDepth(waiting=0, held=0, parked=0)  # no stream yet
    client = redis_server.client()
    for n in range(3):
        client.xadd(key, {"url": f"https://shop.example/{n}"})
    assert depth_of(config) == QueueDepth(waiting=3, held=0, parked=0)  # no group yet
    client.xgroup_create(key, config.group, id="0")
    client.xreadgroup(config.group, "w1", {key: ">"}, count=1)
    client.xadd(config.parked_key, {"id": "1-0", "error": "not a request"})
    # a group's lag (entries not delivered to it yet) is told from Redis 7 on
    lag_told = int(str(client.info()["redis_version"]).split(".")[0]) >= 7
    assert depth_of(config) == QueueDepth(waiting=2 if lag_told else None, held=1, parked=1)


def test_an_sqs_queue_tells_waiting_held_and_parked(
        sqs_server: SqsServer) -> None:  # noqa: F811
    queue = SqsQueue(sqs_server)
    for n in range(3):
        queue.push(f"https://shop.example/{n}")
    queue.client.receive_message(QueueUrl=queue.url, MaxNumberOfMessages=1,
                                 VisibilityTimeout=60)
    config = queue_config(queue.url, queue.name)
    assert depth_of(config) == QueueDepth(waiting=2, held=1, parked=0)  # no parked queue yet
    parked = queue.client.create_queue(QueueName=f"{queue.name}-parked")["QueueUrl"]
    queue.client.send_message(QueueUrl=parked, MessageBody='{"error": "not a request"}')
    assert depth_of(config) == QueueDepth(waiting=2, held=1, parked=1)


def test_an_sqs_queue_with_a_redrive_policy_tells_its_dead_letter_queue(
        sqs_server: SqsServer) -> None:  # noqa: F811
    queue = SqsQueue(sqs_server, redrive=True)
    assert queue.dead_letter_url is not None
    queue.client.send_message(QueueUrl=queue.dead_letter_url, MessageBody="bad")
    assert depth_of(queue_config(queue.url, queue.name)) == QueueDepth(
        waiting=0, held=0, parked=1)


@pytest.mark.slow
def test_a_rabbitmq_queue_tells_waiting_and_parked(
        rabbitmq_server: RabbitMQServer) -> None:  # noqa: F811
    config = queue_config(rabbitmq_server.url, f"q-{uuid.uuid4().hex[:8]}")
    # neither queue declared yet: nothing waits, and the check declares nothing
    assert depth_of(config) == QueueDepth(waiting=0, held=None, parked=0)
    queue = AmqpKillQueue(rabbitmq_server)
    queue.push_many(["https://shop.example/1", "https://shop.example/2"])
    config = queue_config(rabbitmq_server.url, queue.name)
    assert depth_of(config) == QueueDepth(waiting=2, held=None, parked=0)


class BlockedBroker(QueueBroker):
    """A broker whose depth call waits until ``release`` is set (a broker that stopped
    answering), then answers ``answer`` or raises."""

    kind = "test"
    error_stat = "idempotent/queue/test_errors"

    def __init__(self, answer: QueueDepth | None) -> None:
        super().__init__("test")
        self.answer = answer
        self.release = threading.Event()
        self.asked = threading.Event()

    @property
    def name(self) -> str:
        return "requests"

    @property
    def parked_name(self) -> str:
        return "requests:parked"

    def take(self, room: int, read: bool, known: frozenset[str]) -> Any:
        raise NotImplementedError

    def ack(self, ids: list[str]) -> int:
        raise NotImplementedError

    def park(self, message_id: str, fields: Any, error: str) -> None:
        raise NotImplementedError

    def depth(self) -> QueueDepth:
        self.asked.set()
        self.release.wait(60)
        if self.answer is None:
            raise ConnectionError("connection refused")
        return self.answer


def scrape(db: Path, probe: QueueProbe) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    def opened() -> Any:
        store = open_store(str(db))
        store.open_existing(readonly=True)
        return store

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(opened, queue=probe))
    text = prometheus_client.generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_broker_that_does_not_answer_neither_holds_nor_fails_a_scrape(db_path: Path) -> None:
    store = SQLiteStore(str(db_path))
    store.open(fingerprinter="SHA1")
    store.close()
    clock = [0.0]
    blocked = BlockedBroker(QueueDepth(waiting=5, held=1, parked=2))
    probe = QueueProbe(lambda: blocked, every=10.0, clock=lambda: clock[0])
    got = scrape(db_path, probe)  # the broker is asked, and does not answer yet
    assert blocked.asked.wait(30)
    assert got[("idempotent_store_up", ())] == 1
    assert got[("idempotent_queue_up", ())] == 0
    assert not [key for key in got if key[0] == "idempotent_queue_messages"]
    blocked.release.set()
    wait_for(lambda: probe.reading()[2], 30, "the queue's reading")
    got = scrape(db_path, probe)
    assert got[("idempotent_queue_up", ())] == 1
    assert {key[1]: value for key, value in got.items()
            if key[0] == "idempotent_queue_messages"} == {
        (("queue", "requests"), ("state", "waiting")): 5,
        (("queue", "requests"), ("state", "held")): 1,
        (("queue", "requests"), ("state", "parked")): 2}
    # the broker goes away: the figures stay as last read, their age grows, up is 0
    blocked.answer = None
    clock[0] += 10.0
    probe.reading()
    wait_for(lambda: not probe.reading()[2], 30, "the failed reading")
    clock[0] += 5.0
    got = scrape(db_path, probe)
    assert got[("idempotent_queue_up", ())] == 0
    assert got[("idempotent_queue_read_age_seconds", ())] == 15.0
    assert got[("idempotent_store_up", ())] == 1


def test_an_unreachable_redis_is_a_figure_not_an_error(db_path: Path) -> None:
    pytest.importorskip("redis")
    from local_site import free_port

    store = SQLiteStore(str(db_path))
    store.open(fingerprinter="SHA1")
    store.close()
    config = queue_config(f"redis://127.0.0.1:{free_port()}/0", "requests")
    probe = QueueProbe(lambda: broker_for(config, "test-metrics"))
    scrape(db_path, probe)
    wait_for(lambda: probe._reading is None, 60, "the failed reading")
    got = scrape(db_path, probe)
    assert (got[("idempotent_queue_up", ())], got[("idempotent_store_up", ())]) == (0, 1)


def test_the_metrics_command_serves_the_queue_of_the_crawl_settings(
        redis_server: RedisServer, db_path: Path, tmp_path: Path) -> None:  # noqa: F811
    """``scrapy idempotent metrics`` reads the queue of the crawl's IDEMPOTENT_QUEUE_URL."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from local_site import free_port

    from crawling import EXAMPLE_PROJECT

    store = SQLiteStore(str(db_path))
    store.open(fingerprinter="SHA1")
    store.close()
    key = f"q-{uuid.uuid4().hex[:8]}"
    client = redis_server.client()
    for n in range(4):
        client.xadd(key, {"url": f"https://shop.example/{n}"})
    port = free_port()
    with (tmp_path / "exporter.log").open("wb") as log:
        exporter = subprocess.Popen(
            [sys.executable, "-m", "scrapy", "idempotent", "metrics", "--db", str(db_path),
             "--listen", f"127.0.0.1:{port}", "-s", f"IDEMPOTENT_QUEUE_URL={redis_server.url}",
             "-s", f"IDEMPOTENT_QUEUE_KEY={key}"], cwd=EXAMPLE_PROJECT,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
    waiting = f'idempotent_queue_messages{{queue="{key}",state="waiting"}} 4.0'

    def served() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=10) as response:
                return waiting in response.read().decode()
        except OSError:
            return False

    try:
        wait_for(served, 60, "the queue's figures served", tmp_path / "exporter.log")
    finally:
        exporter.send_signal(signal.SIGTERM)
        try:
            exporter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait()
