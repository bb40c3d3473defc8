"""The progress line: ``IdempotentLogStats``, enabled by the add-on."""

from __future__ import annotations

import logging
import re

import pytest
from local_site import LocalSite
from scrapy.exceptions import NotConfigured
from scrapy.utils.defer import deferred_f_from_coro_f
from scrapy.utils.test import get_crawler

from crawling import crawl_settings, run_crawl
from scrapy_idempotent import ConfigError, progress
from scrapy_idempotent.progress import IdempotentLogStats
from shop.spiders.shop import ShopSpider

LINE = re.compile(
    r"Frontier: (\d+) pending, (\d+) leased, (\d+) done, (\d+) failed; records this crawl: "
    r"(\d+) inserted, 0 updated, 0 unchanged \((\d+) stored\); run: (\d+) pages, "
    r"(\d+) items; (\d+) pages/min, (\d+) records/min"
)


@deferred_f_from_coro_f
async def test_the_progress_line_is_logged_every_interval(
    caplog: pytest.LogCaptureFixture, crawl_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="scrapy_idempotent.progress")
    # each line counts (a count slowed a second by a loaded machine is not kept for the next)
    monkeypatch.setattr(progress, "SLOW_COUNT_SECONDS", float("inf"))
    settings = crawl_settings(
        crawl_database, IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"},
        IDEMPOTENT_LOG_INTERVAL_SECONDS=0.1, CONCURRENT_REQUESTS=2,
        CONCURRENT_REQUESTS_PER_DOMAIN=2)
    with LocalSite(listing_pages=4, products_per_page=5, delay=0.05) as site:
        await run_crawl(ShopSpider, settings, url=site.url)
    lines = [r.getMessage() for r in caplog.records if r.name == "scrapy_idempotent.progress"]
    matches = [LINE.fullmatch(line) for line in lines]
    assert len(matches) >= 2 and all(matches), lines
    done = [int(m[3]) for m in matches if m]
    assert done == sorted(done) and done[-1] > 0
    for m in matches:
        assert m is not None and int(m[1]) + int(m[2]) + int(m[3]) <= 24
        # one crawl from an empty database: what it inserted is what is stored, or less for
        # a moment (a transaction committed by the writer thread whose result has not yet
        # reached the stats on the reactor thread)
        assert int(m[5]) <= int(m[6]) <= 20
        # one crawl of a new run: the run's items are what it inserted (committed), its
        # pages the done ones
        assert int(m[8]) == int(m[6]) and int(m[7]) == int(m[3])
    assert any(m is not None and int(m[9]) > 0 and int(m[10]) > 0 for m in matches)


def test_interval_zero_disables_it_and_a_bad_interval_is_refused() -> None:
    crawler = get_crawler(ShopSpider, {"IDEMPOTENT_LOG_INTERVAL_SECONDS": 0})
    with pytest.raises(NotConfigured):
        IdempotentLogStats.from_crawler(crawler)
    crawler = get_crawler(ShopSpider, {"IDEMPOTENT_LOG_INTERVAL_SECONDS": "soon"})
    with pytest.raises(ConfigError, match="IDEMPOTENT_LOG_INTERVAL_SECONDS='soon'"):
        IdempotentLogStats.from_crawler(crawler)


