"""Outbox delivery through real crawls of the local shop to a real local webhook receiver."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f, maybe_deferred_to_future

from crawling import crawl_settings, run_crawl
from helpers.stored import outbox_due_now, outbox_rows, outbox_states, stored_records
from helpers.webhook_receiver import WebhookReceiver
from scrapy_idempotent.outbox import Deliverer, WebhookTarget, webhook_retry_after
from scrapy_idempotent.store import SQLiteStore
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def outbox_settings(database: str, *targets: str, **extra: Any) -> dict[str, Any]:
    return crawl_settings(database, **NATURAL_KEYS, IDEMPOTENT_OUTBOX_TARGETS=list(targets),
                          IDEMPOTENT_OUTBOX_RETRY_SECONDS=0.05, **extra)


@pytest.fixture
def small_shop() -> Any:
    """5 listing pages, 50 products."""
    with LocalSite(listing_pages=5, products_per_page=10) as site:
        yield site


@pytest.fixture
def hook() -> Any:
    with WebhookReceiver() as receiver:
        yield receiver


@deferred_f_from_coro_f
async def test_every_inserted_record_is_announced_once_with_its_key(
        shop: LocalSite, crawl_database: str, hook: WebhookReceiver) -> None:
    crawler = await run_crawl(ShopSpider, outbox_settings(crawl_database, hook.url),
                              url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/outbox/written"] == 500
    assert stats["idempotent/outbox/delivered"] == 500
    assert stats["idempotent/outbox/pending"] == 0
    keys = hook.keys_acknowledged()
    stored = {r.record_id: r.content_hash for r in stored_records(crawl_database)}
    assert keys == Counter({f"{rid}:1:{h}": 1 for rid, h in stored.items()})  # version 1
    delivery = hook.acknowledged()[0]
    body = delivery.body
    assert delivery.headers["Content-Type"] == "application/json"
    assert body["idempotency_key"] == delivery.key
    assert body["kind"] == "inserted"
    assert body["record_id"] in stored and body["content_hash"] == stored[body["record_id"]]
    assert body["item_type"] == "shop.items.ProductItem"
    assert body["natural_key"] == [body["record"]["sku"]]
    assert set(body["record"]) >= {"sku", "name", "price"}
    assert outbox_states(crawl_database) == {"delivered": 500}
    # delivered entries keep their key, not the record data
    assert [e.entry_id for e in outbox_rows(crawl_database) if e.data is not None] == []


@deferred_f_from_coro_f
async def test_unchanged_records_are_not_announced_changed_ones_are(
        small_shop: LocalSite, crawl_database: str, hook: WebhookReceiver) -> None:
    settings = outbox_settings(crawl_database, hook.url)
    await run_crawl(ShopSpider, settings, url=small_shop.url)
    await run_crawl(ShopSpider, settings, url=small_shop.url)  # a new run, nothing changed
    assert len(hook.acknowledged()) == 50
    with LocalSite(listing_pages=5, products_per_page=10, price_version=1) as repriced:
        await run_crawl(ShopSpider, settings, url=repriced.url)
    kinds = Counter(d.body["kind"] for d in hook.acknowledged())
    assert kinds == {"inserted": 50, "updated": 50}
    assert len(hook.keys_acknowledged()) == 100


@deferred_f_from_coro_f
async def test_without_a_target_nothing_is_written_nor_sent(
        small_shop: LocalSite, crawl_database: str) -> None:
    crawler = await run_crawl(ShopSpider, crawl_settings(crawl_database, **NATURAL_KEYS),
                              url=small_shop.url)
    assert "idempotent/outbox/written" not in crawler.stats.get_stats()
    assert outbox_rows(crawl_database) == []


@deferred_f_from_coro_f
async def test_a_receiver_down_for_a_while_gets_every_announcement(
        small_shop: LocalSite, crawl_database: str, hook: WebhookReceiver) -> None:
    hook.down_for(30)
    crawler = await run_crawl(ShopSpider, outbox_settings(crawl_database, hook.url),
                              url=small_shop.url)
    stats = crawler.stats.get_stats()
    assert sum(1 for d in hook.deliveries if d.status == 503) == 30
    # every 503 is retried (a kept-alive connection the receiver dropped is retried too)
    assert stats["idempotent/outbox/retried"] >= 30
    assert stats["idempotent/outbox/delivered"] == 50
    assert len(hook.keys_acknowledged()) == 50
    assert outbox_states(crawl_database) == {"delivered": 50}
    # every retried entry counted its attempts
    assert sum(e.attempts for e in outbox_rows(crawl_database)) == (
        50 + stats["idempotent/outbox/retried"])


@deferred_f_from_coro_f
async def test_a_refused_announcement_is_parked_as_failed_with_the_answer(
        small_shop: LocalSite, crawl_database: str, hook: WebhookReceiver) -> None:
    settings = outbox_settings(crawl_database, hook.url)
    await run_crawl(ShopSpider, settings, url=small_shop.url)
    refused = {r.record_id for r in stored_records(crawl_database)[:3]}
    hook.refuse.update(refused)
    with LocalSite(listing_pages=5, products_per_page=10, price_version=1) as repriced:
        crawler = await run_crawl(ShopSpider, settings, url=repriced.url)
    stats = crawler.stats.get_stats()
    assert stats["idempotent/outbox/failed"] == 3
    assert stats["idempotent/outbox/delivered"] == 47
    assert "idempotent/outbox/retried" not in stats  # a 400 is not tried again
    failed = [e for e in outbox_rows(crawl_database) if e.state == "failed"]
    assert {e.record_id for e in failed} == refused
    assert all((e.kind, e.attempts, e.data is not None) == ("updated", 1, True)
               and e.detail is not None and e.detail.startswith("HTTP 400") for e in failed)


@deferred_f_from_coro_f
async def test_close_drains_for_at_most_the_drain_seconds(
        small_shop: LocalSite, crawl_database: str, hook: WebhookReceiver) -> None:
    hook.down = True
    crawler = await run_crawl(ShopSpider, outbox_settings(
        crawl_database, hook.url, IDEMPOTENT_OUTBOX_DRAIN_SECONDS=0), url=small_shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/outbox/pending"] == 50
    assert outbox_states(crawl_database) == {"pending": 50}
    # the next crawl delivers what is left (a new run: nothing new to announce)
    hook.down = False
    crawler = await run_crawl(ShopSpider, outbox_settings(crawl_database, hook.url),
                              url=small_shop.url)
    assert outbox_states(crawl_database) == {"delivered": 50}
    assert len(hook.keys_acknowledged()) == 50


@deferred_f_from_coro_f
async def test_retry_after_is_honoured(tmp_path: Path, hook: WebhookReceiver) -> None:
    """A 503 with ``Retry-After: 120`` puts the entry's next try two minutes away, whatever
    the (much shorter) backoff says."""
    from helpers.stores import fetch_page, rec

    clock = [1_700_000_000.0]
    store = SQLiteStore(str(tmp_path / "db.sqlite3"), clock=lambda: clock[0])
    store.open(fingerprinter="x")
    store.begin_session("w1", "auto")
    fetch_page(store, "a", rec("r1", "h1"), targets=(hook.url,))
    hook.down_for(1)
    hook.retry_after = "120"
    target = WebhookTarget(hook.url, timeout_seconds=10)
    target.name = hook.url
    deliverer = Deliverer(store, [target], concurrency=1, timeout_seconds=10,
                          retry_seconds=0.01, retry_max_seconds=1, clock=lambda: clock[0])
    assert await maybe_deferred_to_future(deliverer.pump()) == 1
    await maybe_deferred_to_future(deliverer.wait_idle())
    [entry] = store.outbox_entries()
    due = store.outbox_next_due([hook.url])
    assert due is not None and (due - clock[0], entry.attempts) == (120.0, 1)
    assert entry.detail is not None and entry.detail.startswith("HTTP 503")
    assert await maybe_deferred_to_future(deliverer.pump()) == 0  # not due yet
    clock[0] += 120
    assert await maybe_deferred_to_future(deliverer.pump()) == 1
    await maybe_deferred_to_future(deliverer.wait_idle())
    assert [entry.state for entry in store.outbox_entries()] == ["delivered"]
    await deliverer.close()
    store.close()


def test_a_webhooks_retry_after_is_at_most_a_day() -> None:
    assert webhook_retry_after(b"") is None
    assert webhook_retry_after(b"7") == 7.0
    assert webhook_retry_after(b"99999999") == 86400.0


def test_backoff_doubles_with_jitter_up_to_the_maximum(tmp_path: Path) -> None:
    deliverer = Deliverer(SQLiteStore(str(tmp_path / "x")), [], concurrency=1,
                          timeout_seconds=1, retry_seconds=1.0, retry_max_seconds=60.0)
    for attempts, full in ((0, 1.0), (1, 2.0), (3, 8.0), (10, 60.0), (100, 60.0)):
        delays = [deliverer.backoff(attempts) for _ in range(200)]
        assert all(full * 0.5 <= d <= full for d in delays)
        assert len(set(delays)) > 1  # jitter
    assert deliverer.backoff(0, retry_after=30.0) == 30.0


@deferred_f_from_coro_f
async def test_deliver_command_sends_what_a_crawl_left_and_status_counts_it(
        small_shop: LocalSite, crawl_database: str, hook: WebhookReceiver,
        tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from helpers.commands import idempotent_json

    hook.down = True
    await run_crawl(ShopSpider, outbox_settings(
        crawl_database, hook.url, IDEMPOTENT_OUTBOX_DRAIN_SECONDS=0), url=small_shop.url)
    status = idempotent_json("status", "--db", crawl_database)
    assert status["outbox"] == {hook.url: {"pending": 50, "delivered": 0, "failed": 0}}

    def deliver(drain_seconds: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "scrapy", "idempotent", "deliver", "--db", crawl_database,
             "--json", "-s", f"IDEMPOTENT_OUTBOX_TARGETS={hook.url}",
             "-s", "IDEMPOTENT_OUTBOX_RETRY_SECONDS=60",
             "-s", f"IDEMPOTENT_OUTBOX_DRAIN_SECONDS={drain_seconds}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)

    still_down = deliver(1)  # what it tries is answered 503: all left pending, exit code 1
    assert still_down.returncode == 1, still_down.stderr
    assert json.loads(still_down.stdout)["pending"] == 50
    hook.down = False
    outbox_due_now(crawl_database)  # no waiting for the backoff
    done = deliver(120)  # ends as soon as nothing is pending
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["delivered"], report["pending"]) == (50, 0)
    assert len(hook.keys_acknowledged()) == 50
    status = idempotent_json("status", "--db", crawl_database)
    assert status["outbox"] == {hook.url: {"pending": 0, "delivered": 50, "failed": 0}}


@pytest.mark.parametrize(("value", "rule"), [
    (["ftp://hooks.example/x"], "an http:// or https:// webhook URL"),
    (["http://"], "a webhook URL with a host name"),
    (["no.such.module.Target"], "import path of an outbox target class"),
    (["http://a.example/x", "http://a.example/x"], "distinct targets"),
])
def test_bad_targets_are_refused_naming_the_setting(value: Any, rule: str) -> None:
    from scrapy.settings import Settings

    from scrapy_idempotent import ConfigError
    from scrapy_idempotent.config import IdempotentConfig

    spider: Any = type("S", (), {"name": "s"})
    with pytest.raises(ConfigError, match=f"IDEMPOTENT_OUTBOX_TARGETS=.*{rule}"):
        IdempotentConfig.from_settings(Settings({"IDEMPOTENT_OUTBOX_TARGETS": value,
                                                 "IDEMPOTENT_DATABASE": "/tmp/x"}), spider)


def test_targets_and_headers_from_the_command_line() -> None:
    from scrapy.settings import Settings

    from scrapy_idempotent.config import IdempotentConfig

    spider: Any = type("S", (), {"name": "s"})
    config = IdempotentConfig.from_settings(Settings({
        "IDEMPOTENT_OUTBOX_TARGETS": "http://a.example/x, https://b.example/y",
        "IDEMPOTENT_OUTBOX_HEADERS": '{"Authorization": "Bearer t"}',
        "IDEMPOTENT_DATABASE": "/tmp/x"}), spider)
    assert config.outbox_targets == ("http://a.example/x", "https://b.example/y")
    assert config.outbox_headers == (("Authorization", "Bearer t"),)


@deferred_f_from_coro_f
async def test_two_crawls_sharing_a_postgresql_database_each_announce_their_records(
        small_shop: LocalSite, hook: WebhookReceiver, request: pytest.FixtureRequest) -> None:
    """On PostgreSQL the deliverer finds its crawl's own schema among several."""
    pytest.importorskip("psycopg")
    postgres_url = request.getfixturevalue("postgres_url")
    for source in ("first", "second"):
        crawler = await run_crawl(ShopSpider, outbox_settings(
            postgres_url, hook.url, IDEMPOTENT_SOURCE=source), url=small_shop.url)
        stats = crawler.stats.get_stats()
        assert stats["idempotent/outbox/written"] == stats["idempotent/outbox/delivered"] == 50
    sources = Counter(d.body["source"] for d in hook.acknowledged())
    assert sources == {"first": 50, "second": 50}
    assert len(hook.keys_acknowledged()) == 100


@deferred_f_from_coro_f
async def test_credentials_in_a_webhook_url_are_sent_as_basic_auth_and_never_shown(
        small_shop: LocalSite, crawl_database: str, hook: WebhookReceiver,
        caplog: pytest.LogCaptureFixture) -> None:
    import base64

    from helpers.commands import idempotent_json

    host = hook.url.split("://", 1)[1]
    url = f"http://crawler:s%40cret@{host}"
    shown = f"http://crawler:***@{host}"
    caplog.set_level(logging.DEBUG)
    crawler = await run_crawl(ShopSpider, outbox_settings(crawl_database, url),
                              url=small_shop.url)
    assert crawler.stats.get_value("idempotent/outbox/delivered") == 50
    token = base64.b64encode(b"crawler:s@cret").decode()
    assert {d.headers.get("Authorization") for d in hook.acknowledged()} == {f"Basic {token}"}
    assert "s%40cret" not in caplog.text and "s@cret" not in caplog.text
    assert {e.target for e in outbox_rows(crawl_database)} == {shown}
    status = idempotent_json("status", "--db", crawl_database)
    assert status["outbox"] == {shown: {"pending": 0, "delivered": 50, "failed": 0}}
