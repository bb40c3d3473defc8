"""Real crawls of the local test shop on the PostgreSQL store (``IDEMPOTENT_DATABASE`` a
``postgresql://`` URL): the same results as on SQLite, crawls sharing one database."""

from __future__ import annotations

from typing import Any

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, run_crawl
from shop.spiders.shop import ShopSpider

psycopg = pytest.importorskip("psycopg")

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def crawl_schemas(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [name for (name,) in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%' ORDER BY 1")]


def pg_rows(url: str, schema: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def assert_keys_are_bytes(url: str, schema: str) -> None:
    """Every request key of the crawl stored as its 20 bytes (Scrapy's fingerprint: schema
    22 stores a key's bytes, not its hex digits, nor those digits read as escape-format
    bytea: 40 bytes), each parent's key and fingerprint too, where stored; every request but
    the start page has its parent, a request of the frontier."""
    assert pg_rows(url, schema,
                   "SELECT count(*), count(DISTINCT key), count(parent_key),"
                   " count(*) FILTER (WHERE octet_length(key) = 20),"
                   " count(*) FILTER (WHERE octet_length(parent_key) = 20),"
                   " count(*) FILTER (WHERE fingerprint IS NOT NULL"
                   "  AND octet_length(fingerprint) <> 20),"
                   " count(*) FILTER (WHERE parent_key IS NOT NULL AND NOT EXISTS"
                   "  (SELECT 1 FROM requests p WHERE p.key = requests.parent_key))"
                   " FROM requests") == [(525, 525, 524, 525, 524, 0, 0)]


def assert_catalogue(url: str, schema: str, site: LocalSite) -> None:
    import json

    expected = site.expected_products()
    rows = [json.loads(data) for (data,) in pg_rows(url, schema, "SELECT data FROM records")]
    assert len(rows) == len(expected) == 500
    for row in rows:
        want = expected[row["sku"]]
        assert (row["sku"], row["name"], row["price"]) == (want["sku"], want["name"],
                                                            want["price"])


@deferred_f_from_coro_f
async def test_full_crawl_on_postgresql_stores_each_product_once(
        shop: LocalSite, postgres_url: str, real_key_codec: None) -> None:
    settings = crawl_settings(postgres_url, **NATURAL_KEYS)  # type: ignore[arg-type]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert shop.request_count == 525
    assert stats["idempotent/records/inserted"] == 500
    assert stats["idempotent/requests/done"] == stats["idempotent/requests/leased"] == 525
    [schema] = crawl_schemas(postgres_url)
    assert_catalogue(postgres_url, schema, shop)
    assert pg_rows(postgres_url, schema,
                   "SELECT state, count(*) FROM requests GROUP BY state") == [("done", 525)]
    assert_keys_are_bytes(postgres_url, schema)
    assert pg_rows(postgres_url, schema, "SELECT finished_at IS NOT NULL, reason FROM runs"
                   ) == [(True, "finished")]

    # the next crawl is a new run over the same records: nothing inserted, nothing changed
    shop.reset_counts()
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/unchanged"] == 500
    assert "idempotent/records/inserted" not in stats
    assert "idempotent/records/conflicts" not in stats
    assert_catalogue(postgres_url, schema, shop)
    assert pg_rows(postgres_url, schema, "SELECT count(*) FROM runs") == [(2,)]


@deferred_f_from_coro_f
async def test_crawls_of_other_sources_share_one_database_without_seeing_each_other(
        shop: LocalSite, postgres_url: str) -> None:
    for source in ("shop-eu", "shop-us"):
        settings = crawl_settings(postgres_url,  # type: ignore[arg-type]
                                  IDEMPOTENT_SOURCE=source, **NATURAL_KEYS)
        crawler = await run_crawl(ShopSpider, settings, url=shop.url)
        stats = crawler.stats.get_stats()
        assert stats["finish_reason"] == "finished"
        # each crawl fetched the whole shop: the other's frontier is not its own
        assert stats["idempotent/requests/done"] == 525
        assert stats["idempotent/records/inserted"] == 500
    schemas = crawl_schemas(postgres_url)
    assert len(schemas) == 2
    sources = []
    for schema in schemas:
        [(source,)] = pg_rows(postgres_url, schema, "SELECT value FROM meta WHERE key = 'source'")
        assert pg_rows(postgres_url, schema, "SELECT DISTINCT source FROM records") == [
            (source,)]
        assert_catalogue(postgres_url, schema, shop)
        sources.append(source)
    assert sorted(sources) == ["shop-eu", "shop-us"]


@deferred_f_from_coro_f
async def test_a_second_worker_waits_for_the_first_and_wakes_when_work_appears(
        shop: LocalSite, postgres_url: str, real_key_codec: None) -> None:
    """Two workers (crawls in this process, one frontier). The first holds the first listing
    page (the shop holds its answer back) while the second starts: it has nothing to claim
    and waits; once the page's links are committed, the first's notification wakes it. Both
    finish, every page fetched once, each worker fetching some: the shop's one site is
    spread over both (the crawl's limits, the default)."""
    import asyncio

    from scrapy.utils.test import get_crawler

    from crawling import crawl_to_end
    from scrapy_idempotent import scrapy_compat
    from shop.site import listing_html

    # the first listing page is answered once the site is released
    shop.add("/list/1", listing_html(1, shop.listing_pages, shop.products_per_page), held=True)
    settings = crawl_settings(postgres_url,  # type: ignore[arg-type]
                              IDEMPOTENT_RUN_MODE="resume", **NATURAL_KEYS)
    first, second = get_crawler(ShopSpider, settings), get_crawler(ShopSpider, settings)
    first_done = asyncio.ensure_future(crawl_to_end(first, url=shop.url))
    await wait_until(lambda: shop.counts_by_path().get("/list/1") == 1)
    second_done = asyncio.ensure_future(crawl_to_end(second, url=shop.url))

    def idle() -> bool:  # the second worker asked the store for work and found none
        try:
            scheduler = scrapy_compat.engine_scheduler(second)
        except RuntimeError:  # Crawler.engine before the crawl starts (Scrapy 2.19)
            return False
        return scheduler is not None and not scheduler.claimed.maybe_claimable

    await wait_until(idle)
    shop.release()
    await first_done
    await second_done
    for crawler in (first, second):
        assert crawler.stats.get_value("finish_reason") == "finished"
    assert second.stats.get_value("idempotent/wakeups", 0) >= 1
    done = [c.stats.get_value("idempotent/requests/done", 0) for c in (first, second)]
    assert all(done) and sum(done) + sum(c.stats.get_value("idempotent/requests/redirected", 0)
                                         for c in (first, second)) == 525
    # every listing page links the first one: a duplicate across commits and workers
    assert shop.request_count == 525
    [schema] = crawl_schemas(postgres_url)
    assert_catalogue(postgres_url, schema, shop)
    assert_keys_are_bytes(postgres_url, schema)


async def wait_until(condition: Any) -> None:
    """Let the reactor run until ``condition()`` holds (a state, never a duration)."""
    from scrapy.utils.defer import maybe_deferred_to_future
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    for _ in range(30000):
        if condition():
            return
        await maybe_deferred_to_future(deferLater(reactor, 0.01, lambda: None))
    raise AssertionError("timed out")


@deferred_f_from_coro_f
async def test_feeds_on_postgresql_are_the_runs_records_once(
        shop: LocalSite, postgres_url: str, tmp_path: Any) -> None:
    """A graceful stop leaves a snapshot; the resumed run replaces it and appends once (the
    feed is written from the run's records, read page by page from PostgreSQL)."""
    import json

    appended, replaced = tmp_path / "appended.jsonl", tmp_path / "replaced.json"
    appended.write_text('{"before": "the run"}\n')
    feeds = {str(appended): {"format": "jsonlines"},
             str(replaced): {"format": "json", "overwrite": True}}
    settings = crawl_settings(postgres_url, FEEDS=feeds,  # type: ignore[arg-type]
                              CLOSESPIDER_ITEMCOUNT=50, **NATURAL_KEYS)
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "closespider_itemcount"
    snapshot = json.loads(replaced.read_text())
    assert 50 <= len(snapshot) < 500
    del settings["CLOSESPIDER_ITEMCOUNT"]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    everything = json.loads(replaced.read_text())
    assert sorted(r["sku"] for r in everything) == sorted(shop.expected_products())
    lines = [json.loads(line) for line in appended.read_text().splitlines()]
    assert lines[0] == {"before": "the run"}
    assert sorted(r["sku"] for r in lines[1:]) == sorted(shop.expected_products())
