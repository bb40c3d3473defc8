"""Feeding a crawl from a Redis stream (real Redis server, real crawls of the local shop):
messages become requests, are acknowledged only after their page is committed, redelivery is
harmless, bad messages are parked, an empty queue keeps the crawl idle."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from local_site import LocalSite
from scrapy import signals as scrapy_signals
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import (
    crawl_to_end,
    frontier_counts,
    stored_products,
    wait_for,
)
from helpers.queues import (
    GROUP,
    QueueSpider,
    acknowledged_all,
    product,
    product_message,
    queue_settings,
    reactor_wait_for,
)
from helpers.stored import change_stored, frontier_entries
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)
from scrapy_idempotent import signals
from scrapy_idempotent.queue_input import QueueInput


def pending_count(client: Any, key: str) -> int:
    return int(client.xpending(key, GROUP)["pending"])


def message_url(fields: dict[str, str]) -> str | None:
    if "url" in fields:
        return fields["url"]
    if "request" in fields:
        return str(json.loads(fields["request"])["url"])
    return None


class AckProbe:
    """Wraps the queue input's Redis client (the real one) and checks at every ``XACK`` that
    the page each acknowledged message asked for is committed in a final state."""

    def __init__(self, crawler: Any, database: str) -> None:
        self.crawler, self.database = crawler, database
        self.problems: list[str] = []
        self.acked: list[str] = []
        crawler.signals.connect(self.spider_opened, signal=scrapy_signals.spider_opened)

    def spider_opened(self) -> None:
        (queue_input,) = [ext for ext in self.crawler.extensions.middlewares
                          if isinstance(ext, QueueInput)]
        client = queue_input.redis
        probe = self

        class CheckedClient:
            def __getattr__(self, name: str) -> Any:
                return getattr(client, name)

            def xack(self, key: str, group: str, *ids: str) -> Any:
                probe.check(client, key, ids)
                return client.xack(key, group, *ids)

        queue_input.redis = CheckedClient()

    def check(self, client: Any, key: str, ids: tuple[str, ...]) -> None:
        for message_id in ids:
            self.acked.append(message_id)
            ((_, fields),) = client.xrange(key, message_id, message_id)
            url = message_url(fields)
            if url is None:
                continue  # the stop message
            entries = frontier_entries(self.database)
            rows = [(e.key, e.state) for e in entries if e.url == url]
            while rows and all(state == "redirected" for _, state in rows):
                # a redirect is finished when its target is (the target: its child entry);
                # one whose target was refused before the frontier (offsite) is finished
                parents = {k for k, _ in rows}
                targets = [(e.key, e.state) for e in entries if e.parent_key in parents]
                if not targets:
                    break
                rows = targets
            states = {state for _, state in rows}
            if not states or not states <= {"done", "failed", "redirected"}:
                self.problems.append(f"{message_id} ({url}) acknowledged in state {states}")


@deferred_f_from_coro_f
async def test_messages_become_requests_acknowledged_after_commit(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    with LocalSite(listing_pages=2, products_per_page=3, products_failing=[3]) as shop:
        for _ in range(3):  # the same URL three times: one entry, one record
            client.xadd(key, product_message(shop, 1))
        client.xadd(key, {"request": json.dumps({
            "url": product(shop, 2), "callback": "parse_product", "meta": {"source": "q"},
            "priority": 5})})
        client.xadd(key, product_message(shop, 3))  # answers 503: failed, then acknowledged
        client.xadd(key, {"url": f"{shop.url}/list/2"})  # links products 4..6 and list 1
        client.xadd(key, {"stop": "1"})
        crawler = get_crawler(QueueSpider, queue_settings(crawl_database, redis_server, key))
        probe = AckProbe(crawler, crawl_database)
        await crawl_to_end(crawler)
        requests = shop.counts_by_path()
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert probe.problems == []
    assert len(probe.acked) == 7
    assert requests["/product/SKU-00001"] == 1
    assert frontier_counts(crawl_database) == {"done": 7, "failed": 1}  # 2 listings, 6 products
    skus = sorted(p["sku"] for p in stored_products(crawl_database))
    assert skus == [f"SKU-{n:05d}" for n in (1, 2, 4, 5, 6)]
    assert [(e.state, e.error_kind) for e in frontier_entries(crawl_database)
            if e.url.endswith("SKU-00003")] == [("failed", "http_status")]
    assert acknowledged_all(client, key)
    assert stats["idempotent/queue/received"] == 7
    assert stats["idempotent/queue/acknowledged"] == 7  # the stop message included
    assert "idempotent/queue/parked" not in stats


@deferred_f_from_coro_f
async def test_a_redirected_request_is_acknowledged_when_its_target_is_done(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    with LocalSite(listing_pages=1, products_per_page=2) as shop:
        client.xadd(key, {"url": f"{shop.url}/"})  # 302 to /list/1
        client.xadd(key, {"stop": "1"})
        crawler = get_crawler(QueueSpider, queue_settings(crawl_database, redis_server, key))
        probe = AckProbe(crawler, crawl_database)
        await crawl_to_end(crawler)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert probe.problems == []
    assert frontier_counts(crawl_database) == {"redirected": 1, "done": 3}
    assert len(stored_products(crawl_database)) == 2
    assert acknowledged_all(client, key)
    assert len(probe.acked) == 2


@deferred_f_from_coro_f
async def test_a_request_redirected_off_site_is_acknowledged_after_its_redirect(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    # the offsite middleware drops the target after request_scheduled was sent for it: the
    # message must not wait for a request that never reaches the frontier
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    with LocalSite(listing_pages=1, products_per_page=1) as shop:
        client.xadd(key, {"url": f"{shop.url}/redirect/302/away?to=http://elsewhere.invalid/x"})
        client.xadd(key, {"stop": "1"})
        spider = type("OffsiteQueueSpider", (QueueSpider,), {"allowed_domains": ["127.0.0.1"]})
        crawler = get_crawler(spider, queue_settings(crawl_database, redis_server, key))
        probe = AckProbe(crawler, crawl_database)
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["offsite/filtered"] == 1
    assert probe.problems == []
    assert frontier_counts(crawl_database) == {"redirected": 1}
    assert acknowledged_all(client, key)
    assert stats["idempotent/queue/acknowledged"] == 2  # the stop message included


@deferred_f_from_coro_f
async def test_messages_idle_with_a_consumer_of_another_host_are_claimed(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    """Messages read by a worker of another host that never acknowledged them (it died, or
    hangs) are taken over once idle for IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS (XAUTOCLAIM)."""
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    client.xgroup_create(key, GROUP, id="0", mkstream=True)
    with LocalSite() as shop:
        ids = [client.xadd(key, product_message(shop, n)) for n in (8, 9)]
        client.xreadgroup(GROUP, "otherhost:4242:1:cafe", {key: ">"})
        assert pending_count(client, key) == 2
        wait_for(lambda: min(p["time_since_delivered"] for p in client.xpending_range(
            key, GROUP, "-", "+", 10)) >= 1000, 60, "the messages idle for a second")
        client.xadd(key, {"stop": "1"})
        crawler = get_crawler(QueueSpider, queue_settings(
            crawl_database, redis_server, key, IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS=1))
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/queue/claimed"] == 2
    assert sorted(p["sku"] for p in stored_products(crawl_database)) == ["SKU-00008", "SKU-00009"]
    assert acknowledged_all(client, key)
    assert len(ids) == 2


@deferred_f_from_coro_f
async def test_a_message_whose_request_another_worker_does_is_acknowledged_after_it(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    """Two workers on one stream and one frontier: B reads a message whose request A is
    fetching (a duplicate for B: A holds the lease). B never sees A's signal; it acknowledges
    the message once the frontier has the request done."""
    from scrapy.utils.defer import maybe_deferred_to_future

    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    settings = queue_settings(crawl_database, redis_server, key, IDEMPOTENT_QUEUE_PREFETCH=1,
                              IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=0.5)
    with LocalSite(delay=10) as shop:
        client.xadd(key, product_message(shop, 1))
        worker_a = get_crawler(QueueSpider, settings)
        crawl_a = worker_a.crawl()
        await reactor_wait_for(lambda: shop.in_flight >= 1, "A fetching the page")
        second = client.xadd(key, product_message(shop, 1))  # A holds its one message
        worker_b = get_crawler(QueueSpider, settings)
        crawl_b = worker_b.crawl()
        await reactor_wait_for(lambda: worker_b.stats.get_value("idempotent/queue/received"),
                               "B reading the second message")
        assert shop.in_flight >= 1  # A's page still in flight: B met a leased request
        await maybe_deferred_to_future(crawl_a)
        await maybe_deferred_to_future(crawl_b)
        assert shop.counts_by_path() == {"/product/SKU-00001": 1}
    for worker in (worker_a, worker_b):
        assert worker.stats.get_value("finish_reason") == "finished"
        assert worker.stats.get_value("idempotent/queue/acknowledged") == 1
    assert worker_b.stats.get_value("idempotent/requests/duplicate") == 1
    assert [e.state for e in frontier_entries(crawl_database)] == ["done"]
    assert acknowledged_all(client, key)
    assert second not in {p["message_id"] for p in client.xpending_range(key, GROUP, "-", "+",
                                                                          10)}


@deferred_f_from_coro_f
async def test_bad_messages_are_parked_with_their_error_and_the_crawl_goes_on(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    with LocalSite() as shop:
        bad = [
            {"request": "{not json"},
            {"request": json.dumps({"url": product(shop, 1), "callback": "no_such_method"})},
            {"request": json.dumps({"url": product(shop, 1), "dont_filter": True})},
            {"request": json.dumps(["a", "list"])},
            {"url": "ftp://example.com/file"},
            {"url": "not a url"},
            {"link": product(shop, 1)},
            {"url": "http://elsewhere.example/page"},  # offsite: refused before the frontier
        ]
        ids = [client.xadd(key, fields) for fields in bad]
        client.xadd(key, product_message(shop, 7))
        client.xadd(key, {"stop": "1"})
        settings = queue_settings(crawl_database, redis_server, key)
        crawler = get_crawler(type("OffsiteSpider", (QueueSpider,), {
            "allowed_domains": ["127.0.0.1"]}), settings)
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    parked = client.xrange(f"{key}:parked")
    assert [fields["id"] for _, fields in parked] == ids
    errors = [fields["error"] for _, fields in parked]
    assert "not JSON" in errors[0]
    assert "no_such_method" in errors[1] and "method of the spider" in errors[1]
    assert "unknown request key(s) dont_filter" in errors[2]
    assert "JSON object" in errors[3]
    assert "http(s) URL" in errors[4] and "http(s) URL" in errors[5]
    assert "one field" in errors[6] and "link" in errors[6]
    assert "allowed_domains" in errors[7]
    assert json.loads(parked[6][1]["fields"]) == {"link": product(shop, 1)}
    assert stats["idempotent/queue/parked"] == 8
    assert acknowledged_all(client, key)
    assert [p["sku"] for p in stored_products(crawl_database)] == ["SKU-00007"]


@deferred_f_from_coro_f
async def test_empty_queue_keeps_the_crawl_idle_until_stop(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    """Work arrives while the crawl is idle (each message added once the previous one is
    done): the crawl waits for it instead of finishing, and finishes on the stop message."""
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    with LocalSite() as shop:
        client.xadd(key, product_message(shop, 1))
        follow_ups = [product_message(shop, 2), product_message(shop, 3), {"stop": "1"}]

        def add_next(request: Any, state: str) -> None:
            if follow_ups:
                client.xadd(key, follow_ups.pop(0))

        crawler = get_crawler(QueueSpider, queue_settings(crawl_database, redis_server, key))
        crawler.signals.connect(add_next, signal=signals.request_done)
        await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert follow_ups == []
    assert len(stored_products(crawl_database)) == 3
    assert acknowledged_all(client, key)


@deferred_f_from_coro_f
async def test_idle_timeout_finishes_an_empty_queue(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    key = f"q-{uuid.uuid4().hex}"
    crawler = get_crawler(QueueSpider, queue_settings(
        crawl_database, redis_server, key, IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=0.5))
    await crawl_to_end(crawler)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert "idempotent/queue/received" not in stats
    assert redis_server.client().xinfo_groups(key)[0]["name"] == GROUP


@deferred_f_from_coro_f
async def test_recrawl_window_applies_to_queued_urls(
    redis_server: RedisServer, crawl_database: str  # noqa: F811
) -> None:
    """With IDEMPOTENT_RECRAWL_SECONDS, a URL queued again in the same window is not fetched
    (acknowledged as already done); in a later window it is fetched again (one entry)."""
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    window = 3600.0
    settings = queue_settings(crawl_database, redis_server, key, IDEMPOTENT_RECRAWL_SECONDS=window)
    with LocalSite() as shop:
        message = product_message(shop, 4)
        for _ in range(2):  # the second: the same window
            client.xadd(key, message)
            client.xadd(key, {"stop": "1"})
            crawler = get_crawler(QueueSpider, settings)
            await crawl_to_end(crawler)
            assert crawler.stats.get_value("finish_reason") == "finished"
        assert shop.counts_by_path()["/product/SKU-00004"] == 1
        assert crawler.stats.get_value("idempotent/requests/already_done") == 1
        # the page was done in an earlier window (moved back by one window, as time passing)
        change_stored(crawl_database, "UPDATE requests SET finished_at = finished_at - ?",
                      (window,))
        client.xadd(key, message)
        client.xadd(key, {"stop": "1"})
        crawler = get_crawler(QueueSpider, settings)
        await crawl_to_end(crawler)
        assert shop.counts_by_path()["/product/SKU-00004"] == 2
    assert [e.state for e in frontier_entries(crawl_database)] == ["done"]
    assert len(stored_products(crawl_database)) == 1
    assert acknowledged_all(client, key)


def test_queue_settings_are_validated(redis_server: RedisServer) -> None:  # noqa: F811
    from scrapy_idempotent.exceptions import ConfigError
    from scrapy_idempotent.queue_input import QueueConfig

    for name, value, rule in [
        ("IDEMPOTENT_QUEUE_URL", "http://localhost", "a Redis URL"),
        ("IDEMPOTENT_QUEUE_PREFETCH", 0, ">= 1"),
        ("IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS", "soon", ">= 0"),
    ]:
        settings = {"IDEMPOTENT_QUEUE_URL": redis_server.url, name: value}
        with pytest.raises(ConfigError, match=rule) as info:
            QueueConfig.from_crawler(get_crawler(QueueSpider, settings))
        assert name in str(info.value)
    config = QueueConfig.from_crawler(get_crawler(QueueSpider, {
        "IDEMPOTENT_QUEUE_URL": redis_server.url}))
    assert config is not None and config.key == "queue_shop:requests"
    assert QueueConfig.from_crawler(get_crawler(QueueSpider, {})) is None


def test_a_held_message_is_kept_from_a_peer_while_its_request_is_in_progress(
        redis_server: RedisServer) -> None:  # noqa: F811
    """A peer's XAUTOCLAIM takes any message pending IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS. A
    worker's extension resets the idle time of the messages whose requests are in progress
    there (a slow page, a long wait in the frontier), so the peer does not take them; a
    message the worker no longer holds is left to the peer, and one the peer took over stays
    the peer's. Idle times are set at the server (XCLAIM IDLE), not waited for."""
    from scrapy_idempotent.config import QueueConfig
    from scrapy_idempotent.queue_input.redis_stream import RedisStreamBroker

    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    config = QueueConfig(url=redis_server.url, key=key, group=GROUP, idle_timeout_seconds=None,
                         claim_idle_seconds=30, prefetch=10, poll_seconds=0.05)
    here_name, peer_name = "host-a:101:1:aaaa:ns", "host-b:202:1:bbbb:ns"  # other hosts
    here = RedisStreamBroker.from_config(config, here_name)
    peer = RedisStreamBroker.from_config(config, peer_name)
    in_progress, let_go = (client.xadd(key, {"url": f"https://example.com/{n}"})
                           for n in (1, 2))
    assert [i for i, _ in here.take(10, True, frozenset()).entries] == [in_progress, let_go]

    def idle_for(consumer: str, *ids: str) -> None:  # pending that long, as after a stall
        client.xclaim(key, GROUP, consumer, 0, list(ids), idle=50_000, justid=True)

    def owners() -> dict[str, tuple[str, int]]:
        return {p["message_id"]: (p["consumer"], p["times_delivered"])
                for p in client.xpending_range(key, GROUP, "-", "+", 10)}

    idle_for(here_name, in_progress, let_go)
    here.extend([in_progress])  # its request in progress here; the other one not held
    taken = peer.take(10, True, frozenset())
    assert [i for i, _ in taken.entries] == [let_go]
    assert owners() == {in_progress: (here_name, 1), let_go: (peer_name, 2)}

    idle_for(peer_name, let_go)  # the peer's now, however idle: not taken back
    idle_for(here_name, in_progress)
    RedisStreamBroker.from_config(config, here_name).extend([in_progress, let_go])
    assert owners() == {in_progress: (here_name, 1), let_go: (peer_name, 2)}
    assert peer.take(10, True, frozenset({let_go})).entries == []
    for broker in (here, peer):
        broker.close()
    client.close()


