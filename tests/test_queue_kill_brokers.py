"""The queue kill tests on every broker beside Redis (tests/test_queue_kill.py): real worker
processes fed from an SQS queue (moto's server mode) or a RabbitMQ queue (Debian's
rabbitmq-server), SIGKILLed. A message is acknowledged only once its page is committed (checked
at the broker after every kill), delivered again after a kill, and a repeated delivery is
harmless (one frontier entry, one record); a broker restarted mid-crawl is ridden out (there
on Redis too, a persistent server of the test's own); stop messages read in one batch are all
acknowledged when the crawl finishes, so none ends the next crawl (on Redis too). The killed
delivery runs on each store backend; the ten kills, the broker restart and the stop messages,
on SQLite (what they check is the broker's: the ten kills run on PostgreSQL with Redis in
tests/test_queue_kill.py)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from local_site import LocalSite
from rabbitmq_server import rabbitmq_server  # noqa: F401  (the fixture)
from sqs_server import SqsQueue, SqsServer, sqs_server  # noqa: F401  (the fixture)

from crawling import close_reason, wait_for
from helpers.queue_workers import body_url, kill, product_body, running, start_worker
from helpers.stored import frontier_counts, request_states, stored_products
from redis_server import INSTALL as REDIS_INSTALL
from redis_server import RedisServer, redis_server_binary

pytestmark = pytest.mark.slow

GROUP = "scrapy_idempotent"  #: the queue input's default consumer group

STOP = {"stop": True}  #: the stop message (a body; on Redis, a field stop)


class BrokerQueue(Protocol):
    """What the tests ask of a broker's queue, each answered by the broker itself."""

    url: str

    def push(self, body: str | dict[str, Any]) -> Any: ...
    def in_flight(self) -> int: ...  # delivered, not acknowledged
    # not acknowledged (ready or delivered), counted with no worker running (SQS: once the
    # killed worker's visibility timeouts ran out: sqs_server.SqsQueue.remaining)
    def remaining(self) -> int: ...
    def all_acknowledged(self) -> bool: ...  # with no worker running
    # the URLs of the messages not acknowledged, where the broker shows them without a
    # consumer's receive (moto's own list), else None
    def held_urls(self) -> set[str] | None: ...
    def settings(self) -> tuple[str, ...]: ...  # the worker's broker settings
    def stop(self) -> None: ...  # the broker stopped (its clients' connections refused)
    def start(self) -> None: ...  # and started again, its queues kept


class SqsKillQueue:
    def __init__(self, server: SqsServer, fifo: bool) -> None:
        self.server = server
        self.queue = SqsQueue(server, fifo=fifo)
        self.url = self.queue.url

    def push(self, body: str | dict[str, Any]) -> Any:
        return self.queue.push(body)

    def in_flight(self) -> int:
        return self.queue.counts()[1]

    def remaining(self) -> int:
        return self.queue.remaining()

    def all_acknowledged(self) -> bool:
        return self.queue.all_acknowledged()

    def held_urls(self) -> set[str] | None:
        return {body_url(body) for body in self.queue.held_bodies()}

    def settings(self) -> tuple[str, ...]:
        # a killed worker's messages are received again 2 s later (their visibility timeout)
        return ("IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS=2",)

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start_again()