@deferred_f_from_coro_f
async def test_a_line_logged_while_a_commit_is_on_its_way_counts_it_on_both_sides(
    caplog: pytest.LogCaptureFixture, crawl_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh database, one crawl: every line says as many inserted as stored, even one
    asked for when a batch is committed but its result has not reached the stats yet (the
    moment the writer hands it back to the reactor)."""
    from scrapy import signals

    from scrapy_idempotent import scrapy_compat

    caplog.set_level(logging.INFO, logger="scrapy_idempotent.progress")
    monkeypatch.setattr(progress, "SLOW_COUNT_SECONDS", float("inf"))  # each line counts
    settings = crawl_settings(
        crawl_database, IDEMPOTENT_NATURAL_KEYS={"shop.items.ProductItem": "sku"},
        IDEMPOTENT_LOG_INTERVAL_SECONDS=86400, CONCURRENT_REQUESTS=2,
        CONCURRENT_REQUESTS_PER_DOMAIN=2)
    from scrapy.utils.test import get_crawler

    from crawling import crawl_to_end

    crawler = get_crawler(ShopSpider, settings)

    def opened() -> None:
        progress = next(m for m in crawler.extensions.middlewares
                        if isinstance(m, IdempotentLogStats))
        writer = scrapy_compat.engine_scheduler(crawler).writer
        committed = writer._committed

        def log_then_count(work: object, result: object) -> None:
            progress.log()  # asked for before the commit's result is counted
            committed(work, result)

        writer._committed = log_then_count

    crawler.signals.connect(opened, signal=signals.spider_opened)
    with LocalSite(listing_pages=2, products_per_page=5) as site:
        await crawl_to_end(crawler, url=site.url)
    lines = [r.getMessage() for r in caplog.records if r.name == "scrapy_idempotent.progress"]
    matches = [LINE.fullmatch(line) for line in lines]
    assert len(matches) >= 3 and all(matches), lines
    assert [(int(m[5]), int(m[6])) for m in matches if m] == [
        (int(m[6]), int(m[6])) for m in matches if m], lines
    assert max(int(m[6]) for m in matches if m) > 0


def test_a_line_showing_a_count_another_worker_kept_says_how_old_it_is(
        caplog: pytest.LogCaptureFixture) -> None:
    from scrapy_idempotent.store.reads import RunTotals

    caplog.set_level(logging.INFO, logger="scrapy_idempotent.progress")
    crawler = get_crawler(ShopSpider, {"IDEMPOTENT_LOG_INTERVAL_SECONDS": 60})
    extension = IdempotentLogStats.from_crawler(crawler)
    extension.store = object()  # type: ignore[assignment]  # (the spider is open)
    counts = {"pending": 7, "leased": 2, "done": 40, "failed": 1, "redirected": 3,
              "records": 39}
    extension._log_counts(((counts, 12.4), RunTotals(1, done=5)))
    extension._log_counts(((counts, 0.0), RunTotals(1, done=5)))
    lines = [r.getMessage() for r in caplog.records if r.name == "scrapy_idempotent.progress"]
    assert lines[0].startswith("Frontier, counted 12 s ago: 7 pending, 2 leased, 43 done, "
                               "1 failed; "), lines
    assert "(39 stored)" in lines[0]
    assert lines[1].startswith("Frontier: 7 pending, 2 leased, 43 done, 1 failed; "), lines
    assert LINE.fullmatch(lines[1]), lines


def test_a_worker_whose_count_is_slow_counts_again_only_after_twenty_times_as_long() -> None:
    crawler = get_crawler(ShopSpider, {"IDEMPOTENT_LOG_INTERVAL_SECONDS": 60})
    extension = IdempotentLogStats.from_crawler(crawler)
    now = [1000.0]
    extension._clock = lambda: now[0]

    class Store:
        """A frontier whose count takes ``took`` seconds of the clock."""

        def __init__(self) -> None:
            self.counted = 0
            self.took = 3.0

        def shared_counts(self, max_age: float) -> tuple[dict[str, int], float]:
            assert max_age == 30
            self.counted += 1
            now[0] += self.took
            return {"pending": self.counted}, 0.0

    store = Store()
    assert extension._count(store) == ({"pending": 1}, 0.0)  # type: ignore[arg-type]
    now[0] += 54  # 57 s after it started: within 20 x 3 s
    assert extension._count(store) == ({"pending": 1}, 57.0)  # type: ignore[arg-type]
    now[0] += 3
    assert extension._count(store) == ({"pending": 2}, 0.0)  # type: ignore[arg-type]
    store.took = 0.5  # quick now: counted at each line
    now[0] += 60
    assert extension._count(store) == ({"pending": 3}, 0.0)  # type: ignore[arg-type]
    assert extension._count(store) == ({"pending": 4}, 0.0)  # type: ignore[arg-type]
