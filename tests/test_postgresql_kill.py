"""Several workers on PostgreSQL, each on a host of its own, crawling one frontier while they
are killed and restarted, with real ``scrapy crawl shop`` processes of the example project
(one worker killed and resumed: test_kill.py, on every store)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite

from crawling import EXAMPLE_PROJECT, kill_workers_at_random

psycopg = pytest.importorskip("psycopg")

pytestmark = pytest.mark.slow


def crawl_command(site: LocalSite, url: str, log: Path, *settings: str) -> list[str]:
    command = [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site.url}",
               "-s", f"IDEMPOTENT_DATABASE={url}", "-s", f"LOG_FILE={log}",
               "-s", "TELNETCONSOLE_ENABLED=False"]
    for setting in settings:
        command += ["-s", setting]
    return command


def start(command: list[str], host: str | None = None) -> subprocess.Popen[bytes]:
    """A worker process; with ``host``, in a UTS namespace of its own whose host name is
    ``host`` (another machine, as far as the worker ids and liveness checks can tell)."""
    if host is not None:
        command = ["unshare", "--uts", "sh", "-c", f'hostname "{host}" && exec "$0" "$@"',
                   *command]
    return subprocess.Popen(command, cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def crawl_rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` in the shop crawl's schema (the only one in the database); none while
    the schema does not exist yet."""
    with psycopg.connect(url, autocommit=True) as conn:
        schemas = [name for (name,) in conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idempotent%'")]
        if not schemas or conn.execute(
                "SELECT to_regclass(%s)", (f'"{schemas[0]}".sessions',)).fetchone() == (None,):
            return []
        conn.execute("SELECT set_config('search_path', %s, false)", (schemas[0],))
        return [tuple(row) for row in conn.execute(sql).fetchall()]


def assert_all_products_once(url: str, site: LocalSite) -> None:
    expected = site.expected_products()
    records = [json.loads(data) for (data,) in crawl_rows(url, "SELECT data FROM records")]
    assert len(records) == len({r["sku"] for r in records}) == len(expected) == 500
    for record in records:
        want = expected[record["sku"]]
        assert (record["name"], record["price"]) == (want["name"], want["price"])


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_three_workers_on_three_hosts_killed_and_restarted_store_each_product_once(
        tmp_path: Path, postgres_url: str) -> None:
    """3 worker processes, each in a UTS namespace with a host name of its own, crawl one
    frontier; a random worker is SIGKILLed at random moments (by requests served) and
    restarted under a new host name, so its dead predecessor's leases come back only through
    the heartbeat (no process check can see it). At the end every worker finishes."""
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, check=False)
    if probe.returncode:
        pytest.skip(f"cannot make UTS namespaces here: {probe.stderr.decode().strip()}")
    rng = random.Random(11)
    concurrency = 4
    # a short lease: the liveness bound is min(15 s, lease / 2) = 3 s
    settings = (f"CONCURRENT_REQUESTS={concurrency}",
                f"CONCURRENT_REQUESTS_PER_DOMAIN={concurrency}",
                "IDEMPOTENT_LEASE_SECONDS=6", "IDEMPOTENT_RUN_MODE=resume")
    kills = 5
    hosts = 0
    with LocalSite(delay=0.02) as site:

        def launch(slot: int) -> tuple[subprocess.Popen[bytes], Path]:
            nonlocal hosts
            hosts += 1
            log = tmp_path / f"worker{slot}-host{hosts}.log"
            return start(crawl_command(site, postgres_url, log, *settings),
                         host=f"crawler-{hosts}"), log

        kill_workers_at_random(lambda: site.request_count, launch, 3, kills, rng, (20, 80))
        requests = site.request_count
        assert_all_products_once(postgres_url, site)
    print(f"\n[postgresql workers] kills={kills}, worker processes={hosts}, "
          f"requests={requests} (bound {525 + kills * concurrency})")
    # each kill repeats at most what that worker had on the wire
    assert 525 <= requests <= 525 + kills * concurrency, requests
    assert crawl_rows(postgres_url, "SELECT state, count(*) FROM requests GROUP BY state") == [
        ("done", 525)]
    sessions = [worker for (worker,) in crawl_rows(postgres_url, "SELECT worker FROM sessions")]
    # a worker killed before it opened the database has no session
    hosts_seen = {worker.split(":")[0] for worker in sessions}
    assert len(hosts_seen) == len(sessions) >= 3  # every worker on a host of its own
