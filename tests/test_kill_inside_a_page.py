"""A worker killed inside a page: a real ``CrawlerProcess`` in a subprocess
(``process_spiders.py``), SIGKILLed after the page's items reached the item pipelines but
before the page finished, then run again on the same database."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_site import LocalSite

from crawling import wait_for
from helpers.stored import (
    frontier_entries,
    journaled_responses,
    stored_products,
    stored_records,
)

pytestmark = pytest.mark.slow

SPIDERS = Path(__file__).resolve().parent / "process_spiders.py"



def start_crawl(
    site: LocalSite, db: str, tmp_path: Path, run: int, *settings: str,
    spider: str = "variants"
) -> subprocess.Popen[bytes]:
    args = [sys.executable, str(SPIDERS), "--url", site.url, "--spider", spider,
            "--db", db,
            "--marker", str(tmp_path / f"marker{run}.txt"),
            "--stats", str(tmp_path / f"stats{run}.json")]
    for setting in settings:
        args += ["-s", setting]
    log = open(tmp_path / f"run{run}.log", "w")  # noqa: SIM115 - closed with the process
    try:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def marker_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def url_states(db: str, *fields: str) -> list[tuple[object, ...]]:
    """``(url, state, *fields)`` of every frontier request."""
    return [(entry.url, entry.state, *(getattr(entry, name) for name in fields))
            for entry in frontier_entries(db)]


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "no-journal"])
def test_kill_after_items_reached_the_pipeline_before_the_page_finished(
    site: LocalSite, tmp_path: Path, crawl_database: str, journal: bool
) -> None:
    db = crawl_database
    setting = f"IDEMPOTENT_RESPONSE_JOURNAL={json.dumps(journal)}"
    site.block()
    first = start_crawl(site, db, tmp_path, 1, setting)
    try:
        # the 3 variant items went through the pipelines before ours, and the callback is
        # now awaiting the blocking request: the page is not finished
        wait_for(lambda: len(marker_lines(tmp_path / "marker1.txt")) == 3
                 and site.hits("/block/stock1") == 1, 30, "the 3 items", tmp_path / "run1.log")
        time.sleep(0.3)  # let them reach UpsertPipeline too
        # the page's download is counted soon after its response, its callback not waiting
        wait_for(lambda: [e.downloads for e in frontier_entries(db)] == [1],
                 30, "the download counted", tmp_path / "run1.log")
        assert first.poll() is None, (tmp_path / "run1.log").read_text()
    finally:
        first.kill()
        first.wait(10)
    assert first.returncode == -9
    assert not (tmp_path / "stats1.json").exists()
    assert url_states(db) == [(f"{site.url}/ok/product1", "leased")]  # a dead worker's
    assert stored_records(db) == []  # nothing before done

    site.release()
    restarted_at = time.time()
    second = start_crawl(site, db, tmp_path, 2, setting)
    assert second.wait(60) == 0, (tmp_path / "run2.log").read_text()
    # the records' data was observed when their response was received: in the first run
    # when the journal answered the second one, else in the second run
    observed = [record.observed_at for record in stored_records(db)]
    assert observed and all((t < restarted_at) == journal for t in observed), observed
    stats = json.loads((tmp_path / "stats2.json").read_text())
    assert stats["finish_reason"] == "finished"
    assert url_states(db, "error_kind", "attempts") == [
        (f"{site.url}/ok/product1", "done", None, 2)]
    assert [entry for entry in frontier_entries(db) if entry.state == "leased"] == []
    keys = sorted(product["key"] for product in stored_products(db))
    assert keys == ["product1-blue", "product1-green", "product1-red"]  # 3 rows, not 6
    assert stats["idempotent/records/inserted"] == 3  # inserted once overall
    assert "idempotent/records/updated" not in stats
    assert stats["idempotent/requests/reclaimed"] == 1
    assert stats["idempotent/requests/repeated"] == 1
    assert journaled_responses(db) == 0
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "scrapy", "idempotent", "status", "--db", db, "--json"],
        capture_output=True, text=True, check=True, cwd=tmp_path).stdout)["repeated"]
    assert status["requests"] == 1  # leased twice either way
    if journal:
        # the response that had arrived is replayed, not downloaded again
        assert stats["idempotent/responses/replayed"] == 1
        assert site.hits("/ok/product1") == 1
        assert "idempotent/requests/downloaded" not in stats
        assert (status["downloaded_again"], status["downloads"], status["replays"]) == (0, 1, 1)
    else:
        assert site.hits("/ok/product1") == 2
        assert stats["idempotent/requests/downloaded"] == 1
        assert stats["idempotent/requests/downloaded_again"] == 1
        assert (status["downloaded_again"], status["downloads"], status["replays"]) == (1, 2, 0)
    assert site.hits("/block/stock1") == 2


def test_kill_while_a_memory_request_is_in_flight_replays_its_page(
    site: LocalSite, tmp_path: Path, crawl_database: str
) -> None:
    # a request that cannot be stored lives under its page's lease: killed before it is
    # done, the page is not done either; the next crawl fetches the page again, whose
    # callback yields the request again
    db = crawl_database
    site.block()
    first = start_crawl(site, db, tmp_path, 1, spider="memory_child")
    try:
        wait_for(lambda: site.hits("/block/memory-child") == 1, 30, "the memory request",
                 tmp_path / "run1.log")
        assert first.poll() is None, (tmp_path / "run1.log").read_text()
    finally:
        first.kill()
        first.wait(10)
    assert url_states(db) == [(f"{site.url}/ok/page1", "leased")]
    assert stored_records(db) == []

    site.release()
    second = start_crawl(site, db, tmp_path, 2, spider="memory_child")
    assert second.wait(60) == 0, (tmp_path / "run2.log").read_text()
    stats = json.loads((tmp_path / "stats2.json").read_text())
    assert stats["finish_reason"] == "finished"
    assert site.hits("/block/memory-child") == 2
    assert url_states(db) == [(f"{site.url}/ok/page1", "done")]
    keys = sorted(product["key"] for product in stored_products(db))
    assert keys == ["memory-child", "page1"]
    assert stats["idempotent/requests/from_memory"] == 1