class RedisKillQueue:
    """A stream of a Redis server of the test's own, persistent (its append-only file written
    at every command), so a restart keeps the stream, the group and its pending entries."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.key = f"q-{uuid.uuid4().hex[:12]}"
        self.url = server.url
        self.client = server.client()
        self.client.xgroup_create(self.key, GROUP, id="0", mkstream=True)

    def push(self, body: str | dict[str, Any]) -> Any:
        if body == STOP:
            fields = {"stop": "1"}
        else:
            fields = {"url": body} if isinstance(body, str) else {"request": json.dumps(body)}
        return self.client.xadd(self.key, fields)

    def in_flight(self) -> int:
        return int(self.client.xpending(self.key, GROUP)["pending"])

    def remaining(self) -> int:
        (group,) = self.client.xinfo_groups(self.key)
        undelivered = len(self.client.xrange(self.key, f"({group['last-delivered-id']}", "+"))
        return undelivered + int(group["pending"])

    def all_acknowledged(self) -> bool:
        return self.remaining() == 0

    def held_urls(self) -> set[str] | None:
        return None  # (the restart test only)

    def settings(self) -> tuple[str, ...]:
        return (f"IDEMPOTENT_QUEUE_KEY={self.key}",)

    def stop(self) -> None:
        self.client.close()
        self.server.stop()

    def start(self) -> None:
        self.server.start_again()
        self.client = self.server.client()


@pytest.fixture(params=["sqs", "sqs-fifo", "amqp"])
def broker_queue(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BrokerQueue]:
    if request.param == "redis":
        pytest.importorskip("redis", reason="the redis client: pip install -e '.[test]'")
        binary = redis_server_binary()
        if binary is None:
            pytest.skip(REDIS_INSTALL)
        directory = tmp_path / "redis"
        directory.mkdir()
        redis = RedisServer(binary, directory, persistent=True).start()
        try:
            yield RedisKillQueue(redis)
        finally:
            redis.stop()
    elif request.param.startswith("sqs"):
        server = request.getfixturevalue("sqs_server")
        yield SqsKillQueue(server, fifo=request.param == "sqs-fifo")
    else:
        from rabbitmq_server import AmqpKillQueue

        pytest.importorskip("pika", reason="pika for the RabbitMQ queue input: "
                            "pip install -e '.[test]'")
        server = request.getfixturevalue("rabbitmq_server")
        yield AmqpKillQueue(server)


def committed(db: str) -> set[str]:
    """URLs whose page is committed in a final state."""
    return {url for url, state in request_states(db).items() if state in ("done", "failed")}


def test_same_url_three_times_worker_killed_during_the_second_delivery(
        broker_queue: BrokerQueue, tmp_path: Path, crawl_database: str) -> None:
    db = crawl_database
    # the page answers after 60 s while the first worker lives: it is killed in the middle
    with LocalSite(delay=60) as shop:
        message = product_body(shop, 1)
        broker_queue.push(message)
        worker = start_worker(broker_queue, db, tmp_path / "run1.log")
        try:
            wait_for(lambda: shop.in_flight >= 1, 120, "the page requested")
            broker_queue.push(message)
            wait_for(lambda: broker_queue.in_flight() == 2, 120,
                     "the second delivery read by the worker", tmp_path / "run1.log")
        finally:
            kill(worker)
        assert frontier_counts(db) == {"leased": 1}  # in flight, nothing committed
        assert broker_queue.remaining() == 2  # nothing acknowledged
        shop.delay = 0  # the next fetch of the page answers at once
        broker_queue.push(message)
        worker = start_worker(broker_queue, db, tmp_path / "run2.log",
                              "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=4")
        try:
            assert worker.wait(timeout=240) == 0
        finally:
            if worker.poll() is None:
                kill(worker)
        assert close_reason(tmp_path / "run2.log") == "finished"
        assert shop.counts_by_path() == {"/product/SKU-00001": 2}  # once per worker
    assert frontier_counts(db) == {"done": 1}  # one entry
    assert [p["sku"] for p in stored_products(db)] == ["SKU-00001"]
    assert broker_queue.all_acknowledged()


# the FIFO queue has the other two tests: ten kills on each broker keep the suite's time
# down (on a FIFO queue it passes too, in about 4 minutes at load 10: add "sqs-fifo" to run
# it); a longer timeout than the suite's 300 s for a machine under load (11 worker starts)
@pytest.mark.parametrize("broker_queue", ["sqs", "amqp"], indirect=True)
@pytest.mark.timeout(600)
def test_queue_fed_crawl_killed_ten_times(broker_queue: BrokerQueue, tmp_path: Path,
                                          request: pytest.FixtureRequest) -> None:
    """25 listings and 500 products pushed (the listings also link the products); the worker
    is SIGKILLed 10 times after a random number of pages, then runs to the end. After every
    kill, the messages the broker still holds unacknowledged are at least those whose page
    is not committed (each message asks for a URL of its own), and on SQS they are those very
    messages (moto's own list of the messages not deleted)."""
    db = str(tmp_path / "frontier.sqlite3")
    rng = random.Random(7)
    concurrency = 4
    kills = 10
    settings = (f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
                "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=4")
    with LocalSite(delay=0.01) as shop:
        bodies: list[Any] = [f"{shop.url}/list/{n}" for n in range(1, 26)] + [
            product_body(shop, n) for n in range(1, 501)]
        rng.shuffle(bodies)
        urls = {b if isinstance(b, str) else b["url"] for b in bodies}
        for body in bodies:
            broker_queue.push(body)
        problems: list[str] = []
        for run in range(kills):
            before = shop.request_count
            pages = rng.randint(5, 60)
            log = tmp_path / f"run{run}.log"
            worker = start_worker(broker_queue, db, log, *settings)
            try:
                wait_for(running(worker, lambda b=before, n=pages: shop.request_count - b >= n),
                         240, f"{pages} pages in run {run}", log)
            finally:
                kill(worker)
            uncommitted = urls - committed(db)
            remaining = broker_queue.remaining()
            if remaining < len(uncommitted):
                problems.append(f"run {run}: {remaining} messages left for {len(uncommitted)} "
                                "pages not committed")
            held = broker_queue.held_urls()
            if held is not None and uncommitted - held:
                problems.append(f"run {run}: the messages of {len(uncommitted - held)} pages "
                                f"not committed are gone, e.g. {min(uncommitted - held)}")
        worker = start_worker(broker_queue, db, tmp_path / "final.log", *settings)
        try:
            assert worker.wait(timeout=600) == 0
        finally:
            if worker.poll() is None:
                kill(worker)
        assert close_reason(tmp_path / "final.log") == "finished"
        requests = shop.request_count
        expected = shop.expected_products()
    assert problems == []
    rows = stored_products(db)
    assert len(rows) == 500
    assert all((r["sku"], r["name"], r["price"]) == tuple(expected[r["sku"]][f] for f in (
        "sku", "name", "price")) for r in rows)
    assert frontier_counts(db) == {"done": 525}
    assert broker_queue.all_acknowledged()
    assert requests <= 525 + kills * concurrency, requests
    print(f"\nqueue kill test ({request.node.callspec.id}): {kills} kills, {requests} "
          f"requests (bound {525 + kills * concurrency}), {len(rows)} records")


@pytest.mark.parametrize("broker_queue", ["sqs", "sqs-fifo", "amqp", "redis"], indirect=True)
def test_a_broker_restarted_mid_crawl(broker_queue: BrokerQueue, tmp_path: Path) -> None:
    """The broker is stopped and started again while a worker crawls 200 queued products
    (Redis: persistent, so its pending entries are kept): the crawl goes on once it is back;
    nothing lost, nothing left unacknowledged."""
    db = str(tmp_path / "frontier.sqlite3")
    log = tmp_path / "run.log"
    with LocalSite(delay=0.02) as shop:
        for n in range(1, 201):
            broker_queue.push(product_body(shop, n))
        # the idle timeout longer than the outage: the crawl waits for the broker
        worker = start_worker(broker_queue, db, log, "CONCURRENT_REQUESTS=4",
                              "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=30")
        try:
            wait_for(lambda: shop.request_count >= 40, 240, "40 pages", log)
            broker_queue.stop()
            try:
                wait_for(lambda: "(retried every" in log.read_text(), 120,
                         "the worker meeting the stopped broker", log)
            finally:
                broker_queue.start()
            assert worker.wait(timeout=300) == 0
        finally:
            if worker.poll() is None:
                kill(worker)
        assert close_reason(log) == "finished"
        requests = shop.request_count
    assert len(stored_products(db)) == 200
    assert frontier_counts(db) == {"done": 200}
    assert broker_queue.all_acknowledged()
    assert requests <= 200 + 4, requests
    text = log.read_text()
    assert "reachable again" in text, text[-3000:]


@pytest.mark.parametrize("broker_queue", ["redis", "sqs", "amqp"], indirect=True)
def test_two_stop_messages_read_in_one_batch_are_both_acknowledged(
        broker_queue: BrokerQueue, tmp_path: Path) -> None:
    """Two stop messages among three products, all read in the worker's first batch: the
    crawl finishes once the three are done, and every message read is acknowledged, both
    stop messages too. So the next crawl is not ended by a stale stop message: it crawls the
    messages pushed for it."""
    db = str(tmp_path / "frontier.sqlite3")
    with LocalSite() as shop:
        for body in (product_body(shop, 1), STOP, product_body(shop, 2), STOP,
                     product_body(shop, 3)):
            broker_queue.push(body)
        for run, products in (("run1", (1, 2, 3)), ("run2", (4, 5, 6))):
            if run == "run2":
                for number in products:
                    broker_queue.push(product_body(shop, number))
                broker_queue.push(STOP)
            log = tmp_path / f"{run}.log"
            worker = start_worker(broker_queue, db, log)
            try:
                assert worker.wait(timeout=240) == 0
            finally:
                if worker.poll() is None:
                    kill(worker)
            assert close_reason(log) == "finished"
            assert committed(db) >= {product_body(shop, n)["url"] for n in products}, run
            assert broker_queue.remaining() == 0, run  # every message read acknowledged
    assert sorted(p["sku"] for p in stored_products(db)) == [
        f"SKU-{n:05d}" for n in range(1, 7)]