def test_consumers_of_dead_workers_elsewhere_leave_the_group(
        redis_server: RedisServer) -> None:  # noqa: F811
    """A worker of another host that died stays a consumer of the group until its messages
    are taken over (XAUTOCLAIM after IDEMPOTENT_QUEUE_CLAIM_IDLE_SECONDS); then it is removed,
    as one that held nothing is; a consumer that holds a message is kept."""
    from scrapy_idempotent.config import QueueConfig
    from scrapy_idempotent.queue_input.redis_stream import RedisStreamBroker

    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    config = QueueConfig(url=redis_server.url, key=key, group=GROUP, idle_timeout_seconds=None,
                         claim_idle_seconds=1, prefetch=10, poll_seconds=0.05)
    here_name, busy = "host-a:101:1:aaaa:ns", "host-b:202:1:bbbb:ns"
    dead_holding, dead_empty = "host-c:303:1:cccc:ns", "host-d:404:1:dddd:ns"
    client.xgroup_create(key, GROUP, id="0", mkstream=True)
    held = [client.xadd(key, {"url": f"https://example.com/{n}"}) for n in (1, 2)]
    client.xreadgroup(GROUP, dead_holding, {key: ">"})  # both, never acknowledged
    client.xreadgroup(GROUP, dead_empty, {key: ">"})  # nothing left to read
    wait_for(lambda: min(c["idle"] for c in client.xinfo_consumers(key, GROUP)) >= 1000
             and min(p["time_since_delivered"] for p in client.xpending_range(
                 key, GROUP, "-", "+", 10)) >= 1000, 60, "the consumers idle for a second")
    kept = client.xadd(key, {"url": "https://example.com/3"})
    client.xreadgroup(GROUP, busy, {key: ">"})  # a live worker holding a message
    here = RedisStreamBroker.from_config(config, here_name)
    taken = here.take(10, False, frozenset())
    assert [i for i, _ in taken.entries] == held
    assert {c["name"] for c in client.xinfo_consumers(key, GROUP)} == {here_name, busy}
    assert {p["message_id"]: p["consumer"] for p in client.xpending_range(
        key, GROUP, "-", "+", 10)} == {held[0]: here_name, held[1]: here_name, kept: busy}
    here.close()
    client.close()
