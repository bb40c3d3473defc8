"""The database gives space back: big responses are journaled while their requests are in
flight and deleted when they complete; the file must not stay at its peak size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import scrapy
from local_site import LocalSite
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, db_rows, run_crawl

pytestmark = pytest.mark.slow

PAGE = 1024 * 1024  # 1 MB pages
PAGES = 120


class BigPages(scrapy.Spider):
    name = "big"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base = url

    async def start(self) -> Any:
        for i in range(1, PAGES + 1):
            yield scrapy.Request(f"{self.base}/page/{i}")

    def parse(self, response: Any) -> Any:
        yield {"page": response.url, "length": len(response.body)}


@deferred_f_from_coro_f
async def test_journal_space_comes_back_after_a_crawl_of_big_pages(tmp_path: Path) -> None:
    db = tmp_path / "big.sqlite3"
    with LocalSite(keep_alive=False) as site:
        for i in range(1, PAGES + 1):
            site.add(f"/page/{i}", b"<html><body>" + b"x" * PAGE + b"</body></html>")
        crawler = await run_crawl(BigPages, crawl_settings(
            db, IDEMPOTENT_NATURAL_KEYS={"dict": "page"}, DOWNLOAD_WARNSIZE=0,
            IDEMPOTENT_RESPONSE_JOURNAL=True), url=site.url)
    stats = crawler.stats.get_stats()
    assert stats["finish_reason"] == "finished"
    assert stats["idempotent/responses/journaled"] == PAGES  # 120 MB went through the file
    assert db_rows(db, "SELECT count(*) FROM records") == [(PAGES,)]
    assert db_rows(db, "SELECT count(*) FROM responses") == [(0,)]
    size = os.path.getsize(db)
    wal = Path(f"{db}-wal")
    assert size < 2 * 1024 * 1024, size  # the records only: a few hundred KB
    assert not wal.exists() or wal.stat().st_size == 0
    assert db_rows(db, "PRAGMA freelist_count")[0][0] < 64
    assert stats["idempotent/bytes_reclaimed"] > 10 * PAGE
