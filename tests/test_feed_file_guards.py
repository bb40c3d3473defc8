"""A feed file the crawl writes that is deleted, replaced, emptied, or on a full disk: the
crawl stops with an error and exit code 1, nothing is reported stored, the run stays
unfinished, and the next crawl writes the feed again, each record of the run once (nothing
reports a success it did not have)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import (
    EXAMPLE_PROJECT,
    close_reason,
    crawl_settings,
    db_rows,
    fill_up,
    run_crawl,
    small_file_system,
    wait_for,
)
from helpers.stored import stored_runs
from shop.spiders.shop import ShopSpider

NATURAL_KEYS = {"IDEMPOTENT_NATURAL_KEYS": {"shop.items.ProductItem": "sku"}}


def _start(site_url: str, db: Path, log: Path, feed: Path) -> subprocess.Popen[bytes]:
    feeds = {str(feed): {"format": "jsonlines", "overwrite": True}}
    return subprocess.Popen(
        [sys.executable, "-m", "scrapy", "crawl", "shop", "-a", f"url={site_url}",
         "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={log}", "-s", "LOG_LEVEL=INFO",
         "-s", "CONCURRENT_REQUESTS=4", "-s", f"FEEDS={json.dumps(feeds)}"],
        cwd=EXAMPLE_PROJECT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT)


def _lines(feed: Path) -> int:
    try:
        return feed.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _run_skus(db: Path) -> list[str]:
    """The SKUs of the run's records in commit order (their sequence of first sight)."""
    return [json.loads(d)["sku"] for (d,) in db_rows(
        db, "SELECT data FROM records WHERE seen_run_id = 1 ORDER BY seen_seq")]


def _logged(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text(errors="replace")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def _assert_failed_then_completed(site: LocalSite, db: Path, log: Path, feed: Path,
                                  code: int, *causes: str) -> None:
    """The first crawl failed as it should; the next one writes the whole feed."""
    text = log.read_text(errors="replace")
    assert code == 1, text[-3000:]
    assert f"Error writing the feed {feed}" in text, text[-3000:]
    assert all(cause in text for cause in causes), text[-3000:]
    assert "Stored jsonlines feed" not in text
    assert close_reason(log) == "idempotent_feed_error"
    assert [run.finished_at for run in stored_runs(db)] == [None]
    again = log.with_name("again.log")
    process = _start(site.url, db, again, feed)
    try:
        assert process.wait(timeout=300) == 0, again.read_text(errors="replace")[-3000:]
    finally:
        _stop(process)
    assert close_reason(again) == "finished"
    assert "Stored jsonlines feed (500 items)" in again.read_text()
    skus = [json.loads(line)["sku"] for line in feed.read_text().splitlines()]
    assert skus == _run_skus(db) and len(set(skus)) == 500  # every record of the run, once
    assert [run.reason for run in stored_runs(db)] == ["finished"]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["file", "directory", "replaced"])
def test_a_feed_file_deleted_or_replaced_mid_crawl_stops_it_and_the_next_crawl_rewrites_it(
    tmp_path: Path, what: str
) -> None:
    """It used to be reported ``Stored jsonlines feed (500 items)`` for a 0-byte file, the run
    finished and exit code 0 (the process wrote on into the unlinked file, then Scrapy's
    ``store`` created an empty one); a removed directory failed every later crawl."""
    db, log, feed = tmp_path / "db.sqlite3", tmp_path / "first.log", tmp_path / "out" / "f.jl"
    with LocalSite() as site:
        process = _start(site.url, db, log, feed)
        try:
            wait_for(lambda: _lines(feed) >= 20, 120, "the feed to be written", log)
            site.hold()  # the crawl cannot finish meanwhile
            if what == "file":
                feed.unlink()
            elif what == "directory":
                shutil.rmtree(feed.parent)
            else:
                other = feed.with_name("other.jl")
                other.write_bytes(feed.read_bytes())  # as large: only its identity differs
                os.replace(other, feed)
            wait_for(lambda: _logged(log, "Error writing the feed"), 120, "the error", log)
            site.release()
            code = process.wait(timeout=120)
        finally:
            site.release()
            _stop(process)
        cause = "replaced" if what == "replaced" else "deleted"
        _assert_failed_then_completed(site, db, log, feed, code,
                                      f"was {cause} while the crawl was writing it")


