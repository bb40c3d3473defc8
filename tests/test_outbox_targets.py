"""The target interface for brokers: the docs' Redis Streams example against a real
redis-server, in a crawl and in ``scrapy idempotent deliver``; a target's refusals and
retries through the interface."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl
from helpers.stored import outbox_due_now, outbox_rows, outbox_states, stored_records
from redis_server import RedisServer, redis_server  # noqa: F401 (the fixture)
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}
HERE = Path(__file__).resolve().parent


@pytest.fixture
def small_shop() -> Any:
    with LocalSite(listing_pages=5, products_per_page=10) as site:
        yield site


def stored_keys(database: str) -> set[str]:
    return {f"{r.record_id}:{r.version}:{r.content_hash}" for r in stored_records(database)}


@deferred_f_from_coro_f
async def test_the_readme_redis_stream_target_in_a_crawl(
        small_shop: LocalSite, crawl_database: str, redis_server: RedisServer,  # noqa: F811
        request: pytest.FixtureRequest) -> None:
    stream = f"records-{request.node.name}"
    crawler = await run_crawl(ShopSpider, crawl_settings(
        crawl_database, **NATURAL_KEYS,
        IDEMPOTENT_OUTBOX_TARGETS=["outbox_targets.RedisStreamTarget"],
        REDIS_URL=redis_server.url, REDIS_STREAM=stream), url=small_shop.url)
    assert crawler.stats.get_value("idempotent/outbox/delivered") == 50
    messages = redis_server.client().xrange(stream)
    assert Counter(fields["key"] for _, fields in messages) == dict.fromkeys(
        stored_keys(crawl_database), 1)
    body = json.loads(messages[0][1]["body"])
    assert body["kind"] == "inserted" and body["idempotency_key"] == messages[0][1]["key"]
    # the answer kept with each entry is the stream's message id
    assert sorted(e.detail for e in outbox_rows(crawl_database)) == sorted(
        message_id for message_id, _ in messages)


@deferred_f_from_coro_f
async def test_deliver_command_builds_a_class_target_from_the_settings(
        small_shop: LocalSite, crawl_database: str, redis_server: RedisServer,  # noqa: F811
        request: pytest.FixtureRequest, tmp_path: Path) -> None:
    stream = f"records-{request.node.name}"
    target = "outbox_targets.RedisStreamTarget"
    settings = crawl_settings(crawl_database, **NATURAL_KEYS,
                              IDEMPOTENT_OUTBOX_TARGETS=[target],
                              IDEMPOTENT_OUTBOX_DRAIN_SECONDS=0,
                              REDIS_URL="redis://127.0.0.1:1/0", REDIS_STREAM=stream)
    await run_crawl(ShopSpider, settings, url=small_shop.url)  # Redis unreachable: all left
    assert outbox_states(crawl_database) == {"pending": 50}
    outbox_due_now(crawl_database)  # whatever the backoff said
    done = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "deliver", "--db", crawl_database,
         "--json", "-s", f"IDEMPOTENT_OUTBOX_TARGETS={target}",
         "-s", f"REDIS_URL={redis_server.url}", "-s", f"REDIS_STREAM={stream}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(HERE)})  # outbox_targets importable
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["delivered"] == 50
    keys = [fields["key"] for _, fields in redis_server.client().xrange(stream)]
    assert sorted(keys) == sorted(stored_keys(crawl_database))


@deferred_f_from_coro_f
async def test_a_target_refuses_and_defers_through_the_interface(
        small_shop: LocalSite, crawl_database: str) -> None:
    from outbox_targets import PickyTarget

    PickyTarget.CALLS.clear()
    crawler = await run_crawl(ShopSpider, crawl_settings(
        crawl_database, **NATURAL_KEYS, IDEMPOTENT_OUTBOX_TARGETS=["outbox_targets.PickyTarget"],
        IDEMPOTENT_OUTBOX_RETRY_SECONDS=0), url=small_shop.url)
    stats = crawler.stats.get_stats()
    skus = {r.record_id: json.loads(r.data)["sku"] for r in stored_records(crawl_database)}
    rows = [(skus[e.record_id], e.state, e.attempts, e.detail)
            for e in outbox_rows(crawl_database)]
    by_state = Counter(state for _, state, _, _ in rows)
    assert by_state == {"failed": 5, "delivered": 45}
    assert stats["idempotent/outbox/failed"] == 5
    assert stats["idempotent/outbox/retried"] == 5
    for sku, state, attempts, detail in rows:
        if sku.endswith("1"):
            assert (state, attempts, detail) == ("failed", 1, f"{sku}: not for us")
        elif sku.endswith("2"):
            assert (state, attempts, detail) == ("delivered", 2, f"took {sku}")
        else:
            assert (state, attempts, detail) == ("delivered", 1, f"took {sku}")
