"""A commit announced to another system (a webhook or broker of the outbox, a queue
acknowledgement) survives power loss by default: with ``IDEMPOTENT_OUTBOX_TARGETS`` or
``IDEMPOTENT_QUEUE_URL`` set and ``IDEMPOTENT_SYNCHRONOUS`` not, the store commits with
``FULL`` (SQLite ``synchronous=FULL``; PostgreSQL turns a configured
``synchronous_commit = off`` into ``on``). Read once, by the config."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from local_site import LocalSite
from scrapy import signals
from scrapy.settings import Settings
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, crawl_to_end
from scrapy_idempotent.config import IdempotentConfig, store_options
from scrapy_idempotent.crawl import frontier_store
from shop.spiders.shop import ShopSpider

SPIDER: Any = type("S", (), {"name": "s"})
HOOK = "http://127.0.0.1:9/hook"


@pytest.mark.parametrize(("settings", "synchronous"), [
    ({}, "NORMAL"),
    ({"IDEMPOTENT_OUTBOX_TARGETS": [HOOK]}, "FULL"),
    ({"IDEMPOTENT_OUTBOX_TARGETS": HOOK}, "FULL"),  # from the command line
    ({"IDEMPOTENT_OUTBOX_TARGETS": []}, "NORMAL"),
    ({"IDEMPOTENT_QUEUE_URL": "redis://127.0.0.1:9/0"}, "FULL"),
    ({"IDEMPOTENT_OUTBOX_TARGETS": [HOOK], "IDEMPOTENT_SYNCHRONOUS": "NORMAL"}, "NORMAL"),
    ({"IDEMPOTENT_QUEUE_URL": "redis://127.0.0.1:9/0", "IDEMPOTENT_SYNCHRONOUS": "normal"},
     "NORMAL"),
    ({"IDEMPOTENT_SYNCHRONOUS": "FULL"}, "FULL"),
])
def test_full_unless_set_when_commits_are_announced(settings: dict[str, Any],
                                                    synchronous: str) -> None:
    given = Settings({"IDEMPOTENT_DATABASE": "/tmp/x.sqlite3", **settings})
    assert IdempotentConfig.from_settings(given, SPIDER).synchronous == synchronous
    assert store_options(given)["synchronous"] == synchronous


@deferred_f_from_coro_f
async def test_a_crawl_with_an_outbox_target_commits_with_full(crawl_database: str) -> None:
    seen: list[str] = []
    with LocalSite(listing_pages=1, products_per_page=2) as site:
        crawler = get_crawler(ShopSpider, crawl_settings(
            crawl_database, IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"},
            IDEMPOTENT_OUTBOX_TARGETS=[f"{site.url}/hook"]))

        def opened() -> None:
            store = frontier_store(crawler, "test")
            assert store is not None
            seen.append(store.synchronous)  # type: ignore[attr-defined]

        crawler.signals.connect(opened, signal=signals.spider_opened)
        await crawl_to_end(crawler, url=site.url)
    assert seen == ["FULL"]


@pytest.mark.parametrize(("synchronous", "expected"), [("FULL", "on"), ("NORMAL", "off")])
def test_postgresql_full_turns_synchronous_commit_off_on(
        request: pytest.FixtureRequest, synchronous: str, expected: str) -> None:
    pytest.importorskip("psycopg")
    from scrapy_idempotent.store import open_store

    url = request.getfixturevalue("postgres_url")
    url += ("&" if "?" in url else "?") + "options=" + quote("-csynchronous_commit=off")
    store = open_store(url, synchronous=synchronous)
    store.open(fingerprinter="x")
    try:
        (value,) = store.conn.execute("SHOW synchronous_commit").fetchone()  # type: ignore[attr-defined]
        assert value == expected
    finally:
        store.close()
