"""Record identity that cannot collide or fork in silence: the record type in the record ID,
the natural keys recorded in the database (a crawl keyed otherwise is refused before its first
request), ``scrapy idempotent rekey`` moving the records, and databases of record ID scheme 1
(made by the release before it, ``tests/data``) re-identified at open. Real crawls of the
local shop, on every store backend."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from local_site import LocalSite
from record_types_spider import NATURAL_KEYS, OfferItem, OffersSpider, ProductItem
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, kill_crawls, package_messages, run_crawl
from helpers.stored import outbox_rows, reading, stored_records
from scrapy_idempotent import OutboxTarget
from scrapy_idempotent.records import RECORD_ID_SCHEME, RecordIdentity, record_id_of
from scrapy_idempotent.rekey import FileStores, apply_rekey, plan_rekey

PRODUCT = f"{ProductItem.__module__}.ProductItem"
OFFER = f"{OfferItem.__module__}.OfferItem"
#: A database the release before record ID scheme 2 made: the crawl of OffersSpider over a
#: shop of 60 products (3 listing pages of 20), both item types keyed by ``sku``, so each
#: product's two items shared one record (60 records, each an OfferItem: the last written).
#: Made by that release's own code (``scrapy runspider tests/record_types_spider.py`` with
#: ``IDEMPOTENT_NATURAL_KEYS`` as :data:`NATURAL_KEYS`), then VACUUMed.
SCHEME_1_DATABASE = Path(__file__).parent / "data" / "scheme1-offers.sqlite3"


class CountingTarget(OutboxTarget):
    """Acknowledges every announcement, counted in ``RECEIVED``."""

    RECEIVED: ClassVar[list[str]] = []

    async def deliver(self, announcement: Any) -> str:
        self.RECEIVED.append(announcement.payload["idempotency_key"])
        return "ok"


@pytest.fixture
def offers_site() -> Any:
    with LocalSite(listing_pages=3, products_per_page=20) as site:
        yield site


def settings(database: str, **extra: Any) -> dict[str, Any]:
    return crawl_settings(database, IDEMPOTENT_NATURAL_KEYS=NATURAL_KEYS, **extra)


def by_type(database: str) -> dict[str, list[str]]:
    """The SKUs stored per item type."""
    found: dict[str, list[str]] = {}
    for record in stored_records(database):
        found.setdefault(record.item_type, []).append(json.loads(record.data)["sku"])
    return {item_type: sorted(skus) for item_type, skus in found.items()}


def stats_of(crawler: Any) -> dict[str, Any]:
    stats: dict[str, Any] = crawler.stats.get_stats()
    return stats


# -- two item types with one key value -----------------------------------------------------


@deferred_f_from_coro_f
async def test_two_item_types_keyed_by_one_field_are_two_records_each(
        offers_site: LocalSite, crawl_database: str) -> None:
    """A product and its offer with one SKU: 120 records for 60 products, and a rerun of
    the unchanged site updates nothing and announces nothing."""
    CountingTarget.RECEIVED.clear()
    extra = {"IDEMPOTENT_OUTBOX_TARGETS": [f"{__name__}.CountingTarget"]}
    first = await run_crawl(OffersSpider, settings(crawl_database, **extra),
                            url=offers_site.url)
    assert stats_of(first)["idempotent/records/inserted"] == 120
    stored = by_type(crawl_database)
    assert set(stored) == {PRODUCT, OFFER}
    assert stored[PRODUCT] == stored[OFFER] and len(set(stored[PRODUCT])) == 60
    announced = len(outbox_rows(crawl_database))
    assert announced == 120 and len(CountingTarget.RECEIVED) == 120
    second = await run_crawl(OffersSpider, settings(crawl_database, **extra),
                             url=offers_site.url)
    stats = stats_of(second)
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/unchanged"] == 120
    assert "idempotent/records/updated" not in stats
    assert "idempotent/records/inserted" not in stats
    assert len(outbox_rows(crawl_database)) == announced  # nothing announced by the rerun
    assert len(CountingTarget.RECEIVED) == 120
    assert all(record.version == 1 for record in stored_records(crawl_database))
    with reading(crawl_database) as store:
        keys = {(k.record_type, k.item_type, k.fields) for k in store.record_keys()}
    assert keys == {(PRODUCT, PRODUCT, ("sku",)), (OFFER, OFFER, ("sku",))}


# -- a changed natural key is refused, then moved by rekey ----------------------------------


@deferred_f_from_coro_f
async def test_a_changed_key_is_refused_before_the_first_request_until_rekey_moves_it(
        offers_site: LocalSite, crawl_database: str, tmp_path: Path) -> None:
    """Run 1 keys by the page URL (the natural key setting misspelt, say: none configured);
    run 2 with the key fixed is refused at open, nothing fetched or written; ``rekey``
    moves the records; run 3 finds every one of them (nothing inserted)."""
    unkeyed = crawl_settings(crawl_database)
    first = await run_crawl(OffersSpider, unkeyed, url=offers_site.url)
    assert stats_of(first)["idempotent/records/inserted"] == 120  # [url] and [url, type, #1]
    before = {r.record_id: r for r in stored_records(crawl_database)}
    requests_before = offers_site.request_count

    refused = await run_crawl(OffersSpider, settings(crawl_database), url=offers_site.url)
    stats = stats_of(refused)
    assert stats["finish_reason"] == "idempotent_store_error"
    error = stats["idempotent/error"]
    assert f"the records of {PRODUCT} are keyed by the page URL, the settings now key it by " \
           "sku: run `scrapy idempotent rekey`" in error
    assert offers_site.request_count == requests_before  # not one request
    assert {r.record_id: r for r in stored_records(crawl_database)} == before

    result = rekey_command(crawl_database, tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "120 records read; 120 would be given a new record ID" in result.stdout
    assert {r.record_id for r in stored_records(crawl_database)} == set(before)
    result = rekey_command(crawl_database, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    after = stored_records(crawl_database)
    assert len(after) == 120
    identity = RecordIdentity(source="offers", natural_keys={})
    for record in after:
        sku = json.loads(record.data)["sku"]
        assert record.natural_key == json.dumps([sku])
        assert record.record_id == identity.record_id([sku], record.item_type)
    assert sorted(r.first_seen for r in after) == sorted(r.first_seen for r in before.values())

    feed = tmp_path / "records.jsonl"
    third = await run_crawl(OffersSpider, settings(
        crawl_database, FEEDS={str(feed): {"format": "jsonlines", "overwrite": True}}),
        url=offers_site.url)
    stats = stats_of(third)
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/unchanged"] == 120
    assert "idempotent/records/inserted" not in stats
    assert "idempotent/records/updated" not in stats
    # the run's feed: every record once, under its new record ID
    entries = [json.loads(line) for line in feed.read_text().splitlines()]
    assert sorted(entry["record_id"] for entry in entries) == sorted(r.record_id for r in after)


def rekey_command(database: str, tmp_path: Path, *args: str,
                  natural_keys: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    keys = json.dumps(NATURAL_KEYS if natural_keys is None else natural_keys)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "rekey", "--db", database,
         "-s", f"IDEMPOTENT_NATURAL_KEYS={keys}", *args],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


# -- a database of record ID scheme 1 --------------------------------------------------------


@deferred_f_from_coro_f
async def test_a_scheme_1_database_is_re_identified_at_open_and_crawls_on(
        offers_site: LocalSite, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The release before stored each product and its offer as one record (an OfferItem):
    the next crawl re-identifies the 60 records (as OfferItems), stores the 60 products it
    had lost, and finds every offer unchanged; no record twice."""
    database = str(tmp_path / "old.sqlite3")
    shutil.copy(SCHEME_1_DATABASE, database)
    with reading(database) as store:
        assert store.meta()["record_id_scheme"] == "1"
        old = {r.record_id: r for r in store.records_page(limit=1000)}
    assert len(old) == 60 and {r.item_type for r in old.values()} == {OFFER}
    caplog.set_level(logging.INFO, logger="scrapy_idempotent")
    crawler = await run_crawl(OffersSpider, settings(database, LOG_LEVEL="INFO"),
                              url=offers_site.url)
    stats = stats_of(crawler)
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/records/inserted"] == 60  # the products
    assert stats["idempotent/records/unchanged"] == 60  # the offers, found under new IDs
    assert "idempotent/records/updated" not in stats
    stored = by_type(database)
    assert stored[PRODUCT] == stored[OFFER] and len(set(stored[OFFER])) == 60
    records = stored_records(database)
    assert len(records) == len({r.record_id for r in records}) == 120
    with reading(database) as store:
        assert store.meta()["record_id_scheme"] == RECORD_ID_SCHEME
    offers = {json.loads(r.data)["sku"]: r for r in records if r.item_type == OFFER}
    for record in old.values():  # each kept its history under its new ID
        moved = offers[json.loads(record.data)["sku"]]
        assert moved.record_id == record_id_of("offers", OFFER,
                                               json.loads(record.natural_key))
        assert (moved.first_seen, moved.content_hash) == (record.first_seen,
                                                          record.content_hash)
    assert any(message.startswith("scrapy_idempotent: re-identified 60 records of ")
               for message in package_messages(caplog, logging.INFO))


