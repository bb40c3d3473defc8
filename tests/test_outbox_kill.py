"""Acceptance of the outbox and of files named by identity with real SIGKILLs.

* The example project's ``scrapy crawl shop`` announcing its records to a real local webhook
  receiver, killed 10 times at moments given by its progress (the receiver answering 503 for
  three of those crawls), then run to its end: every stored record is announced, no key names
  a record that is not stored, and the receiver, deduplicating by key, ends with exactly 500
  inserted announcements. Deliveries per record (the duplicate rate) are printed.
* The shop with product images (``ImagesPipeline``, tests/image_shop.py) killed 10 times: one
  image file per product on disk, each referenced by its record, no orphan.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite

from crawling import close_reason, start_shop_crawl, wait_for
from helpers.stored import outbox_states, requests_done, stored_records
from helpers.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.slow

KILLS = 10
HERE = Path(__file__).resolve().parent


def kill_ten_times(start: Callable[[int], subprocess.Popen[bytes]], db: str, seed: int,
                   before_run: Callable[[int], None] = lambda run: None) -> int:
    """Start a crawl and SIGKILL it once it has completed between 10 and 40 more pages than
    the one before, ``KILLS`` times (fewer if a crawl finishes first). Returns the kills."""
    rng = random.Random(seed)
    kills = 0
    for run in range(KILLS):
        before_run(run)
        target = requests_done(db) + rng.randint(10, 40)
        process = start(run)
        wait_for(lambda: requests_done(db) >= target or process.poll() is not None,  # noqa: B023
                 600, f"crawl {run} to pass {target} pages")
        if process.poll() is not None:
            break  # finished on its own
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills += 1
    return kills


def test_ten_sigkills_every_stored_record_is_announced_and_nothing_else(
        tmp_path: Path, crawl_database: str):
    db = crawl_database
    with LocalSite(delay=0.01) as shop, WebhookReceiver() as hook:
        settings = [f"IDEMPOTENT_OUTBOX_TARGETS={hook.url}",
                    "IDEMPOTENT_OUTBOX_TIMEOUT_SECONDS=5",
                    "IDEMPOTENT_OUTBOX_RETRY_SECONDS=0.2",
                    "IDEMPOTENT_OUTBOX_RETRY_MAX_SECONDS=2",
                    "IDEMPOTENT_OUTBOX_DRAIN_SECONDS=120"]

        def receiver_down_for_runs_3_to_5(run: int) -> None:
            hook.down = 3 <= run <= 5

        kills = kill_ten_times(
            lambda run: start_shop_crawl(shop.url, db, tmp_path / f"run{run}.log", *settings),
            db, seed=16, before_run=receiver_down_for_runs_3_to_5)
        hook.down = False
        final = start_shop_crawl(shop.url, db, tmp_path / "final.log", *settings)
        assert final.wait(timeout=900) == 0
        assert close_reason(tmp_path / "final.log") == "finished"

    stored = {f"{record.record_id}:{record.version}:{record.content_hash}"
              for record in stored_records(db)}
    assert len(stored) == 500
    acknowledged = hook.keys_acknowledged()
    every_key = Counter(d.key for d in hook.deliveries)
    refused_while_down = sum(1 for d in hook.deliveries if d.status == 503)
    # every record of the run announced (and acknowledged)
    assert set(acknowledged) == stored
    # no key for a record that is not stored (nor any other key)
    assert set(every_key) <= stored
    # the receiver, deduplicating by key, ends with exactly 500 inserted announcements
    first_by_key = {}
    for delivery in hook.acknowledged():
        first_by_key.setdefault(delivery.key, delivery.body)
    assert Counter(body["kind"] for body in first_by_key.values()) == {"inserted": 500}
    assert all(body["idempotency_key"] == key for key, body in first_by_key.items())
    assert outbox_states(db) == {"delivered": 500}
    assert kills == KILLS
    assert refused_while_down > 0
    per_record = Counter(acknowledged.values())
    report = {"kills": kills, "records": len(stored),
              "acknowledged_deliveries": sum(acknowledged.values()),
              "deliveries_per_record": round(sum(acknowledged.values()) / len(stored), 4),
              "records_delivered_n_times": dict(sorted(per_record.items())),
              "answered_503": refused_while_down, "posts": len(hook.deliveries)}
    print(f"\noutbox kill test: {json.dumps(report)}")


def test_ten_sigkills_leave_one_image_per_product_and_no_orphan(
        tmp_path: Path, crawl_database: str):
    from image_shop import image_downloads, serve_product_images

    pytest.importorskip("PIL", reason="ImagesPipeline needs Pillow (pip install pillow)")
    db, store = crawl_database, tmp_path / "images"

    def crawl(log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            return subprocess.Popen(
                [sys.executable, str(HERE / "image_shop.py"), "--url", shop.url,
                 "--db", db, "--store", str(store)],
                stdout=out, stderr=subprocess.STDOUT)

    with LocalSite(delay=0.01) as shop:
        serve_product_images(shop)
        kills = kill_ten_times(lambda run: crawl(tmp_path / f"run{run}.log"), db, seed=17)
        final = crawl(tmp_path / "final.log")
        assert final.wait(timeout=900) == 0
        assert close_reason(tmp_path / "final.log") == "finished"
        downloads = image_downloads(shop)

    assert kills == KILLS
    paths: dict[str, str] = {}
    for record in stored_records(db):
        [image] = json.loads(record.data)["images"]
        assert image["path"].startswith(f"full/{record.record_id}/")
        paths[record.record_id] = image["path"]
    assert len(paths) == 500
    on_disk = sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())
    # exactly one file per product, each referenced by its record: nothing else
    assert on_disk == sorted(paths.values())
    check = subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "check", "--db", db, "--json",
         "-s", f"IMAGES_STORE={store}"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120)
    [files] = [c for c in json.loads(check.stdout)["checks"] if c["check"] == "files"]
    assert (files["ok"], files["orphans"]) == (True, [])
    report: dict[str, Any] = {"kills": kills, "files": len(on_disk),
                              "image_downloads": downloads}
    print(f"\nimages kill test: {json.dumps(report)}")
