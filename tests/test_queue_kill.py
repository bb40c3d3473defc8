"""Queue-fed crawls in real worker processes, SIGKILLed: messages are acknowledged only
once their page is committed, delivered again after a kill, and a repeated delivery is
harmless (one frontier entry, one record)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite

from crawling import EXAMPLE_PROJECT, close_reason, wait_for
from helpers.stored import frontier_counts, frontier_entries, request_states, stored_products
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow

GROUP = "scrapy_idempotent"
SPIDER_FILE = Path(__file__).resolve().parent / "queue_spiders.py"


def start_worker(server: RedisServer, key: str, db: str, log: Path, *settings: str) -> Any:
    """``scrapy runspider`` of the queue spider in the example project (its settings: the
    add-on, the natural keys), fed from ``key``."""
    command = [sys.executable, "-m", "scrapy", "runspider", str(SPIDER_FILE),
               "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={log}",
               "-s", f"IDEMPOTENT_QUEUE_URL={server.url}", "-s", f"IDEMPOTENT_QUEUE_KEY={key}",
               "-s", "IDEMPOTENT_QUEUE_POLL_SECONDS=0.05", "-s", "LOG_LEVEL=INFO"]
    for setting in settings:
        command += ["-s", setting]
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def kill(process: Any) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def message_url(fields: dict[str, str]) -> str | None:
    if "url" in fields:
        return fields["url"]
    if "request" in fields:
        return str(json.loads(fields["request"])["url"])
    return None


def pending_ids(client: Any, key: str) -> set[str]:
    return {p["message_id"] for p in client.xpending_range(key, GROUP, "-", "+", 100000)}


def delivered_ids(client: Any, key: str) -> set[str]:
    """Ids of the entries the group has delivered (up to its last-delivered id)."""
    groups = client.xinfo_groups(key)
    if not groups:
        return set()
    last = groups[0]["last-delivered-id"]
    return {entry_id for entry_id, _ in client.xrange(key, "-", last)}


def acked_without_final_state(client: Any, key: str, db: str) -> list[str]:
    """Messages acknowledged whose page is not committed in a final state (must be none)."""
    acked = delivered_ids(client, key) - pending_ids(client, key)
    wrong = []
    states = request_states(db)
    for entry_id, fields in client.xrange(key):
        url = message_url(fields)
        if entry_id in acked and url is not None and states.get(url) not in ("done", "failed"):
            wrong.append(f"{entry_id} {url}: {states.get(url)}")
    return wrong


def pending_with_final_state(client: Any, key: str, db: str) -> int:
    """Messages still pending whose page is committed (a kill between the commit and the
    XACK, or a message read just before the kill: delivered again, then acknowledged)."""
    pending = pending_ids(client, key)
    states = request_states(db)
    return sum(1 for entry_id, fields in client.xrange(key) if entry_id in pending
               and states.get(message_url(fields) or "") in ("done", "failed"))


def all_acknowledged(client: Any, key: str) -> bool:
    (group,) = client.xinfo_groups(key)
    return bool(group["pending"] == 0
                and group["last-delivered-id"] == client.xinfo_stream(key)["last-generated-id"])


def product_message(shop: LocalSite, number: int) -> dict[str, str]:
    return {"request": json.dumps({"url": f"{shop.url}/product/SKU-{number:05d}",
                                   "callback": "parse_product"})}


def test_same_url_three_times_worker_killed_during_the_second_delivery(
    redis_server: RedisServer, tmp_path: Path, crawl_database: str  # noqa: F811
) -> None:
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    db = crawl_database
    # the page answers after 60 s while the first worker lives: it is killed in the middle
    with LocalSite(delay=60) as shop:
        message = product_message(shop, 1)
        first = client.xadd(key, message)
        worker = start_worker(redis_server, key, db, tmp_path / "run1.log")
        try:
            wait_for(lambda: shop.in_flight >= 1, 120, "the page requested")
            second = client.xadd(key, message)
            wait_for(lambda: pending_ids(client, key) == {first, second}, 120,
                     "the second delivery read by the worker")
            assert acked_without_final_state(client, key, db) == []
        finally:
            kill(worker)
        assert frontier_counts(db) == {"leased": 1}  # in flight, nothing committed
        shop.delay = 0  # the next fetch of the page answers at once
        third = client.xadd(key, message)
        client.xadd(key, {"stop": "1"})
        worker = start_worker(redis_server, key, db, tmp_path / "run2.log")
        assert worker.wait(timeout=240) == 0
        assert close_reason(tmp_path / "run2.log") == "finished"
        assert shop.counts_by_path() == {"/product/SKU-00001": 2}  # once per worker
    assert [entry.state for entry in frontier_entries(db)] == ["done"]
    assert [p["sku"] for p in stored_products(db)] == ["SKU-00001"]
    assert all_acknowledged(client, key)
    assert client.xpending(key, GROUP)["pending"] == 0
    assert {first, second, third} <= delivered_ids(client, key)
    log = (tmp_path / "run2.log").read_text()
    assert "is gone: its pending messages are delivered again here" in log


def test_queue_fed_crawl_killed_ten_times(
    redis_server: RedisServer, tmp_path: Path, crawl_database: str  # noqa: F811
) -> None:
    """25 listings and 500 products pushed (the listings also link the products, so most
    product messages meet a known request); the worker is SIGKILLed 10 times after a random
    number of pages, then runs to the end. After every kill, no message is acknowledged whose
    page is not committed."""
    key = f"q-{uuid.uuid4().hex}"
    client = redis_server.client()
    db = crawl_database
    rng = random.Random(7)
    concurrency = 4
    kills = 10
    settings = (f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
                "IDEMPOTENT_QUEUE_IDLE_TIMEOUT_SECONDS=1")
    with LocalSite(delay=0.01) as shop:
        messages = [{"url": f"{shop.url}/list/{n}"} for n in range(1, 26)] + [
            product_message(shop, n) for n in range(1, 501)]
        rng.shuffle(messages)
        for fields in messages:
            client.xadd(key, fields)
        problems: list[str] = []
        late = 0
        for run in range(kills):
            before = shop.request_count
            pages = rng.randint(5, 60)
            worker = start_worker(redis_server, key, db, tmp_path / f"run{run}.log", *settings)
            try:
                wait_for(lambda b=before, n=pages: shop.request_count - b >= n, 240,
                         f"{pages} pages in run {run}")
            finally:
                kill(worker)
            problems += acked_without_final_state(client, key, db)
            late += pending_with_final_state(client, key, db)
        worker = start_worker(redis_server, key, db, tmp_path / "final.log", *settings)
        assert worker.wait(timeout=600) == 0
        assert close_reason(tmp_path / "final.log") == "finished"
        requests = shop.request_count
        expected = shop.expected_products()
    assert problems == []
    rows = stored_products(db)
    assert len(rows) == 500
    assert all((r["sku"], r["name"], r["price"]) == tuple(expected[r["sku"]][f] for f in (
        "sku", "name", "price")) for r in rows)
    assert frontier_counts(db) == {"done": 525}
    assert all_acknowledged(client, key)
    assert requests <= 525 + kills * concurrency, requests
    print(f"queue kill test: {kills} kills, {requests} requests (bound "
          f"{525 + kills * concurrency}), {len(rows)} records; at the kills, {late} messages "
          "pending whose page was committed (acknowledged on their next delivery)")