# -- rekey at the store level: merges, files, outbox ----------------------------------------


def test_rekey_merges_records_that_now_share_an_id_the_latest_observation_wins(
        make_store: Any, clock: Any, tmp_path: Path) -> None:
    """Three records keyed by the page URL hold two SKUs; keyed by SKU, two of them merge:
    the one observed latest is kept (its data), with the earliest first_seen; the other is
    listed and deleted. Its file is moved under the new record ID, and outbox entries
    name the new ID with their idempotency keys unchanged."""
    from scrapy_idempotent.store import UnitOfWork

    store = make_store()
    store.open(fingerprinter="x", record_id_scheme=RECORD_ID_SCHEME)
    store.begin_session("w1", "auto")
    by_url = RecordIdentity(source="shop", natural_keys={})
    files_dir = tmp_path / "files"
    records = []
    for n, (url, sku, price, observed) in enumerate([
            ("https://shop.example/a", "A", "1.00", 100.0),
            ("https://shop.example/a?v=2", "A", "2.00", 200.0),
            ("https://shop.example/b", "B", "3.00", 150.0)]):
        item = {"sku": sku, "price": price}
        key = by_url.natural_key(item, url)
        record_id = by_url.record_id(key, "dict")
        path = f"full/{record_id}/{n}.jpg"
        (files_dir / path).parent.mkdir(parents=True)
        (files_dir / path).write_text(price)
        item["files"] = [{"url": f"{url}.jpg", "path": path, "checksum": "c", "status": "ok"}]
        record = dataclasses.replace(by_url.record(item, record_id, key), observed_at=observed)
        records.append((record, None))
        clock.advance(10.0 * (2 - n))  # the first stored first
        store.commit(UnitOfWork(records=[(record, None)], outbox_targets=("hook",)), "w1")
    first_seen = {r.record_id: r.first_seen for r in store.records_page(limit=10)}
    keys_before = {row.record_id: row.key for row in store.outbox_entries()}
    store.end_session("w1", "finished")
    by_sku = RecordIdentity(source="shop", natural_keys={"dict": ("sku",)})
    plan = plan_rekey(store, by_sku, FileStores(local=(str(files_dir),)))
    assert plan.records == 3 and len(plan.merges) == 1
    [(new_a, (kept, merged))] = plan.merges.items()
    assert kept == records[1][0].record_id and merged == [records[0][0].record_id]
    apply_rekey(store, plan)
    stored = {r.record_id: r for r in store.records_page(limit=10)}
    assert set(stored) == {new_a, by_sku.record_id(["B"], "dict")}
    assert json.loads(stored[new_a].data)["price"] == "2.00"
    assert stored[new_a].first_seen == first_seen[records[0][0].record_id]
    assert first_seen[records[0][0].record_id] < first_seen[records[1][0].record_id]
    for record in stored.values():
        [entry] = json.loads(record.data)["files"]
        assert entry["path"].startswith(f"full/{record.record_id}/")
        assert (files_dir / entry["path"]).read_text() == json.loads(record.data)["price"]
    assert sorted(p.relative_to(files_dir).parts[1] for p in files_dir.rglob("*.jpg")) == \
        sorted(stored)  # the old names (the merged record's file too) are gone
    outbox = store.outbox_entries()
    assert {row.record_id for row in outbox} == set(stored)
    assert sorted(row.key for row in outbox) == sorted(keys_before.values())
    assert store.rekey_cleanup() == []
    again = plan_rekey(store, by_sku, FileStores(local=(str(files_dir),)))
    assert not again.needed
    store.close()


