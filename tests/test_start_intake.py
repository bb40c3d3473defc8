"""A long ``start()`` is taken in while downloads go on: Scrapy's engine asks for the next
start request without a reactor turn while the downloader is full, so a ``start()`` that
never awaits would be consumed to its end before any download, write or callback; the
add-on's spider middleware gives the reactor turns and waits for the writer once a window of
start requests is buffered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import scrapy
from local_site import LocalSite
from scrapy.exceptions import CloseSpider
from scrapy.utils.defer import deferred_f_from_coro_f

from crawling import crawl_settings, frontier_counts, run_crawl
from scrapy_idempotent import scheduler as scheduler_module
from scrapy_idempotent import scrapy_compat
from scrapy_idempotent.admission import START_CHECK_BATCH, START_WINDOW

#: Start requests yielded before the test looks for downloads: several windows.
MIDPOINT = 3 * START_WINDOW
#: Where start() gives up waiting for a download (a start() consumed without reactor turns
#: gets there, and the test fails instead of hanging).
LIMIT = 40_000


class LongStart(scrapy.Spider):
    """``start()`` never awaits: it yields until a response comes in after its
    :data:`MIDPOINT` (state, not time), noting the largest buffer of start requests seen."""

    name = "long_start"
    site_url = ""
    dont_filter = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.responses = 0
        self.yielded = 0
        self.at_midpoint: int | None = None
        self.max_buffered = 0
        self.start_done = False

    async def start(self) -> Any:
        tracker = scrapy_compat.engine_scheduler(self.crawler).tracker
        while self.yielded < LIMIT:
            if self.yielded == MIDPOINT:
                self.at_midpoint = self.responses
            elif self.at_midpoint is not None and self.responses > self.at_midpoint:
                break
            self.max_buffered = max(self.max_buffered, len(tracker.unattributed.requests))
            yield scrapy.Request(f"{self.site_url}/ok/start-{self.yielded}",
                                 dont_filter=self.dont_filter)
            self.yielded += 1
        self.start_done = True

    def parse(self, response: Any) -> None:
        self.responses += 1
        if self.start_done:
            raise CloseSpider("enough")


@pytest.mark.parametrize("dont_filter", [False, True])
@deferred_f_from_coro_f
async def test_downloads_go_on_while_a_long_start_is_taken_in(
        site: LocalSite, crawl_database: str, dont_filter: bool) -> None:
    spider = type("Spider", (LongStart,), {"site_url": site.url, "dont_filter": dont_filter})
    crawler = await run_crawl(spider, crawl_settings(crawl_database))
    spider_instance = crawler.spider or crawler.engine.spider
    # responses came in after the midpoint, while start() was still being consumed
    assert spider_instance.at_midpoint is not None
    assert spider_instance.yielded < LIMIT
    # memory held a window of the start list, not the list
    assert spider_instance.max_buffered <= START_WINDOW
    # and nothing yielded was lost: every start request is in the frontier
    assert sum(frontier_counts(crawl_database).values()) == spider_instance.yielded
    assert crawler.stats.get_value("finish_reason") == "enough"


#: Start requests of the kill test: ``HALF`` of them, then (once the release file exists)
#: the rest; every other one with dont_filter=True.
HALF, TOTAL = 2_500, 3_000
HALF_CONSUMED_SPIDER = f'''
import asyncio, os
import scrapy


class HalfConsumed(scrapy.Spider):
    name = "half_consumed"
    custom_settings = {{"ADDONS": {{"scrapy_idempotent.Addon": 0}}, "ROBOTSTXT_OBEY": False,
                       "CONCURRENT_REQUESTS": 16, "CONCURRENT_REQUESTS_PER_DOMAIN": 16,
                       "TELNETCONSOLE_ENABLED": False, "RETRY_ENABLED": False}}

    def __init__(self, url, release, **kwargs):
        super().__init__(**kwargs)
        self.url, self.release = url, release

    async def start(self):
        for i in range({TOTAL}):
            if i == {HALF}:
                while not os.path.exists(self.release):  # the first crawl waits here
                    await asyncio.sleep(0.05)
            yield scrapy.Request(f"{{self.url}}/ok/k-{{i}}", dont_filter=i % 2 == 0)

    def parse(self, response):
        return None
'''


@pytest.mark.slow
def test_a_kill_while_start_is_half_consumed_loses_and_duplicates_nothing(
        tmp_path: Path, crawl_database: str) -> None:
    import subprocess
    import sys

    from crawling import close_reason, wait_for

    spider = tmp_path / "half_consumed.py"
    spider.write_text(HALF_CONSUMED_SPIDER)
    db = crawl_database
    release = tmp_path / "release"

    def stored() -> int:
        try:
            return sum(frontier_counts(db).values())
        except Exception:  # not created yet
            return 0

    with LocalSite() as site:
        def run(log: str) -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-m", "scrapy", "runspider", str(spider), "-a",
                 f"url={site.url}", "-a", f"release={release}",
                 "-s", f"IDEMPOTENT_DATABASE={db}", "-s", f"LOG_FILE={tmp_path / log}"],
                cwd=tmp_path, stdin=subprocess.DEVNULL)

        first = run("first.log")
        try:
            # killed with a window of the start list written, the rest of start() not
            # consumed yet, downloads under way
            wait_for(lambda: stored() >= START_WINDOW and site.request_count > 0, 120,
                     "the first window of start requests", tmp_path / "first.log")
        finally:
            first.kill()
            first.wait()
        assert stored() <= HALF
        release.touch()
        second = run("second.log")
        assert second.wait(timeout=600) == 0
        counts = site.counts_by_path()
    assert close_reason(tmp_path / "second.log") == "finished"
    # every start request once in the frontier, done; each page fetched, and again only
    # if it was on the wire at the kill
    assert frontier_counts(db) == {"done": TOTAL}
    assert sorted(counts) == sorted(f"/ok/k-{i}" for i in range(TOTAL))
    assert sum(counts.values()) <= TOTAL + 16


#: Start requests of the resume test, and how many of them the resumed crawl yields before
#: it looks for downloads (several batches of the check).
RESUMED_TOTAL = 30_000
RESUMED_MIDPOINT = 6 * START_CHECK_BATCH


class ReplayedStart(scrapy.Spider):
    """The same ``RESUMED_TOTAL`` ``dont_filter`` start requests on every crawl (Scrapy's
    default for start requests). The first crawl stores them all and closes at its first
    response after that; the resumed one yields them again, and once past
    ``RESUMED_MIDPOINT`` stops as soon as a response has come in (state, not time)."""

    name = "replayed_start"
    site_url = ""
    resumed = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.responses = 0
        self.yielded = 0
        self.responses_while_checking = 0
        self.start_done = False
        self.scheduled = 0

    @classmethod
    def from_crawler(cls, crawler: Any, *args: Any, **kwargs: Any) -> Any:
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider._scheduled, signal=scrapy.signals.request_scheduled)
        return spider

    def _scheduled(self) -> None:
        self.scheduled += 1

    async def start(self) -> Any:
        for i in range(RESUMED_TOTAL):
            if self.resumed and i >= RESUMED_MIDPOINT and self.responses:
                self.responses_while_checking = self.responses
                break
            yield scrapy.Request(f"{self.site_url}/ok/resumed-{i}", dont_filter=True)
            self.yielded += 1
        self.start_done = True

    def parse(self, response: Any) -> None:
        self.responses += 1
        if self.start_done:
            raise CloseSpider("enough")


@deferred_f_from_coro_f
async def test_a_resumed_long_start_is_checked_in_batches_while_pending_requests_download(
        site: LocalSite, crawl_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    first = type("First", (ReplayedStart,), {"site_url": site.url})
    # the first crawl takes its whole start() in without waiting for downloads (it would
    # wait while 1,000 requests are pending): the resumed one finds most of them pending
    with monkeypatch.context() as patched:
        patched.setattr(scheduler_module, "START_AHEAD", 0)
        await run_crawl(first, crawl_settings(crawl_database, CONCURRENT_REQUESTS=1,
                                              CONCURRENT_REQUESTS_PER_DOMAIN=1))
    stored = frontier_counts(crawl_database)
    assert sum(stored.values()) == RESUMED_TOTAL
    assert stored.get("pending", 0) > RESUMED_TOTAL // 2  # the resumed crawl has work at once

    resumed = type("Resumed", (ReplayedStart,), {"site_url": site.url, "resumed": True})
    crawler = await run_crawl(resumed, crawl_settings(crawl_database))
    spider = crawler.spider or crawler.engine.spider
    # pending requests were downloaded while start() was still being checked: responses came
    # in before the replayed start() reached its end
    assert spider.responses_while_checking > 0
    assert RESUMED_MIDPOINT <= spider.yielded < RESUMED_TOTAL
    # the known start requests were checked before the engine: none of them was scheduled
    # (only the pending requests claimed from the frontier were)
    assert spider.scheduled <= spider.responses + 64
    stats = crawler.stats
    assert (stats.get_value("idempotent/requests/duplicate", 0)
            + stats.get_value("idempotent/requests/already_done", 0)) == spider.yielded
    # and nothing was stored twice: the replayed start requests found their own keys
    assert sum(frontier_counts(crawl_database).values()) == RESUMED_TOTAL


def test_start_request_ranks_past_the_memory_bound_give_the_same_keys() -> None:
    """The ranks of ``dont_filter`` start requests move to a temporary file past a bound
    (memory does not grow with the start list); the keys are those counted in memory, one by
    one or in batches, repeated fingerprints included, and the file is removed at close."""
    from scrapy_idempotent.keys import RequestKeys

    fingerprints = [f"{n % 7:040x}" if n % 3 == 0 else f"{n:040x}" for n in range(60)]
    in_memory, bounded = RequestKeys(), RequestKeys(in_memory=5)
    expected = [in_memory.key(fp, filtered=False, parent_key=None, parent_counts=None,
                              is_start=True) for fp in fingerprints]
    got = bounded.root_keys(fingerprints[:3], is_start=True) + [
        bounded.key(fp, filtered=False, parent_key=None, parent_counts=None, is_start=True)
        for fp in fingerprints[3:20]] + bounded.root_keys(fingerprints[20:], is_start=True)
    assert got == expected
    assert len(set(got)) == len(got)
    counts = bounded._root_counts
    assert len(counts) == 0 and counts._path is not None  # nothing in memory: in the file
    path = Path(counts._path)
    assert path.exists()
    bounded.close()
    in_memory.close()
    assert not path.exists()
