"""Feeds (``FEEDS``, ``-o``, ``-O``) with the add-on: a view of the run's records, written from
the database when a crawl closes, whatever was killed on the way."""

from __future__ import annotations

import csv
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import EXAMPLE_PROJECT, crawl_settings, db_rows, run_crawl
from helpers.feeds import (
    FIELDS,
    exported_rows,
    product_rows,
    read_jsonlines,
    record_count,
)
from helpers.stored import (
    requests_done,
    run_products,
    stored_products,
    stored_records,
    stored_runs,
    stored_sessions,
)
from scrapy_idempotent.store import open_store
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def stored_rows(database: str | Path) -> list[tuple[str, ...]]:
    return product_rows(stored_products(database))


def read_csv(path: Path) -> list[dict[str, Any]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@deferred_f_from_coro_f
async def test_feeds_are_written_from_the_run_through_scrapys_exporters(
    shop: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    db = crawl_database
    feeds = {
        str(tmp_path / "all.jsonl"): {"format": "jsonlines"},
        str(tmp_path / "all.json"): {"format": "json", "indent": 2, "overwrite": True},
        str(tmp_path / "part-%(batch_id)d.csv"): {"format": "csv", "batch_item_count": 200,
                                                  "fields": ["sku", "price"]},
        str(tmp_path / "products-%(name)s.jsonl"): {
            "format": "jsonlines", "item_classes": ["shop.items.ProductItem"]},
        str(tmp_path / "none.jsonl"): {"format": "jsonlines", "item_classes": ["builtins.dict"]},
    }
    crawler = await run_crawl(ShopSpider, crawl_settings(db, FEEDS=feeds, **NATURAL_KEYS),
                              url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    expected = stored_rows(db)
    assert len(expected) == 500
    lines = read_jsonlines(tmp_path / "all.jsonl")
    assert product_rows(lines) == expected
    assert list(lines[0]) == list(FIELDS)  # the order the spider filled the item in
    assert product_rows(json.loads((tmp_path / "all.json").read_text())) == expected
    assert (tmp_path / "all.json").read_text().startswith("[\n{\n  \"sku\"")  # indent 2
    batches = [read_csv(tmp_path / f"part-{n}.csv") for n in (1, 2, 3)]
    assert [len(b) for b in batches] == [200, 200, 100]
    assert not (tmp_path / "part-4.csv").exists()
    assert all(list(row) == ["sku", "price"] for batch in batches for row in batch)
    assert sorted((r["sku"], r["price"]) for b in batches for r in b) == sorted(
        (row[0], row[2]) for row in expected)
    assert product_rows(read_jsonlines(tmp_path / "products-shop.jsonl")) == expected
    assert (tmp_path / "none.jsonl").read_text() == ""  # store_empty: an empty feed
    assert stats["feedexport/success_count/FileFeedStorage"] == 7
    assert not list(tmp_path.glob(".*partial"))


@deferred_f_from_coro_f
async def test_a_graceful_stop_leaves_a_snapshot_and_append_adds_the_run_once(
    shop: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    db = crawl_database
    appended, replaced = tmp_path / "appended.jsonl", tmp_path / "replaced.json"
    appended.write_text('{"before": "the run"}\n')
    feeds = {str(appended): {"format": "jsonlines"},
             str(replaced): {"format": "json", "overwrite": True}}
    settings = crawl_settings(db, FEEDS=feeds, CLOSESPIDER_ITEMCOUNT=50, **NATURAL_KEYS)
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "closespider_itemcount"
    snapshot = stored_rows(db)
    assert 50 <= len(snapshot) < 500
    assert product_rows(json.loads(replaced.read_text())) == snapshot
    lines = read_jsonlines(appended)
    assert lines[0] == {"before": "the run"}
    assert product_rows(lines[1:]) == snapshot

    del settings["CLOSESPIDER_ITEMCOUNT"]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)  # resumes the run
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/run_id") == 1
    everything = stored_rows(db)
    assert len(everything) == 500
    assert product_rows(json.loads(replaced.read_text())) == everything
    lines = read_jsonlines(appended)
    assert lines[0] == {"before": "the run"}
    assert product_rows(lines[1:]) == everything  # the snapshot was replaced, not repeated

    crawler = await run_crawl(ShopSpider, settings, url=shop.url)  # run 2: all unchanged
    assert crawler.stats.get_value("idempotent/run_id") == 2
    assert crawler.stats.get_value("idempotent/records/unchanged") == 500
    assert product_rows(json.loads(replaced.read_text())) == everything
    lines = read_jsonlines(appended)
    assert len(lines) == 1 + 500 + 500  # run 2 appended once after run 1
    assert product_rows(lines[501:]) == everything


@deferred_f_from_coro_f
async def test_a_new_run_that_sees_fewer_records_has_a_feed_of_its_own_records(
    shop: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    db = crawl_database
    feed = tmp_path / "run.jsonl"
    settings = crawl_settings(db, FEEDS={str(feed): {"format": "jsonlines", "overwrite": True}},
                              **NATURAL_KEYS)
    await run_crawl(ShopSpider, settings, url=shop.url)
    assert len(read_jsonlines(feed)) == 500
    settings["CLOSESPIDER_ITEMCOUNT"] = 30
    settings["IDEMPOTENT_RUN_MODE"] = "fresh"
    await run_crawl(ShopSpider, settings, url=shop.url)
    seen = len(run_products(db, 2))
    assert 30 <= seen < 500
    assert len(read_jsonlines(feed)) == seen  # run 2's records only, not the 500 stored


def _feed_command(site_url: str, db: str | Path, log: Path, feed_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
            "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={log}",
            "-s", "CONCURRENT_REQUESTS=4", "-s", "CONCURRENT_REQUESTS_PER_DOMAIN=4",
            *feed_args]


FEED_KINDS = {
    "jsonlines -o": (["-o", "{dir}/feed.jsonl"], "feed.jsonl", read_jsonlines),
    "json -O": (["-O", "{dir}/feed.json"], "feed.json", lambda p: json.loads(p.read_text())),
    "csv FEEDS": (["-s", 'FEEDS={{"{dir}/feed.csv": {{"format": "csv"}}}}'], "feed.csv",
                  read_csv),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(FEED_KINDS))
def test_feeds_after_five_sigkills_hold_exactly_the_records_of_the_run(
    tmp_path: Path, kind: str
) -> None:
    args, name, read = FEED_KINDS[kind]
    feed_args = [a.format(dir=tmp_path) for a in args]
    feed = tmp_path / name
    db = tmp_path / "db.sqlite3"
    with LocalSite(delay=0.01) as site:
        for kill, records_before_kill in enumerate((15, 90, 170, 250, 330), 1):
            log = tmp_path / f"kill{kill}.log"
            process = subprocess.Popen(_feed_command(site.url, db, log, feed_args),
                                       cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 120
                while record_count(db) < records_before_kill and process.poll() is None:
                    assert time.monotonic() < deadline, f"crawl {kill} stored too little"
                    time.sleep(0.02)
                assert process.poll() is None, f"crawl {kill} ended before its kill"
                process.send_signal(signal.SIGKILL)
            finally:
                process.kill()
                process.wait()
            # what a kill leaves: the records durably written, then at most a cut entry
            assert_durable_prefix(db, feed, name)
        log = tmp_path / "final.log"
        final = subprocess.run(_feed_command(site.url, db, log, feed_args),
                               cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               timeout=300)
        assert final.returncode == 0, log.read_text()
        expected = site.expected_products()
    items = read(feed)
    rows = product_rows(items)
    assert len(rows) == len(set(rows)) == 500
    assert rows == exported_rows(db, tmp_path)
    assert {row[0] for row in rows} == set(expected)
    assert not list(tmp_path.glob(".*partial"))


def feed_mark(db: Path) -> tuple[int, int] | None:
    """(record sequence, byte offset) of the one streamed feed's mark, None before it."""
    rows = db_rows(db, "SELECT seq, byte_offset FROM feeds WHERE uri LIKE 'stream %'"
                   " ORDER BY run_id DESC LIMIT 1")
    return (int(rows[0][0]), int(rows[0][1])) if rows else None


def assert_durable_prefix(db: Path, feed: Path, name: str) -> None:
    """The feed's file up to its mark holds one entry per record of the run up to the mark's
    sequence, each once."""
    mark = feed_mark(db)
    if mark is None:
        return
    seq, offset = mark
    data = feed.read_bytes()
    assert len(data) >= offset
    head = data[:offset].decode()
    if name.endswith(".json"):
        entries = json.loads(head + "]") if offset else []
        skus = [e["sku"] for e in entries]
    elif name.endswith(".csv"):
        skus = [r["sku"] for r in csv.DictReader(head.splitlines())]
    else:
        skus = [json.loads(line)["sku"] for line in head.splitlines()]
    run_skus = [json.loads(d)["sku"] for (d,) in db_rows(
        db, "SELECT data FROM records WHERE seen_run_id = (SELECT max(run_id) FROM runs)"
        " AND seen_seq <= ? ORDER BY seen_seq", (seq,))]
    assert skus == run_skus


KILLING_EXPORTER = '''
import os
import signal

from scrapy.exporters import JsonItemExporter


class KillingExporter(JsonItemExporter):
    """Kills its process with SIGKILL at the 100th item it exports."""

    count = 0

    def export_item(self, item):
        KillingExporter.count += 1
        if KillingExporter.count == 100 and os.environ.get("KILL_IN_EXPORT"):
            os.kill(os.getpid(), signal.SIGKILL)
        super().export_item(item)
'''


@pytest.mark.slow
def test_a_kill_while_the_feed_is_written_leaves_the_old_file_and_the_next_crawl_writes_it(
    shop: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    (tmp_path / "killing_exporter.py").write_text(KILLING_EXPORTER)
    db, feed = crawl_database, tmp_path / "feed.json"
    feed.write_text('["from an earlier crawl"]')
    args = ["-s", 'FEED_EXPORTERS={"killjson": "killing_exporter.KillingExporter"}',
            "-s", f'FEEDS={{"{feed}": {{"format": "killjson", "overwrite": true}}}}',
            "-s", "IDEMPOTENT_FEED_STREAMING=False"]  # written at the close
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path), "KILL_IN_EXPORT": "1"}
    killed = subprocess.run(_feed_command(shop.url, db, tmp_path / "1.log", args),
                            cwd=EXAMPLE_PROJECT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=300)
    assert killed.returncode == -signal.SIGKILL
    # the crawl was complete: killed while writing its feed
    assert len(stored_records(db)) == 500
    assert json.loads(feed.read_text()) == ["from an earlier crawl"]
    assert [run.finished_at for run in stored_runs(db)] == [None]  # not finished yet

    del env["KILL_IN_EXPORT"]
    shop.reset_counts()
    again = subprocess.run(_feed_command(shop.url, db, tmp_path / "2.log", args),
                           cwd=EXAMPLE_PROJECT, env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=300)
    assert again.returncode == 0
    assert shop.request_count <= 1  # nothing left to fetch (the start page at most)
    assert product_rows(json.loads(feed.read_text())) == stored_rows(db)
    assert [run.reason for run in stored_runs(db)] == ["finished"]
    assert not list(tmp_path.glob(".*partial"))


class VariantSpider(ShopSpider):
    """Three variants of each product, yielded in one callback, fields not in name order."""

    name = "variants"

    def parse_product(self, response: Any) -> Any:
        for item in super().parse_product(response):
            for colour in ("red", "green", "blue"):
                yield {"variant": f"{item['sku']}-{colour}", "sku": item["sku"],
                       "colour": colour}


@deferred_f_from_coro_f
async def test_a_feed_keeps_the_order_of_the_items_and_of_their_fields(
    tmp_path: Path, crawl_database: str
) -> None:
    db, feed = crawl_database, tmp_path / "variants.jsonl"
    settings = crawl_settings(db, FEEDS={str(feed): {"format": "jsonlines"}},
                              IDEMPOTENT_NATURAL_KEYS={"dict": "variant"},
                              IDEMPOTENT_RECORD_ID_FIELD=None)
    with LocalSite(listing_pages=2, products_per_page=5) as site:
        await run_crawl(VariantSpider, settings, url=site.url)
    lines = read_jsonlines(feed)
    assert len(lines) == 30
    assert all(list(line) == ["variant", "sku", "colour"] for line in lines)
    for start in range(0, 30, 3):  # the items of one page in the order they were yielded
        assert [line["colour"] for line in lines[start:start + 3]] == ["red", "green", "blue"]
        assert len({line["sku"] for line in lines[start:start + 3]}) == 1


@deferred_f_from_coro_f
async def test_an_appended_feed_new_with_the_run_gets_the_run_once_after_a_stop(
    shop: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    db, feed = crawl_database, tmp_path / "new.jsonl"
    settings = crawl_settings(db, FEEDS={str(feed): {"format": "jsonlines"}},
                              CLOSESPIDER_ITEMCOUNT=40, **NATURAL_KEYS)
    await run_crawl(ShopSpider, settings, url=shop.url)
    assert 40 <= len(read_jsonlines(feed)) < 500
    del settings["CLOSESPIDER_ITEMCOUNT"]
    await run_crawl(ShopSpider, settings, url=shop.url)
    assert product_rows(read_jsonlines(feed)) == stored_rows(db)  # 500, the stop's not kept


@pytest.fixture
def ftp_root(tmp_path: Path) -> Any:
    """A real FTP server (pyftpdlib) on 127.0.0.1, serving ``tmp_path / "ftp"``."""
    import threading

    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import FTPServer

    root = tmp_path / "ftp"
    root.mkdir()
    authorizer = DummyAuthorizer()
    authorizer.add_user("user", "secret", str(root), perm="elradfmwMT")
    handler = type("Handler", (FTPHandler,), {"authorizer": authorizer})
    server = FTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.05},
                              daemon=True)
    thread.start()
    yield root, f"ftp://user:secret@127.0.0.1:{server.address[1]}"
    server.close_all()
    thread.join(10)


# pyftpdlib (the test's FTP server, not the package) imports asyncore and asynchat
@pytest.mark.filterwarnings("ignore:The asyn(core|chat) module is deprecated:DeprecationWarning")
@deferred_f_from_coro_f
async def test_ftp_feeds_overwritten_at_each_stop_and_appended_once_when_the_run_ends(
    shop: LocalSite, ftp_root: Any, crawl_database: str
) -> None:
    root, base = ftp_root
    (root / "appended.jsonl").write_text('{"before": "the run"}\n')
    feeds = {f"{base}/replaced.json": {"format": "json", "overwrite": True},
             f"{base}/appended.jsonl": {"format": "jsonlines", "overwrite": False}}
    db = crawl_database
    settings = crawl_settings(db, FEEDS=feeds, CLOSESPIDER_ITEMCOUNT=40, **NATURAL_KEYS)
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("feedexport/success_count/FTPFeedStorage") == 1
    assert product_rows(json.loads((root / "replaced.json").read_text())) == stored_rows(db)
    # an FTP file is appended to remotely: written once, when the run ends, not at a stop
    assert read_jsonlines(root / "appended.jsonl") == [{"before": "the run"}]
    del settings["CLOSESPIDER_ITEMCOUNT"]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("feedexport/success_count/FTPFeedStorage") == 2
    everything = stored_rows(db)
    assert len(everything) == 500
    assert product_rows(json.loads((root / "replaced.json").read_text())) == everything
    lines = read_jsonlines(root / "appended.jsonl")
    assert lines[0] == {"before": "the run"}
    assert product_rows(lines[1:]) == everything


@pytest.mark.slow
def test_a_stdout_feed_gets_the_run_when_the_crawl_closes(
    shop: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    result = subprocess.run(
        _feed_command(shop.url, crawl_database, tmp_path / "log", ["-o", "-:jsonlines"]),
        cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    assert result.returncode == 0
    rows = product_rows([json.loads(line) for line in result.stdout.decode().splitlines()])
    assert rows == stored_rows(crawl_database)
    assert len(rows) == 500


# -- workers closing at the same time, append under concurrent commits, failed feeds ----------

FEED_HELPERS = '''
import glob

from scrapy.exporters import JsonLinesItemExporter

from helpers.stored import change_stored

DATABASE = {}


class PartialThief(JsonLinesItemExporter):
    """Removes every temporary file of its feed when it finishes (what another worker's
    clean-up did to a file still being written)."""

    def finish_exporting(self):
        super().finish_exporting()
        self.file.flush()
        for path in glob.glob(DATABASE["thief_glob"]):
            import os
            os.unlink(path)


class CommitsMeanwhile:
    """An item filter that, at the first item it sees, commits a write from another
    connection (on either backend): another worker committing while the feeds are being
    written."""

    def __init__(self, feed_options):
        self.done = False

    def accepts(self, item):
        if not self.done:
            self.done = True
            change_stored(DATABASE["database"],
                          "INSERT INTO feeds (run_id, uri, base_size) VALUES (999, 'x', 0)")
        return True
'''


@pytest.fixture
def helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    package = tmp_path / "helpers_pkg"
    package.mkdir()
    (package / "feed_helpers.py").write_text(FEED_HELPERS)
    monkeypatch.syspath_prepend(str(package))
    import importlib

    import feed_helpers  # type: ignore[import-not-found]

    importlib.reload(feed_helpers)
    yield feed_helpers
    sys.modules.pop("feed_helpers", None)


def _live_and_dead_workers() -> tuple[subprocess.Popen[bytes], str, str]:
    """The worker id of a process still running, and of one that has exited."""
    import socket

    from scrapy_idempotent.workers import WorkerId, pid_namespace, process_start_ticks

    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, namespace = socket.gethostname(), pid_namespace()
    start = process_start_ticks(live.pid) or "1"
    live_id = str(WorkerId(host, live.pid, start, "0a0b0c0d", namespace))
    dead_id = str(WorkerId(host, dead.pid, start, "0a0b0c0d", namespace))
    return live, live_id, dead_id


@deferred_f_from_coro_f
async def test_a_temporary_feed_file_of_a_live_worker_is_kept_one_of_a_dead_worker_removed(
    tmp_path: Path, crawl_database: str
) -> None:
    db, feed = crawl_database, tmp_path / "feed.jsonl"
    live, live_id, dead_id = _live_and_dead_workers()
    try:
        # written by a worker still writing the same feed, and by one killed while writing
        of_live = tmp_path / f".feed.jsonl.{live_id.replace(':', '+')}.1234abcd.partial"
        of_dead = tmp_path / f".feed.jsonl.{dead_id.replace(':', '+')}.1234abcd.partial"
        of_live.write_text("being written\n")
        of_dead.write_text("left by a kill\n")
        settings = crawl_settings(db, FEEDS={str(feed): {"format": "jsonlines"}})
        with LocalSite(listing_pages=2, products_per_page=5) as site:
            crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert crawler.stats.get_value("feedexport/success_count/FileFeedStorage") == 1
        assert len(read_jsonlines(feed)) == 10
        assert of_live.read_text() == "being written\n"
        assert not of_dead.exists()
        assert sorted(p.name for p in tmp_path.glob(".*partial")) == [of_live.name]
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait()


@deferred_f_from_coro_f
async def test_a_feed_whose_temporary_file_vanished_is_not_stored_and_the_run_stays_open(
    tmp_path: Path, helpers: Any, caplog: pytest.LogCaptureFixture, crawl_database: str
) -> None:
    db, feed = crawl_database, tmp_path / "feed.jsonl"
    helpers.DATABASE["thief_glob"] = str(tmp_path / ".feed.jsonl.*.partial")
    feed.write_text("before\n")
    # a feed written at the close (streamed feeds have no temporary file)
    settings = crawl_settings(db, FEEDS={str(feed): {"format": "thief", "overwrite": True}},
                              FEED_EXPORTERS={"thief": "feed_helpers.PartialThief"},
                              IDEMPOTENT_FEED_STREAMING=False)
    with LocalSite(listing_pages=2, products_per_page=5) as site:
        with caplog.at_level(logging.INFO):
            crawler = await run_crawl(ShopSpider, settings, url=site.url)
        stats = crawler.stats.get_stats()
        assert "feedexport/success_count/FileFeedStorage" not in stats
        assert stats["feedexport/failed_count/FileFeedStorage"] == 1
        assert feed.read_text() == "before\n"
        assert [run.finished_at for run in stored_runs(db)] == [None]
        # nor does its session, as `scrapy idempotent status` shows it
        assert [s.reason for s in stored_sessions(db)] == ["idempotent_feed_error"]
        assert not [r for r in caplog.records if r.getMessage().startswith("Stored ")]
        # found only at the close: the crawl does not say it finished
        assert stats["finish_reason"] == "idempotent_feed_error"
        closed = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith("Spider closed")]
        assert closed == ["Spider closed (idempotent_feed_error)"]
        assert not logging.getLogger("scrapy.core.engine").filters  # undone at the stop

        settings["FEED_EXPORTERS"] = {}
        settings["FEEDS"] = {str(feed): {"format": "jsonlines", "overwrite": True}}
        site.reset_counts()
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert crawler.stats.get_value("idempotent/run_id") == 1  # the same run, resumed
        assert site.request_count <= 1  # nothing left to fetch
    assert len(read_jsonlines(feed)) == 10
    assert [run.reason for run in stored_runs(db)] == ["finished"]


@deferred_f_from_coro_f
async def test_append_keeps_the_file_when_another_worker_commits_while_feeds_are_written(
    tmp_path: Path, helpers: Any, crawl_database: str
) -> None:
    db = crawl_database
    first, appended = tmp_path / "first.jsonl", tmp_path / "appended.jsonl"
    helpers.DATABASE["database"] = db
    appended.write_text('{"before": "the run"}\n')
    feeds = {str(first): {"format": "jsonlines", "overwrite": True,
                          "item_filter": "feed_helpers.CommitsMeanwhile"},
             str(appended): {"format": "jsonlines"}}
    # more records than one page of reads (500): the read is still going when the append
    # feed's base is recorded
    # feeds written at the close (a streamed feed's filter runs in its write transaction)
    with LocalSite(listing_pages=26, products_per_page=20) as site:
        crawler = await run_crawl(ShopSpider, crawl_settings(
            db, FEEDS=feeds, IDEMPOTENT_FEED_STREAMING=False), url=site.url)
    assert crawler.stats.get_value("feedexport/success_count/FileFeedStorage") == 2
    # the other worker's commit is there: its base is the one recorded, not a new one
    store = open_store(db)
    store.open_existing(readonly=False)
    try:
        assert store.feed_base(999, "x", 7) == 0
    finally:
        store.close()
    lines = read_jsonlines(appended)
    assert lines[0] == {"before": "the run"}
    assert len(lines) == 1 + 520
    assert len(read_jsonlines(first)) == 520


@deferred_f_from_coro_f
async def test_a_feed_that_cannot_be_stored_leaves_the_run_unfinished_and_is_written_next_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, crawl_database: str
) -> None:
    db = crawl_database
    blocker = tmp_path / "out"
    blocker.write_text("a file where the feed's directory should be")
    feed = blocker / "feed.json"
    settings = crawl_settings(db, FEEDS={str(feed): {"format": "json"}})
    with LocalSite(listing_pages=2, products_per_page=5) as site:
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert crawler.stats.get_value("feedexport/failed_count/FileFeedStorage") == 1
        assert [run.finished_at for run in stored_runs(db)] == [None]
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert any(str(feed) in m and "unfinished" in m
                   and ("FileExistsError" in m or "NotADirectoryError" in m)
                   for m in errors), errors

        blocker.unlink()
        done_first = requests_done(db)  # (the feed's error stops the crawl: maybe early)
        site.reset_counts()
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert crawler.stats.get_value("idempotent/run_id") == 1
        assert crawler.stats.get_value("feedexport/success_count/FileFeedStorage") == 1
        # only what the first crawl left undone is fetched (and at most one page again)
        assert site.request_count <= requests_done(db) - done_first + 1
    assert len(json.loads(feed.read_text())) == 10
    assert [run.reason for run in stored_runs(db)] == ["finished"]


FULL_DISK_EXPORTER = '''
import errno

from scrapy.exporters import JsonLinesItemExporter


class FullDiskExporter(JsonLinesItemExporter):
    """Its disk is full after 20 items: every later write fails with ENOSPC."""

    def export_item(self, item):
        self.count = getattr(self, "count", 0) + 1
        if self.count > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().export_item(item)
'''


@deferred_f_from_coro_f
async def test_a_feed_on_a_full_disk_changes_no_other_feed_and_logs_its_cause_once(
    shop: LocalSite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, crawl_database: str
) -> None:
    (tmp_path / "full_disk.py").write_text(FULL_DISK_EXPORTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    db, full, other = crawl_database, tmp_path / "full.jsonl", tmp_path / "other.json"
    # the failing feed first: today its error made every later item skip the other feeds
    feeds = {str(full): {"format": "full"}, str(other): {"format": "json"}}
    settings = crawl_settings(db, FEEDS=feeds, **NATURAL_KEYS,
                              FEED_EXPORTERS={"full": "full_disk.FullDiskExporter"})
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    stats = crawler.stats.get_stats()
    assert product_rows(json.loads(other.read_text())) == stored_rows(db)  # all 500
    assert stats["feedexport/success_count/FileFeedStorage"] == 1
    assert stats["feedexport/failed_count/FileFeedStorage"] == 1
    # streamed: the file holds what was written before its disk filled, no entry twice
    written = [line["sku"] for line in read_jsonlines(full)] if full.exists() else []
    assert len(written) == len(set(written)) <= 20
    assert [run.finished_at for run in stored_runs(db)] == [None]  # written next time
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    with_traceback = [r for r in errors if r.exc_info]
    assert len(with_traceback) == 1, [r.getMessage() for r in errors]
    assert "No space left on device" in str(with_traceback[0].exc_info[1])
    assert len(errors) <= 3, [r.getMessage() for r in errors]  # not one line per item
    sys.modules.pop("full_disk", None)


class OutOfOrderSpider(ShopSpider):
    """Products filled in another order than ProductItem declares its fields, and a dict
    item per product whose keys are not in name order."""

    name = "out_of_order"

    def parse_product(self, response: Any) -> Any:
        for item in super().parse_product(response):
            product = type(item)()
            for field in ("url", "price", "sku", "name"):
                product[field] = item[field]
            yield product
            yield {"zone": "eu", "sku": f"d-{item['sku']}", "alpha": 1}


@deferred_f_from_coro_f
@pytest.mark.parametrize("fields", [None, ["price", "sku"]])
async def test_csv_columns_are_in_scrapys_order(tmp_path: Path, fields: Any,
                                               crawl_database: str) -> None:
    """CSV columns as Scrapy's own exporter writes them: an item's declared fields, a dict's
    keys in their order (the first item decides), FEED_EXPORT_FIELDS when set."""
    options = {"format": "csv", **({"fields": fields} if fields else {})}
    headers = {}
    with LocalSite(listing_pages=1, products_per_page=3) as site:
        for mode in ("plain", "idempotent"):
            feed = tmp_path / f"{mode}-%(name)s-%(batch_id)d.csv"
            settings = crawl_settings(
                crawl_database, FEEDS={str(feed): options},
                IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku", "dict": "sku"},
                IDEMPOTENT_RECORD_ID_FIELD=None, FEED_EXPORT_BATCH_ITEM_COUNT=1)
            if mode == "plain":
                settings["ADDONS"] = {}
            await run_crawl(OutOfOrderSpider, settings, url=site.url)
            headers[mode] = sorted(
                path.read_text().splitlines()[0]
                for path in tmp_path.glob(f"{mode}-out_of_order-*.csv"))
    assert len(headers["plain"]) == 6
    assert headers["idempotent"] == headers["plain"]
    if fields:
        assert set(headers["plain"]) == {"price,sku"}
    else:
        # the item's columns in Scrapy's order for its version (2.19: as declared; 2.13 sorts)
        product = [h for h in set(headers["plain"]) if h != "zone,sku,alpha"]
        assert len(set(headers["plain"])) == 2 and len(product) == 1
        assert sorted(product[0].split(",")) == ["name", "price", "sku", "url"]


SLOW_STORAGE = '''
from scrapy.extensions.feedexport import FileFeedStorage
from twisted.internet.defer import Deferred

HOLD = {"on": False}
HELD = []


class SlowFileStorage(FileFeedStorage):
    """A local storage whose store waits (a slow disk) while HOLD is on."""

    def store(self, file):
        super().store(file)
        if HOLD["on"]:
            HOLD["on"] = False
            held = Deferred()
            HELD.append(held)
            return held
        return None
'''


@deferred_f_from_coro_f
async def test_a_stopped_workers_late_snapshot_never_replaces_the_finished_runs_feed(
    shop: LocalSite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crawl_database: str
) -> None:
    """Worker B writes its snapshot of the run at a graceful stop (100 records so far), its
    storage slow; worker A finishes the run and stores the complete feeds; B's store ends
    last. The complete feeds stay."""
    from scrapy.utils.defer import deferred_from_coro, maybe_deferred_to_future
    from scrapy.utils.test import get_crawler

    from scrapy_idempotent import IdempotentFeedExporter

    (tmp_path / "slow_storage.py").write_text(SLOW_STORAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import slow_storage  # type: ignore[import-not-found]

    db, replaced, appended = crawl_database, tmp_path / "out.json", tmp_path / "out.jsonl"
    appended.write_text('{"before": "the run"}\n')
    feeds = {str(replaced): {"format": "json", "overwrite": True},
             str(appended): {"format": "jsonlines"}}
    storages = {"": "slow_storage.SlowFileStorage", "file": "slow_storage.SlowFileStorage"}
    # snapshots are written by feeds written at the close
    crawler = get_crawler(ShopSpider, crawl_settings(db, FEEDS=feeds, FEED_STORAGES=storages,
                                                     IDEMPOTENT_FEED_STREAMING=False,
                                                     **NATURAL_KEYS))
    late: list[Any] = []

    def item_scraped(item: Any) -> None:
        if len(late) or crawler.stats.get_value("item_scraped_count", 0) < 100:
            return
        other = open_store(db)
        other.open_existing(readonly=False)
        worker_b = IdempotentFeedExporter(crawler)
        worker_b._spider = crawler.spider
        worker_b._from_run = True
        slow_storage.HOLD["on"] = True  # its first store waits
        late.append((other, deferred_from_coro(worker_b.export_run(other, 1, False))))

    from scrapy import signals

    crawler.signals.connect(item_scraped, signals.item_scraped)
    try:
        from crawling import crawl_to_end

        await crawl_to_end(crawler, url=shop.url)
        assert crawler.stats.get_value("finish_reason") == "finished"
        everything = stored_rows(db)
        assert len(everything) == 500
        assert product_rows(json.loads(replaced.read_text())) == everything  # A's
        assert late and slow_storage.HELD, "worker B's store was not held"
        other, b_done = late[0]
        slow_storage.HELD[0].callback(None)  # B's slow store ends last
        await maybe_deferred_to_future(b_done)
        other.close()
    finally:
        sys.modules.pop("slow_storage", None)
    assert product_rows(json.loads(replaced.read_text())) == everything
    lines = read_jsonlines(appended)
    assert lines[0] == {"before": "the run"}
    assert product_rows(lines[1:]) == everything
    assert not list(tmp_path.glob(".*partial"))


def _entries(path: Path, fmt: str) -> list[str]:
    """The SKUs of a feed file's entries (the file must be a valid feed of its format)."""
    text = path.read_text()
    if fmt == "json":
        return [e["sku"] for e in json.loads(text)]
    if fmt == "jsonlines":
        return [json.loads(line)["sku"] for line in text.splitlines()]
    if fmt == "csv":
        return [row["sku"] for row in csv.DictReader(text.splitlines())]
    import xml.etree.ElementTree as ET

    return [e.findtext("sku") or "" for e in ET.fromstring(text)]


@deferred_f_from_coro_f
@pytest.mark.parametrize("fmt", ["json", "jsonlines", "csv", "xml"])
async def test_a_streamed_feed_is_cut_back_to_its_mark_and_continued_by_the_next_crawl(
    shop: LocalSite, tmp_path: Path, fmt: str
) -> None:
    """What a killed writer leaves past the durable mark (an entry half written) is cut by
    the next crawl of the run, which continues the file through a resumed exporter: one
    header, valid syntax, each record once in commit order."""
    db, feed = tmp_path / "db.sqlite3", tmp_path / f"feed.{fmt}"
    settings = crawl_settings(db, FEEDS={str(feed): {"format": fmt, "overwrite": True}},
                              CLOSESPIDER_ITEMCOUNT=60, **NATURAL_KEYS)
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "closespider_itemcount"
    first = _entries(feed, fmt)  # valid between writes: the closing bytes are there
    assert 60 <= len(first) < 500 and len(set(first)) == len(first)
    (mark,) = db_rows(db, "SELECT byte_offset FROM feeds WHERE uri LIKE 'stream %'")
    closing = feed.stat().st_size - mark[0]  # the closing bytes are past the mark
    assert closing > 0 if fmt in ("json", "xml") else closing == 0
    with feed.open("ab") as f:
        f.write(b'{"sku": "half an ent')  # what a killed writer left after its last sync

    del settings["CLOSESPIDER_ITEMCOUNT"]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)  # resumes the run
    assert crawler.stats.get_value("idempotent/run_id") == 1
    skus = _entries(feed, fmt)
    stored = [product["sku"] for product in run_products(db, 1)]
    assert skus == stored and len(stored) == 500
    assert skus[:len(first)] == first
    if fmt == "csv":
        assert feed.read_text().count("sku,") == 1  # one header
