"""Two workers on PostgreSQL with the Redis layer of the duplicate check
(``IDEMPOTENT_DEDUP_REDIS_URL``), SIGKILLed and restarted: every product is stored once, the
requests repeated stay within what was on the wire at each kill, and the Redis hash holds no
fingerprint the frontier lacks (a kill between a commit and its write to Redis only leaves the
hash short)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import kill_workers_at_random, start_shop_crawl
from helpers.postgresql import crawl_rows
from helpers.redis_dedup import frontier_holds_every_field
from redis_server import RedisServer, redis_server  # noqa: F401 (the fixture)

pytest.importorskip("psycopg")
pytest.importorskip("redis")

pytestmark = pytest.mark.slow


def test_two_workers_with_the_redis_layer_killed_store_each_product_once(
        tmp_path: Path, postgres_url: str, redis_server: RedisServer) -> None:  # noqa: F811
    rng = random.Random(43)
    concurrency = 4
    settings = (f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
                "IDEMPOTENT_RUN_MODE=resume", "TELNETCONSOLE_ENABLED=False",
                f"IDEMPOTENT_DEDUP_REDIS_URL={redis_server.url}")
    kills = 4
    launched = 0
    with LocalSite(delay=0.01) as site:

        def launch(slot: int) -> tuple[subprocess.Popen[bytes], Path]:
            nonlocal launched
            launched += 1
            log = tmp_path / f"worker{slot}-{launched}.log"
            return start_shop_crawl(site.url, postgres_url, log, *settings), log

        kill_workers_at_random(lambda: site.request_count, launch, 2, kills, rng, (20, 60))
        requests = site.request_count
        expected = site.expected_products()
        records = [json.loads(data) for (data,) in crawl_rows(postgres_url,
                                                              "SELECT data FROM records")]
        assert len(records) == len({r["sku"] for r in records}) == len(expected) == 500
        for record in records:
            want = expected[record["sku"]]
            assert (record["name"], record["price"]) == (want["name"], want["price"])
    print(f"\n[redis dedup workers] kills={kills}, worker processes={launched}, "
          f"requests={requests} (bound {525 + kills * concurrency})")
    assert 525 <= requests <= 525 + kills * concurrency, requests
    assert crawl_rows(postgres_url, "SELECT state, count(*) FROM requests GROUP BY state") == [
        ("done", 525)]
    # the run's hash: only fingerprints of the frontier, most of it
    assert frontier_holds_every_field(postgres_url, redis_server, 1) >= 500
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("*.log"))
    assert "duplicate links are checked in the Redis at" in logs
    assert "the Redis dedup cache at" not in logs  # no Redis error