def test_a_record_without_the_new_key_field_stops_the_rekey_before_anything_changes(
        make_store: Any, tmp_path: Path) -> None:
    from scrapy_idempotent.store import UnitOfWork

    store = make_store()
    store.open(fingerprinter="x", record_id_scheme=RECORD_ID_SCHEME)
    store.begin_session("w1", "auto")
    by_url = RecordIdentity(source="shop", natural_keys={})
    item = {"name": "no sku"}
    key = by_url.natural_key(item, "https://shop.example/a")
    store.commit(UnitOfWork(records=[(by_url.record(item, by_url.record_id(key, "dict"), key),
                                      None)]), "w1")
    plan = plan_rekey(store, RecordIdentity(source="shop", natural_keys={"dict": ("sku",)}))
    assert [(t, why) for _, t, why in plan.unkeyable] == [
        ("dict", "dict item has no natural key: field 'sku' is missing or empty")]
    store.close()


def test_rekey_dry_run_of_a_scheme_1_database_lists_what_would_change(tmp_path: Path) -> None:
    """A database of record ID scheme 1: every record would get a new ID, under the same
    natural keys, and the dry run changes nothing."""
    database = str(tmp_path / "old.sqlite3")
    shutil.copy(SCHEME_1_DATABASE, database)
    result = rekey_command(database, tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "60 records read; 60 would be given a new record ID (0 of them a new natural " \
           "key), 0 would be merged" in result.stdout
    with reading(database) as store:
        assert store.meta()["record_id_scheme"] == "1"


# -- rekey killed at random moments ----------------------------------------------------------


def _files_database(database: str, files_dir: Path, count: int) -> dict[str, str]:
    """``count`` records keyed by their page URL (no key configured), each with a file named
    by its record ID in the local files store ``files_dir``; returns SKU -> price."""
    from scrapy_idempotent.store import UnitOfWork
    from scrapy_idempotent.store.registry import open_store

    store = open_store(database)
    store.open(fingerprinter="x", record_id_scheme=RECORD_ID_SCHEME)
    store.begin_session("w1", "auto")
    by_url = RecordIdentity(source="spider", natural_keys={})
    prices: dict[str, str] = {}
    records = []
    for n in range(count):
        sku, price = f"SKU-{n:05d}", f"{n}.00"
        item: dict[str, Any] = {"sku": sku, "price": price}
        key = by_url.natural_key(item, f"https://shop.example/product/{sku}")
        record_id = by_url.record_id(key, "dict")
        path = f"full/{record_id}/{n}.jpg"
        (files_dir / path).parent.mkdir(parents=True)
        (files_dir / path).write_text(price)
        item["files"] = [{"url": f"https://shop.example/{n}.jpg", "path": path,
                          "checksum": "c", "status": "downloaded"}]
        records.append((by_url.record(item, record_id, key), None))
        prices[sku] = price
    for start in range(0, count, 500):
        store.commit(UnitOfWork(records=records[start:start + 500]), "w1")
    store.end_session("w1", "finished")
    store.close()
    return prices


@pytest.mark.slow
def test_rekey_sigkilled_at_random_moments_then_rerun_moves_every_record_once(
        tmp_path: Path) -> None:
    """3,000 records with a file each move from the page URL to the SKU as their key; the
    command is SIGKILLed 5 times at random moments of its run (start-up, planning, linking
    files, the transaction, removing the old names), then run to the end: every record
    once, under its new ID, with its file under the new name and none under the old."""
    import random
    import signal
    import time

    files_dir = tmp_path / "files"
    database = str(tmp_path / "keys.sqlite3")
    prices = _files_database(database, files_dir, 3000)
    args = ("-s", f"FILES_STORE={files_dir}")
    keys = {"dict": "sku"}
    # how long a whole run takes, on a copy (the kills fall anywhere in such a run)
    shutil.copytree(files_dir, tmp_path / "copy-files")
    shutil.copy(database, tmp_path / "copy.sqlite3")
    started = time.monotonic()
    probe = rekey_command(str(tmp_path / "copy.sqlite3"), tmp_path, "-s",
                          f"FILES_STORE={tmp_path / 'copy-files'}", natural_keys=keys)
    whole = time.monotonic() - started
    assert probe.returncode == 0, probe.stdout + probe.stderr
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "scrapy", "idempotent", "rekey", "--db", database,
               "-s", f"IDEMPOTENT_NATURAL_KEYS={json.dumps(keys)}", *args]
    killed = 0
    for _ in range(5):
        process = subprocess.Popen(command, cwd=tmp_path, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            process.wait(rng.uniform(0.3, 1.0) * whole)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            killed += 1
    final = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert final.returncode == 0, final.stdout + final.stderr
    records = stored_records(database)
    assert len(records) == len({r.record_id for r in records}) == 3000
    by_sku = RecordIdentity(source="spider", natural_keys={"dict": ("sku",)})
    assert {json.loads(r.data)["sku"]: json.loads(r.data)["price"] for r in records} == prices
    names = {p.relative_to(files_dir).as_posix() for p in files_dir.rglob("*.jpg")}
    for record in records:
        data = json.loads(record.data)
        assert record.record_id == by_sku.record_id([data["sku"]], "dict")
        [entry] = data["files"]
        assert entry["path"].startswith(f"full/{record.record_id}/")
        assert (files_dir / entry["path"]).read_text() == data["price"]
    assert names == {json.loads(r.data)["files"][0]["path"] for r in records}
    with reading(database) as store:
        assert store.rekey_cleanup() == []
    assert killed >= 1  # (the kills fell inside runs: not every run finished first)


@pytest.mark.slow
@deferred_f_from_coro_f
async def test_two_item_types_through_kills_and_a_rerun(
        offers_site: LocalSite, crawl_database: str, tmp_path: Path) -> None:
    """The crawl of products and offers keyed by one SKU, SIGKILLed 3 times at moments given
    by its progress, then run to its end: 120 records; a rerun of the unchanged site updates
    nothing and announces nothing."""
    import random

    keys = json.dumps(NATURAL_KEYS)
    command = [sys.executable, "-m", "scrapy", "runspider",
               str(Path(__file__).parent / "record_types_spider.py"), "-a",
               f"url={offers_site.url}", "-s", f"IDEMPOTENT_DATABASE={crawl_database}",
               "-s", f"IDEMPOTENT_NATURAL_KEYS={keys}",
               "-s", 'ADDONS={"scrapy_idempotent.Addon": 0}', "-s", "ROBOTSTXT_OBEY=False",
               "-s", "TELNETCONSOLE_ENABLED=False", "-s", "CONCURRENT_REQUESTS=8"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    kill_crawls(offers_site, command, tmp_path, random.Random(39), 3, env=env)
    stored = by_type(crawl_database)
    assert stored[PRODUCT] == stored[OFFER] and len(set(stored[OFFER])) == 60
    assert len(stored_records(crawl_database)) == 120
    CountingTarget.RECEIVED.clear()
    rerun = await run_crawl(OffersSpider, settings(
        crawl_database, IDEMPOTENT_OUTBOX_TARGETS=[f"{__name__}.CountingTarget"]),
        url=offers_site.url)
    stats = stats_of(rerun)
    assert stats["idempotent/records/unchanged"] == 120
    assert "idempotent/records/updated" not in stats
    assert "idempotent/records/inserted" not in stats
    assert CountingTarget.RECEIVED == [] and outbox_rows(crawl_database) == []