@pytest.mark.slow
def test_a_feed_on_a_full_disk_stops_the_crawl_and_the_next_crawl_goes_on(
    tmp_path: Path
) -> None:
    """The disk under a feed fills up: the error is named, the crawl stops with exit code 1
    (it went on and exited 0), and once there is space again the next crawl continues the
    file from its durable mark."""
    db, log = tmp_path / "db.sqlite3", tmp_path / "first.log"
    with small_file_system(tmp_path / "disk", "1m") as disk, LocalSite() as site:
        feed = disk / "f.jl"
        process = _start(site.url, db, log, feed)
        try:
            wait_for(lambda: _lines(feed) >= 20, 120, "the feed to be written", log)
            site.hold()
            filler = fill_up(disk)
            site.release()  # the next records reach the full disk
            code = process.wait(timeout=120)
        finally:
            site.release()
            _stop(process)
        filler.unlink()
        _assert_failed_then_completed(site, db, log, feed, code, "No space left on device")


@deferred_f_from_coro_f
@pytest.mark.parametrize("what", ["deleted", "emptied"])
async def test_a_feed_file_lost_between_crawls_fails_the_next_one_then_is_written_again(
    shop: LocalSite, tmp_path: Path, what: str
) -> None:
    """The feed of an unfinished run removed (or emptied) before the next crawl: that crawl
    reports the loss instead of ``Stored ... (N items)`` for a file that does not hold them,
    and the crawl after writes the whole feed."""
    db, feed = tmp_path / "db.sqlite3", tmp_path / "feed.jsonl"
    settings = crawl_settings(db, FEEDS={str(feed): {"format": "jsonlines", "overwrite": True}},
                              CLOSESPIDER_ITEMCOUNT=60, **NATURAL_KEYS)
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("feedexport/success_count/FileFeedStorage") == 1
    if what == "deleted":
        feed.unlink()
    else:
        feed.write_bytes(b"")
    del settings["CLOSESPIDER_ITEMCOUNT"]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "idempotent_feed_error"
    assert "feedexport/success_count/FileFeedStorage" not in stats
    assert stats["feedexport/failed_count/FileFeedStorage"] == 1
    assert [run.finished_at for run in stored_runs(db)] == [None]
    crawler = await run_crawl(ShopSpider, settings, url=shop.url)
    assert crawler.stats.get_value("finish_reason") == "finished"
    assert crawler.stats.get_value("idempotent/run_id") == 1
    skus = [json.loads(line)["sku"] for line in feed.read_text().splitlines()]
    assert skus == _run_skus(db) and len(set(skus)) == 500
    assert [run.reason for run in stored_runs(db)] == ["finished"]


@deferred_f_from_coro_f
async def test_a_feed_uri_with_an_unknown_placeholder_stops_the_crawl_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Scrapy logs the ``KeyError`` and crawls without the feed; written from the run, such a
    feed would fail every close and keep the run open: the crawl stops before fetching, says
    which placeholder, and the corrected crawl goes on in the same run."""
    db = tmp_path / "db.sqlite3"
    wrong = str(tmp_path / "%(shop_name)s.jsonl")  # the spider has no such attribute
    with LocalSite(listing_pages=2, products_per_page=5) as site:
        settings = crawl_settings(db, FEEDS={wrong: {"format": "jsonlines"}}, **NATURAL_KEYS)
        with caplog.at_level(logging.INFO):
            crawler = await run_crawl(ShopSpider, settings, url=site.url)
        stats = crawler.stats.get_stats()
        assert stats["finish_reason"] == "idempotent_feed_error"
        assert site.request_count == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [
            f"FEEDS: the feed URI {wrong!r} names %(shop_name)s, which is not an attribute "
            "of the spider, nor time, batch_time or batch_id, nor set by the feed's "
            "uri_params function; the crawl stops before fetching anything and the run "
            "stays open: correct FEEDS and crawl again"]
        assert [run.finished_at for run in stored_runs(db)] == [None]

        right = tmp_path / "%(name)s.jsonl"
        settings["FEEDS"] = {str(right): {"format": "jsonlines"}}
        crawler = await run_crawl(ShopSpider, settings, url=site.url)
        assert crawler.stats.get_value("finish_reason") == "finished"
        assert crawler.stats.get_value("idempotent/run_id") == 1
    assert len((tmp_path / "shop.jsonl").read_text().splitlines()) == 10
    assert [run.reason for run in stored_runs(db)] == ["finished"]
