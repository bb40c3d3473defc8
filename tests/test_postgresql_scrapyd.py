"""Two scrapyd instances (two ports, one PostgreSQL database) each run the shop spider on
one crawl; one job is SIGKILLed mid-crawl: the other finishes the crawl, every product once."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest
from local_site import LocalSite

from helpers.scrapyd import Scrapyd, build_egg, stat, wait_until

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.slow

CONCURRENCY = 4


@pytest.fixture
def two_scrapyds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Scrapyd]]:
    egg = build_egg(tmp_path_factory.mktemp("egg"))
    servers = [Scrapyd(tmp_path_factory.mktemp(f"scrapyd{n}")) for n in (1, 2)]
    try:
        for server in servers:
            server.start()
            assert server.add_version(egg)["spiders"] == 1
        yield servers
    finally:
        for server in servers:
            server.stop()


def crawl_rows(url: str, sql: str) -> list[tuple[object, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        [schema] = [name for (name,) in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%'")]
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def test_two_scrapyds_on_one_crawl_one_killed_the_other_finishes(
        two_scrapyds: list[Scrapyd], postgres_url: str) -> None:
    settings = {"IDEMPOTENT_DATABASE": postgres_url, "CONCURRENT_REQUESTS": CONCURRENCY,
                "IDEMPOTENT_RUN_MODE": "resume"}
    first, second = two_scrapyds
    with LocalSite(delay=0.02) as site:
        doomed = first.schedule(settings, url=site.url)
        survivor = second.schedule(settings, url=site.url)
        pid = first.wait_running(doomed)
        second.wait_running(survivor)
        wait_until(lambda: site.request_count >= 150, 120, "150 requests")
        os.kill(pid, signal.SIGKILL)
        first.wait_finished(doomed)
        at_kill = site.request_count
        second.wait_finished(survivor, timeout=300)
        requests = site.request_count
        expected = site.expected_products()
    log = second.log(survivor)
    assert stat(log, "finish_reason") == "finished", log[-3000:]
    assert at_kill < 525
    records = [json.loads(data) for (data,) in crawl_rows(postgres_url,
                                                           "SELECT data FROM records")]
    assert len(records) == len({r["sku"] for r in records}) == 500
    assert all((r["name"], r["price"]) == (expected[r["sku"]]["name"],
                                           expected[r["sku"]]["price"]) for r in records)
    # the killed job's requests on the wire may be fetched again, nothing more
    assert 525 <= requests <= 525 + CONCURRENCY, requests
    assert crawl_rows(postgres_url, "SELECT state, count(*) FROM requests GROUP BY state") == [
        ("done", 525)]
    print(f"\n[two scrapyds] requests at kill={at_kill}, requests={requests}, "
          f"reclaimed={stat(log, 'idempotent/requests/reclaimed')}")
